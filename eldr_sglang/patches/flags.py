"""``--eldr-*`` flags on the stock ``python -m sglang.launch_server``.

SGLang's ``ServerArgs`` cannot take new fields, so an AROUND hook on
``prepare_server_args`` takes the ``--eldr-*`` flags out of argv, validates
them, and hands them to the server's child processes (scheduler, detokenizer)
as ``ELDR_*`` environment variables, which those processes inherit.
A bad value stops the launcher with a message naming the flag.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

logger = logging.getLogger("eldr_sglang")
ENV_KEY = "ELDR_ENGINE_CONFIG"


@dataclass(frozen=True)
class EngineConfig:
    """What the engine plugin does in this server (all off by default)."""

    calibration: str | None = None  # artifact: which layers to capture
    layers: tuple[int, ...] | str | None = None  # explicit layers, "all" (trace mode) or "spread"
    publish: str | None = None  # router callback URL for signature messages
    metrics_port: int | None = None  # Prometheus endpoint of the scheduler process
    trace_dir: str | None = None  # per-request expert counts (trace mode)
    publish_timeout: float = 2.0
    signature_key_file: str | None = None  # key signing published messages (else env ELDR_SIGNATURE_KEY)
    publish_allow: tuple[str, ...] | None = None  # CIDRs / host names a request may name as destination

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.calibration, self.layers, self.metrics_port, self.trace_dir))

    def to_env(self) -> str:
        return json.dumps(asdict(self))  # tuples become lists

    @classmethod
    def from_env(cls, environ=os.environ) -> "EngineConfig":
        raw = environ.get(ENV_KEY)
        if not raw:
            return cls()
        d = json.loads(raw)
        for key in ("layers", "publish_allow"):
            if isinstance(d.get(key), list):
                d[key] = tuple(d[key])
        return cls(**d)


SPREAD = "spread"  # --eldr-publish without layers: evenly spread layers (core.layer_selection)


class FlagError(ValueError):
    """A bad ``--eldr-*`` value; the message names the flag."""


def _layers(value: str) -> tuple[int, ...] | str:
    if value.strip().lower() == "all":
        return "all"
    try:
        layers = tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise FlagError(f"--eldr-layers: expected 'all' or comma-separated layer ids, got {value!r}")
    if not layers or min(layers) < 0 or len(set(layers)) != len(layers):
        raise FlagError(f"--eldr-layers: layer ids must be distinct and >= 0, got {value!r}")
    return layers


REQUEST_ONLY = "request"  # --eldr-publish request: only to the address each request carries


def _url(value: str) -> str:
    if value == REQUEST_ONLY:
        return value
    u = urlparse(value)
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme in ("http", "https") and u.netloc:
        return value
    if u.scheme == "tcp" and u.hostname and port:
        return value
    raise FlagError("--eldr-publish: expected http://router:8000/eldr/signature, "
                    "tcp://router:PORT (the router's --signature-port) or 'request' (only the "
                    f"return address each routed request carries), got {value!r}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise FlagError(f"ELDR flag without a value or malformed: {message}")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="sglang.launch_server", add_help=False, allow_abbrev=False,
                description="eldr-sglang plugin flags (expert-locality-aware decode routing)")
    p.add_argument("--eldr-calibration", dest="calibration", metavar="PATH",
                   help="calibration artifact: capture its selected layers")
    p.add_argument("--eldr-layers", dest="layers", metavar="all|0,3,7",
                   help="capture these layers without an artifact (with --eldr-publish and no "
                        "artifact: 4 evenly spread layers)")
    p.add_argument("--eldr-publish", dest="publish", metavar="URL",
                   help="PD prefill: send each request's signature to the address it carries, else "
                        "here: tcp://ROUTER:PORT, http://ROUTER:PORT/eldr/signature, or 'request'")
    p.add_argument("--eldr-metrics-port", dest="metrics_port", metavar="PORT",
                   help="Prometheus endpoint of the scheduler (distinct experts per decode step)")
    p.add_argument("--eldr-trace-dir", dest="trace_dir", metavar="DIR",
                   help="trace mode: per-request expert counts as JSON lines")
    p.add_argument("--eldr-publish-timeout", dest="publish_timeout", metavar="S",
                   help="connect/send timeout of one publish (default 2, > 0)")
    p.add_argument("--eldr-publish-allow", dest="publish_allow", metavar="CIDR_OR_HOST[,...]",
                   help="destinations a request may name for its signature (default: with 'request' this "
                        "machine only, with a URL any); the --eldr-publish URL's host is always allowed")
    p.add_argument("--eldr-signature-key-file", dest="signature_key_file", metavar="PATH",
                   help="sign published messages with this shared key (HMAC-SHA256; the routers' "
                        "--signature-key-file; default: env ELDR_SIGNATURE_KEY)")
    return p


def eldr_help() -> str:
    """The ``--eldr-*`` flags' help, printed before SGLang's own ``--help``."""
    return _parser().format_help()


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate ``--eldr-*`` flags (and their values) from SGLang's own."""
    ours, theirs, i = [], [], 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--eldr-"):
            ours.append(a)
            if "=" not in a and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                ours.append(argv[i + 1])
                i += 1
        else:
            theirs.append(a)
        i += 1
    return ours, theirs


def parse_eldr_flags(argv: list[str]) -> EngineConfig:
    """Parse and validate ``--eldr-*`` flags; raise FlagError naming the bad one."""
    known = [opt for action in _parser()._actions for opt in action.option_strings]
    for a in argv:
        if a.startswith("--eldr-") and a.split("=")[0] not in known:
            raise FlagError(f"unknown flag {a.split('=')[0]} (known: {', '.join(known)})")
    ns, rest = _parser().parse_known_args(argv)
    if rest:
        raise FlagError(f"ELDR flag without a value or malformed: {' '.join(rest)}")
    kw: dict = {}
    if ns.calibration is not None:
        if not Path(ns.calibration).is_file():
            raise FlagError(f"--eldr-calibration: no such file: {ns.calibration}")
        from eldr_sglang.core.artifact import load_artifact

        try:
            load_artifact(ns.calibration)
        except ValueError as exc:
            raise FlagError(f"--eldr-calibration: {exc}") from None
        kw["calibration"] = str(Path(ns.calibration).resolve())
    if ns.layers is not None:
        if ns.calibration is not None:
            raise FlagError("--eldr-layers and --eldr-calibration are exclusive (the artifact names the layers)")
        kw["layers"] = _layers(ns.layers)
    if ns.publish is not None:
        if ns.calibration is None and ns.layers is None:
            kw["layers"] = SPREAD  # no artifact yet (a router with --online learns one)
        kw["publish"] = _url(ns.publish)
    if ns.publish_allow is not None:
        if ns.publish is None:
            raise FlagError("--eldr-publish-allow: only with --eldr-publish (it limits where signatures go)")
        from eldr_sglang.patches.publish_allow import parse_entries

        try:
            kw["publish_allow"] = parse_entries(ns.publish_allow)
        except ValueError as exc:
            raise FlagError(f"--eldr-publish-allow: {exc}") from None
    if ns.signature_key_file is not None or ns.publish is not None:
        from eldr_sglang.core.wire import load_key

        try:
            load_key(ns.signature_key_file, "--eldr-signature-key-file")
        except ValueError as exc:
            raise FlagError(str(exc)) from None
        if ns.signature_key_file is not None:
            kw["signature_key_file"] = str(Path(ns.signature_key_file).resolve())
    if ns.metrics_port is not None:
        if not ns.metrics_port.isdigit() or not 0 < int(ns.metrics_port) < 65536:
            raise FlagError(f"--eldr-metrics-port: expected a TCP port, got {ns.metrics_port!r}")
        kw["metrics_port"] = int(ns.metrics_port)
    if ns.trace_dir is not None:
        Path(ns.trace_dir).mkdir(parents=True, exist_ok=True)
        kw["trace_dir"] = str(Path(ns.trace_dir).resolve())
        if ns.calibration is None and ns.layers is None:
            kw["layers"] = "all"  # nothing to publish: trace only
    if ns.publish_timeout is not None:
        try:
            kw["publish_timeout"] = float(ns.publish_timeout)
        except ValueError:
            raise FlagError(f"--eldr-publish-timeout: expected seconds, got {ns.publish_timeout!r}") from None
        if not 0 < kw["publish_timeout"] < float("inf"):
            raise FlagError(f"--eldr-publish-timeout: expected a number of seconds > 0, got {ns.publish_timeout!r}")
    return EngineConfig(**kw)


def check_model(config: EngineConfig, model_path: str) -> None:
    """Refuse an artifact (or layer ids) that does not fit a local model."""
    cfg_file = Path(model_path) / "config.json"
    if not cfg_file.is_file():
        return  # a hub id: checked again in the scheduler once the model is loaded
    from eldr_sglang.core.traces import ModelSpec

    try:
        spec = ModelSpec.from_hf_config(json.loads(cfg_file.read_text()), str(model_path))
    except ValueError as exc:
        raise FlagError(f"ELDR needs an MoE model: {exc}") from None
    check_model_dims(config, spec.num_layers, spec.num_experts, spec.top_k)


def check_model_dims(config: EngineConfig, num_layers, num_experts, top_k) -> None:
    if config.calibration:
        from eldr_sglang.core.artifact import load_artifact

        try:
            load_artifact(config.calibration,
                          expect_model={"num_layers": num_layers, "num_experts": num_experts, "top_k": top_k})
        except ValueError as exc:
            raise FlagError(f"--eldr-calibration does not fit the served model: {exc}") from None
    elif isinstance(config.layers, tuple) and num_layers is not None and max(config.layers) >= num_layers:
        raise FlagError(f"--eldr-layers: layer {max(config.layers)} does not exist (model has {num_layers} layers)")


GRAPH_FLAGS = {"prefill": "--disable-prefill-cuda-graph", "decode": "--disable-decode-cuda-graph"}
TWO_BATCH_OVERLAP = "--enable-two-batch-overlap"
# MoE runner backends whose top-k output skips select_experts (TRITON_KERNEL, BYPASSED formats)
BYPASSING_MOE_BACKENDS = ("triton_kernel", "flashinfer_trtllm", "experimental_sgl_trtllm", "flashinfer_mxfp4")


def graph_off_reasons(config: EngineConfig, argv: list[str]) -> dict[str, str]:
    """Phases whose CUDA graph the capture cannot run in, with the reason.

    The capture is graph-safe (static staging written inside the forward, the
    live batch read after it), so the graphs stay on for signatures and decode
    statistics. Two cases read the live batch inside the forward:

    * trace mode: per-request gate sums need ``extend_seq_lens`` per prefill
      (prefill only; its per-request decode counts are made after the forward);
    * two-batch overlap: the two micro-batches of a forward share the staging
      rows, told apart only by a Python cursor (both phases)."""
    reasons: dict[str, str] = {}
    if config.trace_dir:
        reasons["prefill"] = "trace mode sums gate probabilities per request inside the forward"
    if any(a == TWO_BATCH_OVERLAP or a.startswith(TWO_BATCH_OVERLAP + "=") for a in argv):
        for phase in GRAPH_FLAGS:
            reasons[phase] = "two-batch overlap splits each forward into micro-batches that share the staging rows"
    return reasons


def graph_safe_argv(config: EngineConfig, argv: list[str], gpu: bool | None = None) -> list[str]:
    """SGLang's argv with a CUDA graph turned off only where ELDR's capture cannot
    run inside it (:func:`graph_off_reasons`), each change logged. Signatures and
    decode statistics keep both graphs on. Nothing changes on CPU, without ELDR
    capture, or for a phase whose graph backend the operator chose explicitly
    (then a warning says what the capture misses there)."""
    if gpu is None:
        import torch

        device = _argv_value(argv, "--device")
        gpu = device in ("cuda", "hip") or (device is None and torch.cuda.is_available())
    if not gpu or not config.active:
        return argv
    out = list(argv)
    reasons = graph_off_reasons(config, argv)
    for phase, flag in GRAPH_FLAGS.items():
        if phase not in reasons:
            continue
        off_already = flag in argv or "--disable-cuda-graph" in argv \
            or _argv_value(argv, f"--cuda-graph-backend-{phase}") == "disabled"
        chosen = _argv_value(argv, f"--cuda-graph-backend-{phase}") is not None or "--cuda-graph-config" in argv \
            or any(a.startswith("--cuda-graph-config=") for a in argv)
        if off_already:
            continue
        if chosen:
            logger.warning("eldr-sglang: the %s CUDA graph backend was set explicitly and stays on, but %s: "
                           "that capture is wrong under graph replays", phase, reasons[phase])
            continue
        out.append(flag)
        logger.warning("eldr-sglang: %s CUDA graph turned off on this server (%s): %s", phase, flag, reasons[phase])
    kept = [phase for phase in GRAPH_FLAGS if phase not in reasons]
    if kept:
        logger.info("eldr-sglang: %s CUDA graph(s) stay on: the expert capture is graph-safe", " and ".join(kept))
    backend = _argv_value(argv, "--moe-runner-backend")
    if backend in BYPASSING_MOE_BACKENDS:
        logger.info("eldr-sglang: --moe-runner-backend %s routes without select_experts; the captured layers "
                    "compute their top-k once more through select_experts (graph-safe)", backend)
    return out


def _argv_value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def prepare_server_args_around(original, argv, *args, **kwargs):
    """AROUND hook for ``sglang.srt.server_args.prepare_server_args``."""
    ours, theirs = split_argv(list(argv))
    if "-h" in theirs or "--help" in theirs:
        sys.stdout.write(eldr_help() + "\n")
    if not ours:
        return original(argv, *args, **kwargs)
    try:
        config = parse_eldr_flags(ours)
        if config.active:  # fail loud: a renamed hook target would capture nothing
            from eldr_sglang.patches.targets import check_sglang

            check_sglang()
        server_args = original(graph_safe_argv(config, theirs), *args, **kwargs)
        check_model(config, server_args.model_path)
        mode = str(getattr(server_args, "disaggregation_mode", "null"))
        if config.publish and mode != "prefill":
            raise FlagError(f"--eldr-publish: only a PD prefill server publishes signatures "
                            f"(this one has --disaggregation-mode {mode})")
    except (FlagError, RuntimeError) as exc:
        sys.stderr.write(f"error: eldr-sglang: {exc}\n")
        raise SystemExit(2)
    os.environ[ENV_KEY] = config.to_env()
    return server_args
