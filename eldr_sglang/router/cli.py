"""``eldr-router`` / ``python -m eldr_sglang.router``: launch the ELDR PD router.

Example::

    python -m eldr_sglang.router --prefill http://p0:30000 8998 --decode http://d0:30001 \\
        --decode http://d1:30002 --policy eldr --calibration artifact.json --port 8000 \\
        --signature-port 8001

Every flag is a :class:`~eldr_sglang.router.config.RouterConfig` field (same name
and default). ``--config FILE`` (YAML or JSON) takes the same keys
(``signature-timeout`` or ``signature_timeout``); flags on the command line win.
``prefill`` is a list of "URL [PORT]" strings or [URL, PORT] pairs, ``decode`` a
list of URLs. ``--workers N`` runs N router processes on one port (SO_REUSEPORT);
process i takes signatures on ``--signature-port`` + i. With ``--online``, process 0
fits and writes ``--calibration-out``; the others follow that file. SIGTERM/SIGINT drain: new
requests get 503, in-flight ones finish (up to ``--drain-timeout``), then exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import os
import signal
import sys
from dataclasses import replace
from typing import Any, Optional


from dataclasses import MISSING, fields
from typing import get_type_hints

from eldr_sglang.cliparse import OneLineParser
from eldr_sglang.core.policies import policy_names, policy_spec
from eldr_sglang.router.app import Router
from eldr_sglang.router.config import RouterConfig, typed_value, validate_worker_url
from eldr_sglang.router.http.serve import start_router


def _prefill_arg(values: list[str]) -> tuple[str, Optional[int]]:
    if not 1 <= len(values) <= 2:
        raise argparse.ArgumentTypeError(f"--prefill takes URL [BOOTSTRAP_PORT], got {' '.join(values)!r}")
    port = None
    if len(values) == 2 and values[1].lower() != "none":
        try:
            port = int(values[1])
        except ValueError:
            port = -1
        if not 1 <= port <= 65535:
            raise argparse.ArgumentTypeError(f"--prefill {values[0]}: bootstrap port {values[1]!r} is not a port "
                                             "number (1-65535, or none)")
    return values[0], port


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="eldr-router", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML or JSON file with the same keys as these flags")
    p.add_argument("--prefill", nargs="+", action="append",
                   metavar=("URL", "BOOTSTRAP_PORT"), help="prefill server URL [bootstrap port]; repeat")
    p.add_argument("--decode", action="append", metavar="URL",
                   help="decode server URL; repeat (order = calibration cluster order)")
    p.add_argument("--worker", action="append", metavar="URL",
                   help="--mode colocated: plain SGLang server URL; repeat (order = cluster order)")
    hints = get_type_hints(RouterConfig)
    for f in fields(RouterConfig):
        flag = "--" + f.name.replace("_", "-")
        default = None if f.default is MISSING else f.default
        help_text = f.metadata.get("help", "") + (f" (default: {default})" if default is not None else "")
        if f.metadata.get("flag"):
            p.add_argument(flag, action="store_true", default=default, help=help_text)
            continue
        if f.metadata.get("repeat"):  # --policy-param NAME=VALUE, repeated
            p.add_argument(flag, action="append", default=None, metavar="NAME=VALUE",
                           help=f.metadata.get("help", "") + f" ({_param_list()})")
            continue
        kind = next(t for t in (int, float, str) if t in getattr(hints[f.name], "__args__", (hints[f.name],)))
        choices = f.metadata.get("choices")
        if f.name == "policy":
            choices = policy_names(aliases=True)
        p.add_argument(flag, type=kind, default=default, choices=choices, help=help_text)
    return p


def _param_list() -> str:
    """Each policy's parameters and their defaults, for --help."""
    from dataclasses import asdict

    parts = []
    for name in policy_names():
        params = policy_spec(name).params
        if fields(params):
            parts.append(f"{name}: " + ", ".join(f"{k}={v}" for k, v in asdict(params()).items()))
        # the others take none
    return "; ".join(parts)


def _load_config(path: str) -> dict:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read ({e.strerror})") from None
    import yaml  # PyYAML

    data: Any = None
    if not path.endswith((".yaml", ".yml")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            if path.endswith(".json"):
                raise ValueError(f"not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if data is None:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
            raise ValueError(f"not valid YAML ({where}{getattr(e, 'problem', None) or e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: config must be a mapping of flag names to values")
    return data


def _config_defaults(p: argparse.ArgumentParser, cfg: dict) -> dict[str, Any]:
    """Config keys -> argparse defaults (validated like the flags)."""
    actions = {a.dest: a for a in p._actions if a.dest not in ("help", "config")}
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in actions:
            raise ValueError(f"{key}: unknown config key")
        a = actions[dest]
        if dest == "prefill":
            items = value if isinstance(value, list) else [value]
            value = [str(v).split() if isinstance(v, str) else [str(x) for x in v] for v in items]
        elif dest == "decode":
            value = [str(v) for v in (value if isinstance(value, list) else [value])]
        elif dest == "domain_map" and isinstance(value, dict):
            value = json.dumps(value)
        elif dest == "policy_param":  # {name: value}, or NAME=VALUE strings
            items = value.items() if isinstance(value, dict) else None
            value = ([f"{k}={'none' if v is None else v}" for k, v in items] if items is not None
                     else [str(v) for v in (value if isinstance(value, list) else [value])])
        if dest in _FIELDS:
            value = typed_value(dest, value)
        if a.choices is not None and value not in a.choices:
            raise ValueError(f"{key}: {value!r} is not one of {', '.join(sorted(a.choices))}")
        out[dest] = value
    return out


_FIELDS = {f.name for f in fields(RouterConfig)}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = build_parser()
    pre, _ = p.parse_known_args(argv)
    lists: dict[str, Any] = {}
    if pre.config:
        try:
            defaults = _config_defaults(p, _load_config(pre.config))
        except (OSError, ValueError, TypeError) as e:
            p.error(f"--config {pre.config}: {e}")
        # repeatable flags would append to a default: the config's lists apply only
        # when the command line gives none
        lists = {k: defaults.pop(k) for k in ("prefill", "decode", "policy_param") if k in defaults}
        p.set_defaults(**defaults)
    args = p.parse_args(argv)
    for k, v in lists.items():
        if k == "policy_param":  # the config's, then the command line's (a later NAME wins)
            setattr(args, k, list(v) + list(args.policy_param or []))
        elif not getattr(args, k):
            setattr(args, k, v)
    args.policy_param = tuple(args.policy_param or ())
    if args.mode == "colocated":  # whole requests across plain servers (eldr_sglang.router.colocated)
        if not args.worker or args.prefill or args.decode:
            p.error("--mode colocated takes --worker URL (repeat), not --prefill/--decode")
        pd_only = [flag for flag, on in (("--online", args.online), ("--shadow-policy", args.shadow_policy),
                                         ("--signature-port", args.signature_port is not None)) if on]
        if pd_only:
            p.error(f"{', '.join(pd_only)}: the PD flow's only (they read measured signature "
                    "messages, which co-located servers do not send)")
        try:
            args.worker = [validate_worker_url(u) for u in args.worker]
            args.router_config = config_of(args)
        except ValueError as e:
            p.error(str(e))
        return args
    if not args.prefill or not args.decode:
        p.error("need --prefill and --decode (on the command line or in --config)")
    try:
        args.prefill = [_prefill_arg(v) for v in args.prefill]
    except (argparse.ArgumentTypeError, ValueError) as e:
        p.error(str(e))
    for flag, urls in (("--decode", args.decode), ("--prefill", [u for u, _ in args.prefill])):
        for url in urls:
            try:
                validate_worker_url(url)
            except ValueError as e:
                p.error(f"{flag}: {e}")
    spec = policy_spec(args.policy)
    if spec.needs_artifact and not (args.calibration or args.online):
        p.error(f"--policy {args.policy} needs --calibration (or --online to learn one)")
    if spec.needs_domain_map and not args.domain_map:
        p.error(f"--policy {args.policy} needs --domain-map")
    try:
        args.router_config = config_of(args)
    except ValueError as e:
        name, _, rest = str(e).partition(":")
        known = {f.name for f in fields(RouterConfig)}
        p.error(f"--{name.replace('_', '-')}:{rest}" if name in known else str(e))
    return args


def config_of(args: argparse.Namespace) -> RouterConfig:
    """The :class:`RouterConfig` of parsed flags (ValueError naming a bad field)."""
    return RouterConfig(**{f.name: getattr(args, f.name) for f in fields(RouterConfig)})


def build_router(args: argparse.Namespace) -> Router:
    if args.router_config.mode == "colocated":
        from eldr_sglang.router.colocated import build_colocated_router

        return build_colocated_router(args)
    return Router(args.prefill, args.decode, config=args.router_config)


async def serve(router: Router, host: str, port: int, drain_timeout: float,
                reuse_port: bool = False) -> None:
    """Serve until SIGTERM/SIGINT, then drain: 503 for new work, finish in-flight, exit."""
    runner, bound = await start_router(router, host, port, reuse_port=reuse_port)
    log = logging.getLogger("eldr_sglang.router")
    log.info("listening on %s:%d (pid %d)%s", host, bound, os.getpid(),
             f", signatures at {router.return_address}" if router.return_address else "")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        finished = await router.drain(drain_timeout)
        log.warning("drained (%s); exiting", "all requests finished" if finished else "timeout")
    finally:
        await runner.cleanup()


def _serve_process(args: argparse.Namespace, index: int) -> None:
    """One router process (of ``--workers N``: index i takes --signature-port + i)."""
    c = args.router_config
    if c.signature_port:
        args.router_config = c = replace(c, signature_port=c.signature_port + index)
    if c.online and index > 0:  # process 0 fits; the others follow the artifact it writes
        args.router_config = c = replace(c, online=False, calibration=c.calibration_out,
                                         calibration_watch=c.calibration_watch or 1.0)
    _setup_logging(c.log_level, c.log_format)
    try:
        router = build_router(args)
    except (ValueError, OSError) as e:
        sys.exit(f"eldr router: {e}")
    logging.getLogger("eldr_sglang.router").info(
        "policy=%s tau=%s prefill=%s decode=%s", c.policy, router.tau,
        [s.url for s in router.prefills], [s.url for s in router.decodes])
    try:
        run_loop(serve(router, c.host, c.port, c.drain_timeout, reuse_port=c.workers > 1),
                 c.event_loop)
    except OSError as e:  # a port in use, an address not on this host
        sys.exit(f"eldr router: cannot listen on --host {c.host} --port {c.port}"
                 f"{'' if c.signature_port is None else f' / --signature-port {c.signature_port}'}: {e}")


def _supervise(args: argparse.Namespace) -> None:
    """Start ``--workers`` processes; forward SIGTERM/SIGINT; exit when all ended
    (a process that dies stops the others: the orchestrator restarts the router)."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_serve_process, args=(args, i), name=f"eldr-router-{i}")
             for i in range(args.router_config.workers)]
    for pr in procs:
        pr.start()
    stopping = False

    def forward(signum, _frame) -> None:
        nonlocal stopping
        stopping = True
        for pr in procs:
            if pr.is_alive():
                os.kill(pr.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    rc = 0
    while any(pr.is_alive() for pr in procs):
        for pr in procs:
            pr.join(0.2)
            if pr.exitcode not in (None, 0) and not stopping:
                logging.getLogger("eldr_sglang.router").error(
                    "router process %s exited with %s; stopping the others", pr.name, pr.exitcode)
                rc = 1
                forward(signal.SIGTERM, None)
    sys.exit(rc or max((pr.exitcode or 0) for pr in procs))


def _setup_logging(level: str, fmt: str = "text") -> None:
    from eldr_sglang.router.http.http_conventions import setup_logging  # text or JSON lines

    setup_logging(level, fmt)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.router_config.workers > 1:
        _setup_logging(args.router_config.log_level, args.router_config.log_format)
        _supervise(args)
    else:
        _serve_process(args, 0)


def run_loop(coro, event_loop: str = "auto"):
    """Run ``coro`` to completion on uvloop (faster sockets and callbacks) when
    installed, else on asyncio's loop; returns its result."""
    if event_loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if event_loop == "uvloop":
                sys.exit("eldr router: --event-loop uvloop, but uvloop is not installed")
        else:
            return uvloop.run(coro)
    return asyncio.run(coro)
