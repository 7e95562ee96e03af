"""The router's decision step, piece by piece, in one process (no network).

    python -m benchmark.bench_decision [--servers 24] [--layers 48] [--experts 128] [--policy eldr_balanced]

Decision step = parse the signature message (JSON + packed counts) + encode it with
the calibration artifact (IDF weights, L2 norm) + ``Dispatcher.decide`` (loads,
allowed mask, ``policy.explain``, metrics) + the decision log entry. Each piece is timed
over many calls after a warm-up; medians and p99 in microseconds. ``decide_admit_release``
is the policy's whole share of a request (decide, then the admit and release
bookkeeping of a policy that tracks live batches); its target is <= 20 us p50 at 24
servers with every layer of a 48 x 128 model published (6,144 dimensions).

``steady_decision`` is the same share at steady state: requests of 24 kinds (one per
region, each kind its own expert profile, the centroids their mean signatures) arrive in
turn, each is decided and admitted, and the oldest live request is released, so every
server keeps about 32 live requests and the decisions land where traffic of that kind
would (bands of the kind's region, not every server at once).

``array_floor`` is the numpy work alone that this design needs per request, with no
Python logic: price every server (one [N, D] float32 matvec), the admit's ``log(1 - p)``
over D values and its add into the server's float64 sum, the release's subtract, and the
refresh (float32 copy, clamp, ``exp``, sum) of the two servers that changed. On a machine where
it is above the target, no bookkeeping around these calls can meet it.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import orjson

from benchmark.common import parse_with_quick, write_record
from eldr_sglang.core.artifact import CalibrationArtifact
from eldr_sglang.core.policies import RouteRequest
from eldr_sglang.core.traces import ModelSpec
from eldr_sglang.core.wire import build_message, http_body, parse_message
from eldr_sglang.router.app import Router
from eldr_sglang.router.signals.signatures import activation


def timed(fn, iters: int, repeats: int = 5) -> dict:
    """Median and p99 of per-call times (us), from ``repeats`` batches of ``iters`` calls."""
    for _ in range(min(iters, 2000)):
        fn()
    per_call = []
    pc = time.perf_counter
    for _ in range(repeats):
        samples = np.empty(iters)
        for i in range(iters):
            t0 = pc()
            fn()
            samples[i] = pc() - t0
        per_call.append(samples)
    allc = np.concatenate(per_call) * 1e6
    return {"median_us": round(float(np.median(allc)), 2), "p99_us": round(float(np.quantile(allc, 0.99)), 2)}


def array_floor(servers: int, dim: int, rng: np.random.Generator):
    """``() -> None``: the array operations of one decide + admit + release (module docstring)."""
    free = rng.random((servers, dim)).astype(np.float32)
    p = (rng.random(dim) * 0.5).astype(np.float32)
    log_free = np.log(rng.random((2, dim)))
    row32 = np.empty(dim, dtype=np.float32)
    lowest = np.full(dim, -80.0, dtype=np.float32)  # the state's clamp before exp

    def floor() -> None:
        np.dot(free, p)  # decide: every server's added experts
        log_q = np.log1p(-p).astype(np.float64)  # admit: log(1 - p)
        log_free[0] += log_q
        log_free[0] -= log_q  # release (the same request: the state stays where it was)
        for i in (0, 1):  # refresh the two servers that changed
            np.copyto(row32, log_free[i], casting="same_kind")
            np.maximum(row32, lowest, out=row32)
            np.exp(row32, out=row32)
            row32.sum()
    return floor


def steady_state(args, router, layers: list[int], rng: np.random.Generator):
    """``() -> None``: one request of the next kind decided, admitted, and the oldest live one
    released (see the module docstring), on a router like ``router`` whose centroids are the
    kinds' mean signatures."""
    kinds = args.servers
    profiles = rng.gamma(0.3, 1.0, (kinds, args.layers, args.experts)) + 0.02
    pool = []
    for i in range(8 * kinds):
        counts = rng.poisson(600 * 8 / args.experts * profiles[i % kinds] / profiles[i % kinds].mean(axis=1,
                                                                                                 keepdims=True))
        pool.append(parse_message(orjson.loads(http_body(build_message(1, f"s{i}", 600, 0, layers, counts,
                                                                       packed=True))[0])))
    enc = router.routing.encoder
    sigs = [enc.encode(m) for m in pool]
    cents = np.stack([np.mean(sigs[k::kinds], axis=0) for k in range(kinds)]).astype(np.float32)
    cents /= np.linalg.norm(cents, axis=1, keepdims=True)
    art = router.routing.encoder.artifact
    router = Router([("http://127.0.0.1:1", 8998)], [d.url for d in router.pool.decodes], args.policy,
                    artifact=CalibrationArtifact(model=art.model, variant=art.variant, layers=art.layers,
                                                 idf=art.idf, centroids=cents, tau=art.tau),
                    health_interval=0, load_interval=0, policy_param=tuple(args.policy_param))
    reqs = [RouteRequest(s, activation=activation(m)) for s, m in zip(sigs, pool)]
    policy, decide, live, turn = router.policy, router.dispatcher.decide, [], [0]

    def steady() -> None:  # the router's in-flight counts follow the live set, as its loads do
        req = reqs[turn[0] % len(reqs)]
        turn[0] += 1
        d, dec, _ = decide(req)
        d.inflight += 1
        live.append((d, policy.admit(dec.index, req)))
        if len(live) > 32 * args.servers:
            d, token = live.pop(0)
            d.inflight -= 1
            policy.release(token)
    for _ in range(32 * args.servers):  # fill the live set: 32 requests per server
        steady()
    return steady


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", type=int, default=24)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--policy", default="eldr_balanced",
                    help="any policy; those that price live batches see each server running 32 requests")
    ap.add_argument("--policy-param", action="append", default=[], metavar="NAME=VALUE",
                    help="a parameter of the policy, as the router's flag; repeat")
    ap.add_argument("--json", help="also write the figures here")
    args = parse_with_quick(ap, argv, servers=4, layers=4, experts=16, iters=200)
    rng = np.random.default_rng(0)
    layers = list(range(args.layers))
    idf = rng.uniform(0.2, 3.0, (args.layers, args.experts)).astype(np.float32)
    cents = rng.random((args.servers, args.layers * args.experts)).astype(np.float32)
    cents /= np.linalg.norm(cents, axis=1, keepdims=True)
    art = CalibrationArtifact(model=ModelSpec("bench", args.layers, args.experts, 8), variant="idf",
                              layers=layers, idf=idf, centroids=cents, tau=0.1)
    router = Router([("http://127.0.0.1:1", 8998)],
                    [f"http://127.0.0.1:{2 + i}" for i in range(args.servers)], args.policy,
                    artifact=art, health_interval=0, load_interval=0, policy_param=tuple(args.policy_param))
    for i, d in enumerate(router.pool.decodes):
        d.inflight = int(rng.integers(0, 8))
    counts = rng.poisson(3.0, (args.layers, args.experts))
    wire, _ = http_body(build_message(1, "r", 0, 0, layers, counts, packed=True))  # as the engine sends it
    msg = parse_message(orjson.loads(wire))
    enc = router.routing.encoder
    sig = enc.encode(msg)
    act = activation(msg) if router.policy.uses_activation else None
    req = RouteRequest(sig, activation=act)
    decide = router.dispatcher.decide
    for i in range(args.servers):  # live batches for a policy that prices them
        for _ in range(32):
            router.policy.admit(i, RouteRequest(activation=activation(
                {"counts": rng.poisson(0.3, (args.layers, args.experts)), "prompt_tokens": 100})))

    def decide_admit_release() -> None:
        _, dec, _ = decide(req)
        router.policy.release(router.policy.admit(dec.index, req))

    def step() -> None:
        m = parse_message(orjson.loads(wire))
        d, dec, loads = decide(RouteRequest(enc.encode(m), activation=activation(m) if act is not None else None))
        router.record(["r"], [1], None, [], d, dec, loads)

    steady = steady_state(args, router, layers, rng)
    out = {"policy": args.policy, "servers": args.servers, "dim": int(cents.shape[1]), "message_bytes": len(wire),
           "parse": timed(lambda: parse_message(orjson.loads(wire)), args.iters),
           "encode": timed(lambda: enc.encode(msg), args.iters),
           "matvec": timed(lambda: np.dot(enc.centroids, sig), args.iters),
           "policy_explain": timed(lambda: router.policy.explain(req, [1] * args.servers), args.iters),
           "decide": timed(lambda: decide(req), args.iters),
           "decide_admit_release": timed(decide_admit_release, args.iters),
           "decision_step": timed(step, args.iters),
           "steady_decision": timed(steady, args.iters),
           "array_floor": timed(array_floor(args.servers, int(cents.shape[1]), rng), args.iters)}
    out["target_us"] = 20.0
    out["floor_below_target"] = out["array_floor"]["median_us"] <= out["target_us"]
    out["met"] = out["decide_admit_release"]["median_us"] <= out["target_us"]
    out["steady_met"] = out["steady_decision"]["median_us"] <= out["target_us"]
    for k, v in out.items():
        print(f"{k:>16}: {v}")
    if args.json:
        write_record(args.json, out, argv, script=__file__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
