"""``python -m eldr_sglang.router``: launch the ELDR PD router.

Example::

    python -m eldr_sglang.router --prefill http://p0:30000 8998 --decode http://d0:30001 \\
        --decode http://d1:30002 --policy eldr --calibration artifact.json --port 8000

``--config FILE`` (YAML or JSON) takes the same keys as the flags (``signature-timeout``
or ``signature_timeout``); flags given on the command line win. ``prefill`` is a
list of "URL [PORT]" strings or [URL, PORT] pairs, ``decode`` a list of URLs.
SIGTERM/SIGINT drain: new requests get 503, in-flight ones finish (up to
``--drain-timeout``), then the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from typing import Any, Optional


from eldr_sglang.core.policies import POLICY_NAMES
from eldr_sglang.router.app import Router, start_router
from eldr_sglang.router.signatures import load_calibration


def _prefill_arg(values: list[str]) -> tuple[str, Optional[int]]:
    if not 1 <= len(values) <= 2:
        raise argparse.ArgumentTypeError("--prefill takes URL [BOOTSTRAP_PORT]")
    port = None
    if len(values) == 2 and values[1].lower() != "none":
        port = int(values[1])
    return values[0], port


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eldr_sglang.router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML or JSON file with the same keys as these flags")
    p.add_argument("--prefill", nargs="+", action="append",
                   metavar=("URL", "BOOTSTRAP_PORT"), help="prefill server URL [bootstrap port]; repeat")
    p.add_argument("--decode", action="append", metavar="URL",
                   help="decode server URL; repeat (order = calibration cluster order)")
    p.add_argument("--policy", default="eldr",
                   choices=sorted(set(POLICY_NAMES) | {"rr", "power_of_two"}))
    p.add_argument("--calibration", help="calibration artifact (required for --policy eldr)")
    p.add_argument("--tau", type=float, default=None, help="locality band (default: artifact's, else 0.1)")
    p.add_argument("--signature-timeout", type=float, default=30.0,
                   help="seconds to wait for a prefill signature before falling back to JSQ")
    p.add_argument("--signature-ttl", type=float, default=30.0,
                   help="seconds an early (unclaimed) signature message is kept")
    p.add_argument("--signature-port", type=int, default=None,
                   help="also take signature messages as newline-delimited JSON on this TCP "
                   "port (engines: --eldr-publish tcp://ROUTER:PORT; 0 = any free port)")
    p.add_argument("--signature-buffer", type=int, default=4096,
                   help="max early (unclaimed) signature messages kept, oldest dropped first")
    p.add_argument("--label-field", help="body field holding the request label (domain policy); "
                   "removed before forwarding")
    p.add_argument("--label-header", help="HTTP header holding the request label (domain policy)")
    p.add_argument("--domain-map", help="JSON (inline or file): label -> [decode index or URL, ...]")
    p.add_argument("--health-interval", type=float, default=10.0,
                   help="seconds between active GET /health checks of every worker (0: off)")
    p.add_argument("--health-timeout", type=float, default=5.0, help="health check timeout (s)")
    p.add_argument("--health-failures", type=int, default=2,
                   help="consecutive failed health checks that take a worker out")
    p.add_argument("--health-cooldown", type=float, default=10.0,
                   help="seconds a worker's circuit breaker stays open before a trial request")
    p.add_argument("--breaker-threshold", type=int, default=5,
                   help="consecutive request failures that open a worker's circuit breaker "
                   "(a refused connection opens it at once)")
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--max-body-mb", type=float, default=32.0,
                   help="largest accepted request body (MiB); larger gets 413")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds to let in-flight requests finish")
    p.add_argument("--admin-token", help="require 'Authorization: Bearer TOKEN' on admin "
                   "endpoints (default: admin endpoints answer loopback clients only)")
    p.add_argument("--log-decisions", action="store_true",
                   help="log every routing decision at INFO (otherwise DEBUG)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info")
    p.add_argument("--event-loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                   help="auto: uvloop when installed, else asyncio's own loop")
    return p


def _load_config(path: str) -> dict:
    with open(path) as f:
        text = f.read()
    if path.endswith((".yaml", ".yml")):
        import yaml  # PyYAML, only needed for YAML configs

        data = yaml.safe_load(text)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            import yaml

            data = yaml.safe_load(text)
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
            raise ValueError(f"unknown config key {key!r}")
        a = actions[dest]
        if dest == "prefill":
            items = value if isinstance(value, list) else [value]
            value = [str(v).split() if isinstance(v, str) else [str(x) for x in v] for v in items]
        elif dest == "decode":
            value = [str(v) for v in (value if isinstance(value, list) else [value])]
        elif dest == "domain_map" and isinstance(value, dict):
            value = json.dumps(value)
        elif value is not None and a.type is not None:
            value = a.type(value)
        if a.choices is not None and value not in a.choices:
            raise ValueError(f"config key {key!r}: {value!r} not in {sorted(a.choices)}")
        out[dest] = value
    return out


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
        lists = {k: defaults.pop(k) for k in ("prefill", "decode") if k in defaults}
        p.set_defaults(**defaults)
    args = p.parse_args(argv)
    for k, v in lists.items():
        if not getattr(args, k):
            setattr(args, k, v)
    if not args.prefill or not args.decode:
        p.error("need --prefill and --decode (on the command line or in --config)")
    try:
        args.prefill = [_prefill_arg(v) for v in args.prefill]
    except (argparse.ArgumentTypeError, ValueError) as e:
        p.error(str(e))
    if args.policy == "eldr" and not args.calibration:
        p.error("--policy eldr needs --calibration")
    if args.policy == "domain" and not args.domain_map:
        p.error("--policy domain needs --domain-map")
    if args.signature_port is not None and not 0 <= args.signature_port <= 65535:
        p.error(f"--signature-port: expected 0-65535, got {args.signature_port}")
    if args.signature_port is not None and args.signature_port == args.port and args.port != 0:
        p.error(f"--signature-port {args.signature_port} is the router's --port; pick another")
    return args


def _load_json(text: str) -> dict:
    if os.path.exists(text):
        with open(text) as f:
            return json.load(f)
    return json.loads(text)


def build_router(args: argparse.Namespace) -> Router:
    artifact = load_calibration(args.calibration) if args.calibration else None
    return Router(
        args.prefill, args.decode, args.policy, artifact=artifact, tau=args.tau,
        domain_map=_load_json(args.domain_map) if args.domain_map else None,
        label_field=args.label_field, label_header=args.label_header,
        signature_timeout=args.signature_timeout, signature_ttl=args.signature_ttl,
        signature_buffer=args.signature_buffer,
        health_cooldown=args.health_cooldown, health_interval=args.health_interval,
        health_timeout=args.health_timeout, health_failures=args.health_failures,
        breaker_threshold=args.breaker_threshold, request_timeout=args.request_timeout,
        max_body_mb=args.max_body_mb, admin_token=args.admin_token,
        log_decisions=args.log_decisions, calibration_path=args.calibration, seed=args.seed,
        signature_listen=(args.host, args.signature_port) if args.signature_port is not None else None)


async def serve(router: Router, host: str, port: int, drain_timeout: float) -> None:
    """Serve until SIGTERM/SIGINT, then drain: 503 for new work, finish in-flight, exit."""
    runner, bound = await start_router(router, host, port)
    log = logging.getLogger("eldr_sglang.router")
    log.info("listening on %s:%d", host, bound)
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


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        router = build_router(args)
    except (ValueError, OSError) as e:
        sys.exit(f"eldr router: {e}")
    logging.getLogger("eldr_sglang.router").info(
        "policy=%s tau=%s prefill=%s decode=%s", args.policy, router.tau,
        [s.url for s in router.prefills], [s.url for s in router.decodes])
    try:
        run_loop(serve(router, args.host, args.port, args.drain_timeout), args.event_loop)
    except OSError as e:  # a port in use, an address not on this host
        sys.exit(f"eldr router: cannot listen on --host {args.host} --port {args.port}"
                 f"{'' if args.signature_port is None else f' / --signature-port {args.signature_port}'}: {e}")


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


if __name__ == "__main__":
    main()
