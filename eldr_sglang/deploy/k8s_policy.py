"""Who may talk to whom, and how many pods may be disrupted at once: the NetworkPolicies
and PodDisruptionBudgets of the Kubernetes manifests.

* engine pods (prefill, decode) take HTTP, bootstrap and KV transfers only from the
  cluster's own pods (the router and the other engines); their ``eldr-metrics`` port
  from anywhere; their HTTP port (SGLang's ``/metrics``) also from pods labelled
  ``eldr-sglang/metrics-scraper: "true"`` in any namespace (label Prometheus so);
* the router takes client HTTP from anywhere, its signature stream only from prefill pods;
* voluntary disruptions (node drains) take at most one pod of each role at a time.
"""

from __future__ import annotations

from typing import Callable

from .spec import Cluster

SCRAPER_LABEL = {"eldr-sglang/metrics-scraper": "true"}
ENGINES = ("prefill", "decode")


def _selector(instance: dict, components: tuple[str, ...]) -> dict:
    return {"matchLabels": instance,
            "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                                  "values": list(components)}]}


def network_policies(cluster: Cluster, meta: Callable[[str], dict], instance: dict,
                     signature_port: bool) -> list[dict]:
    """The engines' and the router's ingress rules (``instance``: the cluster's pod labels)."""
    same_cluster = [{"podSelector": {"matchLabels": instance}}]
    engines = {"podSelector": _selector(instance, ENGINES), "policyTypes": ["Ingress"], "ingress": [
        {"from": same_cluster},
        {"ports": [{"port": "eldr-metrics", "protocol": "TCP"}]},
        {"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": SCRAPER_LABEL}}],
         "ports": [{"port": "http", "protocol": "TCP"}]},
    ]}
    router_rules: list[dict] = [{"ports": [{"port": "http", "protocol": "TCP"}]}]
    if signature_port:
        router_rules.append({"from": [{"podSelector": _selector(instance, ("prefill",))}],
                             "ports": [{"port": "signature", "protocol": "TCP"}]})
    router = {"podSelector": _selector(instance, ("router",)), "policyTypes": ["Ingress"], "ingress": router_rules}
    return [{"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
             "metadata": meta(f"{cluster.name}-{part}"), "spec": spec}
            for part, spec in (("engines", engines), ("router", router))]


def disruption_budgets(cluster: Cluster, meta: Callable[[str], dict], instance: dict) -> list[dict]:
    """One PodDisruptionBudget per role: at most one of its pods down by a voluntary disruption."""
    return [{"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta(f"{cluster.name}-{role}"),
             "spec": {"maxUnavailable": 1, "selector": _selector(instance, (role,))}}
            for role in (*ENGINES, "router")]
