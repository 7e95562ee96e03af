"""Launch commands for every server and the router of a validated :class:`Cluster`.

Late binding (the ELDR router picks decode after prefill) needs, on every server,
``--disaggregation-decode-allocation-policy prefill_complete`` and the Mooncake
backend (SGLang 0.5.23, ``arg_groups/pd_disaggregation_hook.py``); every server runs
with SGLang's ``--enable-metrics`` (TTFT and TPOT histograms on its HTTP ``/metrics``).
Decode order = calibration centroid order = placement file ``server-KK.json``.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Sequence

from .spec import Cluster, DescriptionError, Role
from eldr_sglang.core.policies import policy_spec, reads_artifact

VISIBLE_DEVICES = {"cuda": "CUDA_VISIBLE_DEVICES", "rocm": "HIP_VISIBLE_DEVICES"}
# vendor cpu (docs/DEVELOPMENT.md, "CPU machines"): SGLang's CPU engine, its pool kept at ~2.5 GB
CPU_ENV = (("SGLANG_USE_CPU_ENGINE", "1"),)
CPU_ENGINE_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens", "16384",
                   "--skip-server-warmup")
CPU_DECODE_ARGS = ("--disaggregation-decode-retraction-backup", "none")
# a CPU prefill takes seconds per request: the router waits that long for a signature, and a
# busy CPU server answers /health slowly (the defaults, 10 s and 2 s, are GPU figures)
CPU_ROUTER_ARGS = (("--signature-timeout", "60"), ("--health-timeout", "10"))


@dataclass(frozen=True)
class Launch:
    """One process on one node."""

    name: str  # prefill-0, decode-3, router
    node: str
    host: str
    gpus: tuple[int, ...]
    env: tuple[tuple[str, str], ...]
    argv: tuple[str, ...]
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def shell(self, log_dir: str | None = None) -> str:
        line = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.env), *map(shlex.quote, self.argv)])
        if log_dir is None:
            return line
        return f"{line} > {shlex.quote(str(PurePosixPath(log_dir) / (self.name + '.log')))} 2>&1 &"


def assign_gpus(cluster: Cluster, role: Role, used: dict[str, set[int]]) -> list[tuple[str, tuple[int, ...]]]:
    """(node, GPUs) per server of ``role``; marks them in ``used``; errors name the field."""
    k = role.kind
    if role.servers:
        if len(role.servers) != role.count:
            raise DescriptionError(f"{k}.servers: {len(role.servers)} entries for count {role.count}")
        out = []
        for i, pin in enumerate(role.servers):
            node = cluster.node(pin.node)
            where = f"{k}.servers[{i}].gpus"
            if len(pin.gpus) != role.tp_size:
                raise DescriptionError(f"{where}: {len(pin.gpus)} GPUs for tp_size {role.tp_size}")
            for g in pin.gpus:
                if g >= node.gpus:
                    raise DescriptionError(f"{where}: GPU {g} does not exist on {node.name} ({node.gpus} GPUs)")
                if g in used[node.name]:
                    raise DescriptionError(f"{where}: GPU {g} of {node.name} is used twice")
                used[node.name].add(g)
            out.append((node.name, pin.gpus))
        return out
    out = []
    for name in role.nodes:
        node = cluster.node(name)
        while len(out) < role.count:
            free = [g for g in range(node.gpus) if g not in used[name]]
            if len(free) < role.tp_size:
                break
            take = tuple(free[: role.tp_size])
            used[name].update(take)
            out.append((name, take))
    if len(out) < role.count:
        raise DescriptionError(f"{k}.count: {role.count} servers of tp_size {role.tp_size} do not fit on "
                               f"{k}.nodes {list(role.nodes)} (room for {len(out)} beside the other role)")
    return out


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The last value of ``flag`` (``--flag v`` or ``--flag=v``) in ``argv``, else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def has_flag(argv: Sequence[str], flag: str) -> bool:
    """``argv`` gives ``flag`` (``--flag v`` or ``--flag=v``)."""
    return any(a.split("=")[0] == flag for a in argv)


def publish_allow_args(cluster: Cluster, router_host: str) -> list[str]:
    """``--eldr-publish-allow`` for the prefill servers: the router's host and the host it
    advertises as its return address, so a client reaching a prefill server cannot make it
    connect elsewhere. None when ``prefill.extra_args`` sets it, or when the router
    advertises an address only known at run time (``$(POD_IP)``: ``kubernetes.publish_allow``)."""
    if has_flag(cluster.prefill.extra_args, "--eldr-publish-allow"):
        return []
    advertised = flag_value(cluster.router.extra_args, "--advertise-host")
    if advertised and "$(" in advertised:
        return []
    return ["--eldr-publish-allow", ",".join(dict.fromkeys(h for h in (router_host, advertised) if h))]


def build_launches(cluster: Cluster) -> list[Launch]:
    """Prefill servers, decode servers (centroid order), then the router."""
    used: dict[str, set[int]] = {n.name: set() for n in cluster.nodes}
    ports: dict[str, dict[int, str]] = {n.host: {} for n in cluster.nodes}
    launches: list[Launch] = []
    per_node: dict[tuple[str, str], int] = {}
    pd = ["--disaggregation-transfer-backend", cluster.transfer_backend,
          "--disaggregation-decode-allocation-policy", "prefill_complete"]
    if cluster.ib_device:
        pd += ["--disaggregation-ib-device", cluster.ib_device]
    r = cluster.router
    router_host = cluster.node(r.node).host
    publish = (f"tcp://{router_host}:{r.signature_port}" if r.signature_port is not None
               else f"http://{router_host}:{r.port}/eldr/signature")
    allow = publish_allow_args(cluster, router_host)
    prefill_targets: list[tuple[str, int]] = []
    for role in (cluster.prefill, cluster.decode):
        for i, (node_name, gpus) in enumerate(assign_gpus(cluster, role, used)):
            node = cluster.node(node_name)
            slot = per_node.get((role.kind, node_name), 0)
            per_node[(role.kind, node_name)] = slot + 1
            port = role.port + slot
            name = f"{role.kind}-{i}"
            _claim(ports, node.host, port, f"{role.kind}.port", name)
            argv = [cluster.python, "-m", "sglang.launch_server", "--model-path", cluster.model_path,
                    "--host", cluster.engine_host, "--port", str(port), "--tp-size", str(role.tp_size),
                    "--disaggregation-mode", role.kind, *pd, "--enable-metrics"]
            if cluster.vendor == "cpu":
                argv += [*CPU_ENGINE_ARGS, *(CPU_DECODE_ARGS if role.kind == "decode" else ())]
            if role.ep_size > 1:
                argv += ["--ep-size", str(role.ep_size)]
            if role.tp_size > 1:
                argv += ["--attn-dp-size", str(role.tp_size)]  # attention TP 1 (late binding)
            if role.kind == "prefill":
                boot = role.bootstrap_port + slot
                _claim(ports, node.host, boot, "prefill.bootstrap_port", name)
                argv += ["--disaggregation-bootstrap-port", str(boot),
                         "--eldr-calibration", cluster.calibration, "--eldr-publish", publish,
                         *allow]
                prefill_targets.append((f"http://{node.host}:{port}", boot))
            if role.kind == "decode" and role.ep_size > 1:
                argv += ["--init-expert-location", str(PurePosixPath(role.placement_dir) / f"server-{i:02d}.json")]
                if role.num_redundant_experts:
                    argv += ["--ep-num-redundant-experts", str(role.num_redundant_experts)]
            if role.metrics_port is not None:
                metrics = role.metrics_port + slot
                _claim(ports, node.host, metrics, f"{role.kind}.metrics_port", name)
                argv += ["--eldr-metrics-port", str(metrics)]
            argv += _extra(argv, role.extra_args, f"{role.kind}.extra_args")
            devices = (CPU_ENV if cluster.vendor == "cpu"
                       else ((VISIBLE_DEVICES[cluster.vendor], ",".join(map(str, gpus))),))
            env = (*devices, *role.env)
            launches.append(Launch(name, node_name, node.host, gpus, env, tuple(argv), port))
    _claim(ports, router_host, r.port, "router.port", "router")
    if r.signature_port is not None:
        _claim(ports, router_host, r.signature_port, "router.signature_port", "router")
    argv = [cluster.python, "-m", "eldr_sglang.router"]
    for url, boot in prefill_targets:
        argv += ["--prefill", url, str(boot)]
    engines = []
    for launch in launches:
        if launch.name.startswith("decode-"):
            argv += ["--decode", launch.url]
            port = flag_value(launch.argv, "--eldr-metrics-port")
            if port is not None:
                engines.append(f"http://{launch.host}:{port}/metrics")
    if engines and len(engines) == cluster.decode.count and not has_flag(r.extra_args, "--engine-metrics"):
        argv += ["--engine-metrics", ",".join(engines)]  # live batches and step laws (load poll), A/B counters
    argv += ["--policy", r.policy]
    spec = policy_spec(r.policy)
    if reads_artifact(spec):  # the default (eldr_balanced) too: without it, it routes blind
        argv += ["--calibration", cluster.calibration]
        if r.tau is not None and spec.needs_artifact:  # else the artifact's tau (set by calibrate) applies
            argv += ["--tau", f"{r.tau:g}"]
    argv += ["--host", r.host, "--port", str(r.port)]
    if r.signature_port is not None:
        argv += ["--signature-port", str(r.signature_port)]
    if not has_flag(r.extra_args, "--advertise-host"):
        argv += ["--advertise-host", router_host]  # the return address the prefill allow-list names
    if cluster.vendor == "cpu":
        for name, value in CPU_ROUTER_ARGS:
            if not has_flag(r.extra_args, name):
                argv += [name, value]
    argv += _extra(argv, r.extra_args, "router.extra_args")
    launches.append(Launch("router", r.node, router_host, (), (), tuple(argv), r.port))
    return launches


def _extra(argv: Sequence[str], extra: Sequence[str], field: str) -> list[str]:
    """``extra`` (a role's ``extra_args``); DescriptionError when it repeats a generated flag:
    the server would take the last one, silently replacing what the generator set."""
    for arg in extra:
        name = arg.split("=")[0]
        if name.startswith("--") and has_flag(argv, name):
            raise DescriptionError(f"{field}: {name} is generated ({name} {flag_value(argv, name)}); set it "
                                   f"through its description key, or leave it out of extra_args")
    return list(extra)


def _claim(ports: dict[str, dict[int, str]], host: str, port: int, field: str, owner: str) -> None:
    taken = ports[host]
    if port in taken:
        raise DescriptionError(f"{field}: port {port} on {host} ({owner}) collides with {taken[port]}")
    taken[port] = f"{owner} ({field})"
