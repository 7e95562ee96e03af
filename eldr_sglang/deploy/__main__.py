"""``python -m eldr_sglang.deploy``: launch commands for an ELDR PD cluster.

    python -m eldr_sglang.deploy presets
    python -m eldr_sglang.deploy check   (CLUSTER.yaml | --preset NAME) [--skip-files]
    python -m eldr_sglang.deploy dry-run (CLUSTER.yaml | --preset NAME) [--skip-files]
    python -m eldr_sglang.deploy scripts (CLUSTER.yaml | --preset NAME) --out DIR [--skip-files]
    python -m eldr_sglang.deploy k8s     (CLUSTER.yaml | --preset NAME) --out DIR [--namespace NS] [--image IMAGE]

Every subcommand validates the description and (unless ``--skip-files``) the
calibration artifact and placement files it names; ``check`` stops there,
``dry-run`` prints every command per node, ``scripts`` writes ``NODE.sh`` and
``NODE-stop.sh`` per node (:mod:`.scripts`); ``k8s`` writes Kubernetes manifests
(``kubectl apply -f DIR``), reading the calibration artifact into a ConfigMap: like
``check``, a missing or unfitting artifact is an error. A bad description prints
``error: FIELD: ...`` and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .commands import Launch, build_launches
from .files import check_files
from .k8s import K8sOptions, build_manifests, signature_key_notes, write_manifests
from .presets import load_description, preset_names
from .scripts import write_scripts
from .spec import Cluster, DescriptionError, parse_cluster


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eldr_sglang.deploy", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("presets", help="list the shipped cluster descriptions")
    for name, text in (("check", "validate a description and its files"), ("dry-run", "print every command"),
                       ("scripts", "write one shell script per node"), ("k8s", "write Kubernetes manifests")):
        p = sub.add_parser(name, help=text)
        source = p.add_mutually_exclusive_group(required=True)
        source.add_argument("description", nargs="?", help="cluster description YAML")
        source.add_argument("--preset", choices=preset_names(), help="a shipped description")
        if name != "k8s":  # k8s reads the artifact into a ConfigMap: always checked
            p.add_argument("--skip-files", action="store_true",
                           help="do not open the artifact and placement files (they are checked by default)")
        if name == "scripts":
            p.add_argument("--out", required=True, help="directory for NODE.sh scripts")
        if name == "k8s":
            add_k8s_arguments(p)
    return ap


def add_k8s_arguments(p: argparse.ArgumentParser) -> None:
    d = K8sOptions()
    p.add_argument("--out", required=True, help="directory for the manifests (kubectl apply -f DIR)")
    p.add_argument("--namespace", default=d.namespace, help="namespace of every object (default: %(default)s)")
    p.add_argument("--image", default=d.image,
                   help="image with SGLang and eldr-sglang installed, for engines and router (default: "
                        "eldr-sglang:VERSION-VENDOR, built from the repository's Dockerfile: docs/DEPLOY.md)")
    p.add_argument("--router-replicas", type=int, default=d.router_replicas, help="router pods (default: 1)")
    p.add_argument("--artifact", help="read the calibration artifact from this file (default: the description's "
                                      "calibration path); pods see it at the description's path")
    p.add_argument("--cluster-domain", default=d.cluster_domain,
                   help="DNS domain of the cluster (default: %(default)s)")
    p.add_argument("--pin-nodes", action="store_true",
                   help="nodeSelector kubernetes.io/hostname: the description's node names")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "presets":
        for name in preset_names():
            print(name)
        return 0
    try:
        cluster = parse_cluster(load_description(args.description, args.preset))
        launches = build_launches(cluster)
        notes = check_files(cluster) if args.command != "k8s" and not args.skip_files else []
        if args.command == "check":
            notes += signature_key_notes(cluster)
        if args.command == "k8s":
            options = K8sOptions(namespace=args.namespace, image=args.image, router_replicas=args.router_replicas,
                                 pin_nodes=args.pin_nodes, artifact=args.artifact, cluster_domain=args.cluster_domain)
            manifests, notes = build_manifests(cluster, options)
    except DescriptionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for warning in cluster.warnings + notes:
        print(f"warning: {warning}", file=sys.stderr)
    if args.command == "check":
        print(summary(cluster, launches))
    elif args.command == "dry-run":
        print(render(cluster, launches))
    elif args.command == "k8s":
        for path in write_manifests(manifests, args.out):
            print(path)
    else:
        for path in write_scripts(cluster, launches, args.out):
            print(path)
    return 0


def summary(cluster: Cluster, launches: list[Launch]) -> str:
    n_prefill = sum(l.name.startswith("prefill-") for l in launches)
    n_decode = sum(l.name.startswith("decode-") for l in launches)
    gpus = sum(len(l.gpus) for l in launches)
    total = sum(n.gpus for n in cluster.nodes)
    used = (f"{n_prefill + n_decode} of {total} server slots" if cluster.vendor == "cpu"
            else f"{gpus} of {total} GPUs")
    return (f"ok {cluster.name}: {n_prefill} prefill + {n_decode} decode servers on {len(cluster.nodes)} nodes, "
            f"{used}, router on {cluster.router.node}:{cluster.router.port}")


def render(cluster: Cluster, launches: list[Launch]) -> str:
    """Every command, grouped by node, servers before the router."""
    lines = [f"# {summary(cluster, launches)}"]
    for warning in cluster.warnings:
        lines.append(f"# WARNING: {warning}")
    for node in cluster.nodes:
        mine = [l for l in launches if l.node == node.name]
        if not mine:
            continue
        unit = "server slots" if cluster.vendor == "cpu" else "GPUs"
        lines.append(f"\n# --- {node.name} ({node.host}, {node.gpus} {unit}) ---")
        lines.extend(l.shell() for l in mine)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
