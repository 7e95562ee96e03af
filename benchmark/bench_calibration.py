"""Calibration-core timings on a synthetic trace set (default: paper scale).

    python -m benchmark.bench_calibration [--requests 14000 --layers 48 --experts 128 --clusters 24]

Prints wall and CPU times (CPU time is all threads; on a busy machine wall time
can exceed it) of IDF fit, signature transform (10k requests and all),
greedy layer selection over all layers (forced to run every step, the worst case),
balanced K-means on the full-dimension signatures, and peak RSS.
"""

from __future__ import annotations

import argparse
import resource
import time
from contextlib import contextmanager

import numpy as np

from benchmark.common import Stopwatch, parse_with_quick
from eldr_sglang.core import (
    BalancedKMeans,
    SignatureBuilder,
    make_synthetic_traces,
    select_layers,
)


@contextmanager
def timed(label: str, results: dict):
    with Stopwatch() as t:
        yield
    results[label] = t.seconds
    print(f"{label:<52s} {t.seconds:7.2f} s wall {t.cpu_seconds:7.2f} s cpu", flush=True)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=14_000)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--informative", type=int, default=8, help="planted informative layers")
    ap.add_argument("--clusters", type=int, default=24)
    ap.add_argument("--pairs", type=int, default=20_000)
    ap.add_argument("--n-init", type=int, default=1)
    ap.add_argument("--max-iter", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    args = parse_with_quick(ap, argv, requests=600, layers=8, experts=32, top_k=4, informative=2, clusters=4,
                            pairs=500)
    r: dict = {}
    print(f"synthetic {args.requests} requests x {args.layers} layers x {args.experts} experts, K={args.clusters}")
    with timed("generate synthetic traces (not calibration)", r):
        syn = make_synthetic_traces(args.requests, args.layers, args.experts, args.top_k,
                                    n_informative=args.informative, include_gates=False, seed=args.seed)
    tr = syn.traces
    with timed("IDF fit (all layers)", r):
        builder = SignatureBuilder("idf").fit(tr.prefill_counts)
    n10k = min(10_000, len(tr))
    with timed(f"transform {n10k} requests, all layers", r):
        builder.transform(tr.prefill_counts[:n10k])
    with timed(f"greedy layer selection, all {args.layers} steps", r):
        full = select_layers(tr.prefill_counts, tr.decode_counts, "idf", builder.idf_, n_pairs=args.pairs,
                             min_gain=-np.inf, random_state=args.seed)
    stop = select_layers(tr.prefill_counts, tr.decode_counts, "idf", builder.idf_, n_pairs=args.pairs,
                         random_state=args.seed)
    print(f"  planted {syn.informative_layers}; selected (min_gain 1e-3) {sorted(stop.layers)} "
          f"rho={stop.rho:.3f}; all-layer rho={full.curve[-1][1]:.3f}")
    prof = select_layers(tr.prefill_counts, tr.decode_counts, "idf", builder.idf_, n_pairs=args.pairs,
                         random_state=args.seed, decode_profile=True)
    print(f"  decode-profile target: selected {sorted(prof.layers)} rho={prof.rho:.3f}")
    with timed(f"transform all {len(tr)} requests, all layers", r):
        sig = builder.transform(tr.prefill_counts)
    print(f"  signature matrix {sig.shape} float32 = {sig.nbytes / 2**20:.0f} MiB")
    with timed(f"balanced K-means K={args.clusters} dim={sig.shape[1]} n_init={args.n_init}", r):
        km = BalancedKMeans(args.clusters, n_init=args.n_init, max_iter=args.max_iter, random_state=args.seed).fit(sig)
    sizes = np.bincount(km.labels_, minlength=args.clusters)
    print(f"  iterations {km.n_iter_}, capacity {km.capacity_}, cluster sizes min {sizes.min()} max {sizes.max()}")
    r["peak_rss_mib"] = peak_rss_mib()
    print(f"{'peak RSS':<52s} {r['peak_rss_mib']:7.0f} MiB")
    return r


if __name__ == "__main__":
    main()
