"""``python -m eldr_sglang.router``: launch the ELDR PD router.

Example::

    python -m eldr_sglang.router --prefill http://p0:30000 8998 --decode http://d0:30001 \\
        --decode http://d1:30002 --policy eldr --calibration artifact.json --port 8000
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Optional

from aiohttp import web

from eldr_sglang.core.policies import POLICY_NAMES
from eldr_sglang.router.app import Router
from eldr_sglang.router.signatures import load_calibration


def _prefill_arg(values: list[str]) -> tuple[str, Optional[int]]:
    if not 1 <= len(values) <= 2:
        raise argparse.ArgumentTypeError("--prefill takes URL [BOOTSTRAP_PORT]")
    port = None
    if len(values) == 2 and values[1].lower() != "none":
        port = int(values[1])
    return values[0], port


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eldr_sglang.router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", nargs="+", action="append", required=True,
                   metavar=("URL", "BOOTSTRAP_PORT"), help="prefill server URL [bootstrap port]; repeat")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="decode server URL; repeat (order = calibration cluster order)")
    p.add_argument("--policy", default="eldr",
                   choices=sorted(set(POLICY_NAMES) | {"rr", "power_of_two"}))
    p.add_argument("--calibration", help="calibration artifact (required for --policy eldr)")
    p.add_argument("--tau", type=float, default=None, help="locality band (default: artifact's, else 0.1)")
    p.add_argument("--signature-timeout", type=float, default=30.0,
                   help="seconds to wait for a prefill signature before falling back to JSQ")
    p.add_argument("--signature-ttl", type=float, default=30.0,
                   help="seconds an early (unclaimed) signature message is kept")
    p.add_argument("--label-field", help="body field holding the request label (domain policy); "
                   "removed before forwarding")
    p.add_argument("--label-header", help="HTTP header holding the request label (domain policy)")
    p.add_argument("--domain-map", help="JSON (inline or file): label -> [decode index or URL, ...]")
    p.add_argument("--health-cooldown", type=float, default=10.0,
                   help="seconds a server that refused connections is skipped")
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    try:
        args.prefill = [_prefill_arg(v) for v in args.prefill]
    except (argparse.ArgumentTypeError, ValueError) as e:
        p.error(str(e))
    if args.policy == "eldr" and not args.calibration:
        p.error("--policy eldr needs --calibration")
    if args.policy == "domain" and not args.domain_map:
        p.error("--policy domain needs --domain-map")
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
        health_cooldown=args.health_cooldown, request_timeout=args.request_timeout,
        seed=args.seed)


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
    web.run_app(router.build_app(), host=args.host, port=args.port,
                handler_cancellation=True, access_log=None, print=None)


if __name__ == "__main__":
    main()
