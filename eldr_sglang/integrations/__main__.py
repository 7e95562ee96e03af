"""``python -m eldr_sglang.integrations {dynamo,smg} ...``: the pre-router as a process."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from typing import Optional, Sequence

from eldr_sglang.core.policies.params import split_assignments


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eldr_sglang.integrations",
                                description="Pin ELDR's predicted-signature decode choice in a host router.")
    p.add_argument("kind", choices=("dynamo", "smg"), help="the host router")
    p.add_argument("--host-url", required=True, help="the host router's HTTP URL (Dynamo frontend, SMG)")
    p.add_argument("--host", default="127.0.0.1", help="address this pre-router listens on")
    p.add_argument("--port", type=int, default=8100)
    s = p.add_argument_group("scorer (one of)")
    s.add_argument("--calibration", help="in process: a calibration artifact with a signature predictor")
    s.add_argument("--scorer-url", help="remote: a co-located ELDR router (POST /eldr/score)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the one the artifact names)")
    p.add_argument("--policy", default="eldr_balanced", help="ELDR policy (in-process scorer)")
    p.add_argument("--policy-param", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--tau", type=float, default=None)
    p.add_argument("--scorer-timeout", type=float, default=0.25, help="seconds (remote scorer)")
    p.add_argument("--refresh", type=float, default=2.0, help="seconds between worker discoveries")
    a = p.add_argument_group("auth (bearer tokens; the environment variable is read when the flag is absent)")
    a.add_argument("--control-token", default=os.environ.get("ELDR_HOST_CONTROL_TOKEN"),
                   help="the host's control plane: SMG GET /workers (control-plane API key or JWT), Dynamo "
                        "GET /health [env ELDR_HOST_CONTROL_TOKEN]")
    a.add_argument("--host-api-key", default=os.environ.get("ELDR_HOST_API_KEY"),
                   help="the pre-router's own data-plane requests (SMG key probes; SMG --api-key) "
                        "[env ELDR_HOST_API_KEY]; clients' own Authorization headers pass unchanged")
    a.add_argument("--scorer-api-key", default=os.environ.get("ELDR_SCORER_API_KEY"),
                   help="the remote scorer (its --api-key) [env ELDR_SCORER_API_KEY]")
    p.add_argument("--event-loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                   help="auto: uvloop when installed (as the ELDR router)")
    d = p.add_argument_group("dynamo")
    d.add_argument("--decode-component", default="backend")
    d.add_argument("--prefill-component", default="prefill")
    d.add_argument("--namespace", default=None)
    d.add_argument("--decode-only-pin", action="store_true",
                   help="send the decode instance header alone (keeps Dynamo's KV-aware prefill choice) where "
                        "the frontend takes it; refused (1.6.1 disaggregated: 400): both headers, with a WARNING")
    m = p.add_argument_group("smg")
    m.add_argument("--metrics-url", help="SMG's Prometheus URL (http://HOST:PORT/metrics): key learning")
    m.add_argument("--key-mode", choices=("worker", "region"), default="worker")
    m.add_argument("--probe-body", default=None, help="JSON body of the key probes (default: 1 token)")
    m.add_argument("--key-ttl", type=float, default=3600.0,
                   help="seconds: a key unused this long is probed again; below SMG's --max-idle-secs")
    m.add_argument("--verify-interval", type=float, default=0.5, help="seconds between key verifications")
    args = p.parse_args(argv)
    if bool(args.calibration) == bool(args.scorer_url):
        p.error("give exactly one of --calibration and --scorer-url")
    return args


def build(args: argparse.Namespace):
    from eldr_sglang.integrations import DynamoPreRouter, LocalScorer, RemoteScorer, SmgPreRouter

    if args.calibration:
        scorer = LocalScorer(args.calibration, args.tokenizer, policy=args.policy, tau=args.tau,
                             policy_params=split_assignments(args.policy_param) or None)
    else:
        scorer = RemoteScorer(args.scorer_url, timeout_s=args.scorer_timeout, api_key=args.scorer_api_key)
    kw = dict(refresh_s=args.refresh, scorer_timeout=args.scorer_timeout, control_token=args.control_token,
              api_key=args.host_api_key)
    if args.kind == "dynamo":
        return DynamoPreRouter(args.host_url, scorer, decode_component=args.decode_component,
                               prefill_component=args.prefill_component, namespace=args.namespace,
                               pin_prefill=not args.decode_only_pin, **kw)
    return SmgPreRouter(args.host_url, scorer, metrics_url=args.metrics_url, key_mode=args.key_mode,
                        probe_body=json.loads(args.probe_body) if args.probe_body else None,
                        key_ttl_s=args.key_ttl, verify_s=args.verify_interval, **kw)


async def _main(args: argparse.Namespace) -> None:
    from eldr_sglang.integrations import serve

    pre = build(args)
    runner, port = await serve(pre, args.host, args.port)
    print(f"eldr {args.kind} pre-router on http://{args.host}:{port} -> {args.host_url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from eldr_sglang.router.cli import run_loop

    args = parse_args(argv)
    run_loop(_main(args), args.event_loop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
