"""``--eldr-*`` flags on the stock ``python -m sglang.launch_server``.

SGLang's ``ServerArgs`` cannot take new fields, so an AROUND hook on
``prepare_server_args`` takes the ``--eldr-*`` flags out of argv, validates
them, and hands them to the server's child processes (scheduler, detokenizer)
as ``ELDR_*`` environment variables, which those processes inherit.
A bad value stops the launcher with a message naming the flag.

Every flag is an :class:`EngineConfig` field: its name, metavar, help, the docs'
text and the function that reads its value live there, and the parser, the
validation and the docs' table (``python -m eldr_sglang.flag_tables``) are built
from them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import Field, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger("eldr_sglang")
ENV_KEY = "ELDR_ENGINE_CONFIG"
SPREAD = "spread"  # --eldr-publish without layers: evenly spread layers (core.layer_selection)
REQUEST_ONLY = "request"  # --eldr-publish request: only to the address each request carries


class FlagError(ValueError):
    """A bad ``--eldr-*`` value; the message names the flag."""


# ------------------------------------------------------------ one flag's value (ValueError: why not)
def _calibration(value: str) -> str:
    if not Path(value).is_file():
        raise ValueError(f"no such file: {value}")
    from eldr_sglang.core.artifact import load_artifact

    load_artifact(value)
    return str(Path(value).resolve())


def _layers(value: str) -> tuple[int, ...] | str:
    if value.strip().lower() == "all":
        return "all"
    try:
        layers = tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected 'all' or comma-separated layer ids, got {value!r}") from None
    if not layers or min(layers) < 0 or len(set(layers)) != len(layers):
        raise ValueError(f"layer ids must be distinct and >= 0, got {value!r}")
    return layers


def _url(value: str) -> str:
    if value == REQUEST_ONLY:
        return value
    from eldr_sglang import transports

    try:
        transports.parse(value)
    except ValueError as e:
        raise ValueError(f"{e} (the router's http://ROUTER:PORT/eldr/signature or tcp://ROUTER:PORT, its "
                         "--signature-port), or 'request' (only the return address each routed request "
                         "carries)") from None
    return value


def _port(value: str) -> int:
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise ValueError(f"expected a TCP port, got {value!r}")
    return int(value)


def _directory(value: str) -> str:
    Path(value).mkdir(parents=True, exist_ok=True)
    return str(Path(value).resolve())


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"expected seconds, got {value!r}") from None
    if not 0 < seconds < float("inf"):
        raise ValueError(f"expected a number of seconds > 0, got {value!r}")
    return seconds


def _allow_list(value: str) -> tuple[str, ...]:
    from eldr_sglang.patches.publish_allow import parse_entries

    return parse_entries(value)


def _path(value: str) -> str:
    return str(Path(value).resolve())


def _flag(help: str, metavar: str, read: Callable[[str], Any], default: Any = None,
          doc: str | None = None) -> Any:
    """An ``--eldr-<field name>`` flag: ``help`` for ``--help``, ``doc`` (default:
    ``help``) for the docs' table, ``read`` turns its text into the value."""
    return field(default=default, metadata={"help": help, "metavar": metavar, "read": read,
                                            "doc": doc or help})


@dataclass(frozen=True)
class EngineConfig:
    """What the engine plugin does in this server (all off by default)."""

    calibration: str | None = _flag(
        "calibration artifact: capture its selected layers", "PATH", _calibration,
        doc="calibration artifact: the server captures its selected layers; refused at start-up if "
            "corrupt or if its model (layers, experts, top-k) does not match the served model")
    layers: tuple[int, ...] | str | None = _flag(
        "capture these layers without an artifact (with --eldr-publish and no artifact: 4 evenly "
        "spread layers)", "all|0,3,7", _layers,
        doc="capture these layers without an artifact (exclusive with `--eldr-calibration`); with "
            "`--eldr-publish` and neither: 4 evenly spread layers")
    publish: str | None = _flag(
        "PD prefill: send each request's signature to the address it carries, else here: "
        "tcp://ROUTER:PORT, http://ROUTER:PORT/eldr/signature, or 'request'", "URL", _url,
        doc="where each request's signature message goes after its prefill when the request carries "
            "no return address of its own (ELDR routers always send one: "
            "`custom_params.eldr_signature_to`): `tcp://router:PORT` (the router's `--signature-port`: "
            "JSON lines on one kept-open connection, the fastest), `http://router:port/eldr/signature` "
            "(a POST per batch, kept-alive connection), or `request` (no default: only the address "
            "each request carries, for several router replicas). One kept-open connection per "
            "destination (at most 32, least recently used closed first); a destination that failed "
            "after `t` s is skipped for `20 t`")
    metrics_port: int | None = _flag(
        "Prometheus endpoint of the scheduler (distinct experts per decode step)", "PORT", _port,
        doc="Prometheus endpoint of the scheduler process: `eldr_decode_steps_total`, "
            "`eldr_decode_unique_experts_total`, `eldr_decode_unique_experts_per_step`, "
            "`eldr_signatures_sent_total`, `eldr_signatures_dropped_total`, "
            "`eldr_signatures_refused_destinations_total`; and `GET /eldr/batch` (decode servers): the live "
            "batch's per-expert usage and the last steps' batch size, distinct experts, KV tokens and "
            "forward time, which the router reads with `--engine-metrics` (bound to the server's `--host`)")
    trace_dir: str | None = _flag(
        "trace mode: per-request expert counts as JSON lines", "DIR", _directory,
        doc="trace mode: each request's prefill expert counts (all layers unless given) as JSON "
            "lines in `DIR/prefill-<pid>.jsonl`, decode counts in `DIR/decode-<pid>.jsonl`, "
            "per-step distinct experts in `DIR/steps-<pid>.jsonl` (PD prefill and decode servers, "
            "and plain servers)")
    publish_timeout: float = _flag("connect/send timeout of one publish (default 2, > 0)", "S",
                                   _seconds, 2.0,
                                   doc="connect/send timeout of one publish (seconds, > 0)")
    signature_key_file: str | None = _flag(
        "sign published messages with this shared key (HMAC-SHA256; the routers' "
        "--signature-key-file; default: env ELDR_SIGNATURE_KEY)", "PATH", _path,
        doc="sign every published body or line with this shared key (HMAC-SHA256; the routers' "
            "`--signature-key-file`); default: env `ELDR_SIGNATURE_KEY`. A missing or empty file (or a "
            "set but empty variable) stops the launcher naming it")
    publish_allow: tuple[str, ...] | None = _flag(
        "destinations a request may name for its signature (default: with 'request' this machine "
        "only, with a URL any); the --eldr-publish URL's host is always allowed",
        "CIDR_OR_HOST[,...]", _allow_list,
        doc="return addresses a request may name for its signature: CIDRs or addresses (`10.0.0.0/8`) "
            "allow addresses inside them, host names (`eldr-router`) allow that name and its addresses "
            "(re-resolved at most every 30 s; an unlisted name is never resolved). The `--eldr-publish "
            "URL` host is always allowed. Default: with `--eldr-publish request`, this machine only "
            "(loopback, its host name and addresses); with `--eldr-publish URL`, any address (as "
            "before; a warning at start says so). A refused address is never connected to: its "
            "message goes to the `--eldr-publish URL` (or is dropped), counted in "
            "`eldr_signatures_refused_destinations_total`, logged once per address. See [who may talk "
            "to whom](ROUTER_HARDENING.md#who-may-talk-to-whom)")

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


def flag_of(f: Field) -> str:
    """The command-line flag of an :class:`EngineConfig` field."""
    return "--eldr-" + f.name.replace("_", "-")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise FlagError(f"ELDR flag without a value or malformed: {message}")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="sglang.launch_server", add_help=False, allow_abbrev=False,
                description="eldr-sglang plugin flags (expert-locality-aware decode routing)")
    for f in fields(EngineConfig):
        p.add_argument(flag_of(f), dest=f.name, metavar=f.metadata["metavar"], help=f.metadata["help"])
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
    p = _parser()
    known = [opt for action in p._actions for opt in action.option_strings]
    for a in argv:
        if a.startswith("--eldr-") and a.split("=")[0] not in known:
            raise FlagError(f"unknown flag {a.split('=')[0]} (known: {', '.join(known)})")
    ns, rest = p.parse_known_args(argv)
    if rest:
        raise FlagError(f"ELDR flag without a value or malformed: {' '.join(rest)}")
    given = {f.name: getattr(ns, f.name) for f in fields(EngineConfig) if getattr(ns, f.name) is not None}
    kw: dict[str, Any] = {}
    for f in fields(EngineConfig):
        if f.name in given:
            try:
                kw[f.name] = f.metadata["read"](given[f.name])
            except ValueError as exc:
                raise FlagError(f"{flag_of(f)}: {exc}") from None
    return EngineConfig(**_together(kw, given))


def _together(kw: dict[str, Any], given: dict[str, str]) -> dict[str, Any]:
    """The rules between flags: exclusive pairs, what one flag implies for another."""
    if "layers" in given and "calibration" in given:
        raise FlagError("--eldr-layers and --eldr-calibration are exclusive (the artifact names the layers)")
    if "publish_allow" in given and "publish" not in given:
        raise FlagError("--eldr-publish-allow: only with --eldr-publish (it limits where signatures go)")
    if "signature_key_file" in given or "publish" in given:
        from eldr_sglang.core.wire import load_key

        try:
            load_key(given.get("signature_key_file"), "--eldr-signature-key-file")
        except ValueError as exc:
            raise FlagError(str(exc)) from None
    if "calibration" not in given and "layers" not in given:
        if "trace_dir" in given:
            kw["layers"] = "all"  # nothing to publish: trace only (also with --eldr-publish)
        elif "publish" in given:
            kw["layers"] = SPREAD  # no artifact yet (a router with --online learns one)
    return kw


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
        policy = getattr(server_args, "disaggregation_decode_allocation_policy", None)
        if config.publish and policy != "prefill_complete":
            raise FlagError(f"--eldr-publish: the router picks the decode server after prefill (late binding), "
                            f"which needs --disaggregation-decode-allocation-policy prefill_complete on every "
                            f"server (this one has {policy}); without it each request waits the router's "
                            f"whole --signature-timeout")
    except (FlagError, RuntimeError) as exc:
        sys.stderr.write(f"error: eldr-sglang: {exc}\n")
        raise SystemExit(2)
    os.environ[ENV_KEY] = config.to_env()
    return server_args
