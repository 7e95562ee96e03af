"""Trace analysis: does prefill predict decode, which signature variant, batch locality.

    python -m eldr_sglang.analyze --traces traces/ [--pairs 20000] [--batch-size 16] [--json out.json]

Reports (1) Pearson correlation of each request's prefill and decode counts
(flattened [L, E]), mean and std over requests; (2) for each of the six signature
variants (all layers, or ``--layers``), Spearman rho between pairwise signature
cosine and decode weighted Jaccard on sampled pairs; (3) per label kind, same-label batches vs random mixed batches of equal size, two
measures: over the WHOLE decode (the union of every expert any request used in any
decode step, summed over layers) and PER STEP, the paper's measure (distinct experts
of one decode step per layer, each request at a random step of its own): exact where
the trace directory holds recorded per-step sets (``steps.npz``), otherwise the
expectation under independence from the per-request counts (marked as estimated).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

import numpy as np

from .core.step_sets import decode_step_probs, independent_distinct, load_step_experts, true_distinct
from .core.traces import TraceSet, load_traces
from .core.variants import variant_rho_table


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eldr_sglang.analyze", description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", nargs="+", required=True, help="trace directories or shard files")
    ap.add_argument("--pairs", type=int, default=20_000, help="sampled request pairs for the variant table")
    ap.add_argument("--layers", default=None, help="comma-separated layers for the variant table (default all)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--batches", type=int, default=200, help="sampled batches per kind (same-label and mixed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results as JSON")
    return ap


def prefill_decode_pearson(traces: TraceSet) -> np.ndarray:
    """Per-request Pearson r of flattened prefill vs decode counts (NaN if either is constant)."""
    n = len(traces)
    a = traces.prefill_counts.reshape(n, -1).astype(np.float64)
    b = traces.decode_counts.reshape(n, -1).astype(np.float64)
    a -= a.mean(axis=1, keepdims=True)
    b -= b.mean(axis=1, keepdims=True)
    denom = np.sqrt((a * a).sum(axis=1) * (b * b).sum(axis=1))
    return np.divide((a * b).sum(axis=1), denom, out=np.full(n, np.nan), where=denom > 0)


def variant_table(traces: TraceSet, layers: Sequence[int] | None, n_pairs: int, seed: int) -> dict:
    """Spearman(signature cosine, decode overlap) per variant, on the same sampled pairs.

    In-sample (IDF fitted on all requests, pairs among all); two decode overlaps:
    weighted Jaccard of raw counts, and of count profiles (sum 1). ``calibrate``
    scores the variants on held-out requests instead (:mod:`.core.variants`).
    """
    return variant_rho_table(traces, layers, n_pairs, seed, holdout=0.0)


def unique_experts(decode_counts: np.ndarray, batch: np.ndarray) -> int:
    """Sum over layers of the number of experts any request of the batch activated in decode."""
    return int((decode_counts[batch] > 0).any(axis=0).sum())


def per_step_distinct(traces: TraceSet, batch: np.ndarray, rng: np.random.Generator,
                      steps: np.ndarray | None, p: np.ndarray) -> float:
    """Distinct experts of one decode step, mean over layers: each request at a random step
    (exact with recorded ``steps``, else the independence estimate)."""
    if steps is not None:
        at = rng.integers(0, steps.shape[1], len(batch))
        return float(true_distinct(steps, batch, at, traces.model.num_experts).mean())
    return float(independent_distinct(p, batch).mean())


def batch_locality(traces: TraceSet, batch_size: int, n_batches: int, seed: int,
                   steps: np.ndarray | None = None) -> dict:
    """Same-label vs mixed batches, per label kind (labels with >= batch_size requests)."""
    rng = np.random.default_rng(seed)
    p = decode_step_probs(traces) if steps is None else None
    out = {}
    for kind, values in sorted(traces.labels.items()):
        names, counts = np.unique(values[values != ""], return_counts=True)
        eligible = names[counts >= batch_size]
        if len(eligible) < 2:
            out[kind] = None
            continue
        pool = np.flatnonzero(np.isin(values, eligible))
        weights = counts[counts >= batch_size] / counts[counts >= batch_size].sum()
        members = {name: np.flatnonzero(values == name) for name in eligible}
        same_rows = [rng.choice(members[rng.choice(eligible, p=weights)], batch_size, replace=False)
                     for _ in range(n_batches)]
        mixed_rows = [rng.choice(pool, batch_size, replace=False) for _ in range(n_batches)]
        same = [unique_experts(traces.decode_counts, b) for b in same_rows]
        mixed = [unique_experts(traces.decode_counts, b) for b in mixed_rows]
        step_same = [per_step_distinct(traces, b, rng, steps, p) for b in same_rows]
        step_mixed = [per_step_distinct(traces, b, rng, steps, p) for b in mixed_rows]
        out[kind] = {"labels": eligible.tolist(), "same_label": float(np.mean(same)), "mixed": float(np.mean(mixed)),
                     "reduction": float(1.0 - np.mean(same) / np.mean(mixed)),
                     "per_step": {"same_label": float(np.mean(step_same)), "mixed": float(np.mean(step_mixed)),
                                  "reduction": float(1.0 - np.mean(step_same) / np.mean(step_mixed)),
                                  "source": "recorded per-step sets" if steps is not None
                                  else "estimated (independence)"}}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.pairs < 1 or args.batch_size < 1 or args.batches < 1:
        ap.error("--pairs, --batch-size and --batches must be >= 1")
    try:
        traces = load_traces(args.traces)
        layers = None
        if args.layers is not None:
            from .calibrate import _parse_layers

            layers = _parse_layers(args.layers, traces.model.num_layers)
        if len(traces) < 2:
            raise ValueError(f"--traces holds {len(traces)} request(s); need at least 2")
        steps = load_step_experts(args.traces[0], traces) if len(args.traces) == 1 else None
    except ValueError as exc:
        ap.error(str(exc))
    m = traces.model
    print(f"{len(traces)} requests of {m.name} (L={m.num_layers}, E={m.num_experts}, top-{m.top_k})")

    r = prefill_decode_pearson(traces)
    valid = r[np.isfinite(r)]
    print(f"\nprefill vs decode activation, Pearson r per request: {valid.mean():.3f} +- {valid.std():.3f} "
          f"(n={valid.size}{', ' + str(r.size - valid.size) + ' constant skipped' if valid.size < r.size else ''})")

    table = variant_table(traces, layers, args.pairs, args.seed)
    print(f"\nsignature variants ({'all layers' if layers is None else 'layers ' + str(layers)}, {args.pairs} pairs): "
          "Spearman(cosine, decode weighted Jaccard)")
    print(f"  {'variant':<11s} {'counts':>8s} {'profile':>8s}")
    for variant, row in table.items():
        cells = ("n/a", "n/a") if row is None else (f"{row['counts']:.3f}", f"{row['profile']:.3f}")
        print(f"  {variant:<11s} {cells[0]:>8s} {cells[1]:>8s}")

    locality = batch_locality(traces, args.batch_size, args.batches, args.seed, steps)
    print(f"\nbatches of {args.batch_size}, {args.batches} each: unique decode experts over the whole decode "
          "(sum over layers) | distinct experts per decode step (mean over layers, "
          f"{'recorded per-step sets' if steps is not None else 'ESTIMATED under independence: no steps.npz'})")
    if not locality:
        print("  no labels in the traces")
    for kind, row in locality.items():
        if row is None:
            print(f"  {kind:<9s} fewer than 2 labels with >= {args.batch_size} requests")
            continue
        ps = row["per_step"]
        print(f"  {kind:<9s} same-label {row['same_label']:8.1f}  mixed {row['mixed']:8.1f}  "
              f"reduction {100 * row['reduction']:5.1f}%  | per step: same-label {ps['same_label']:6.1f}  "
              f"mixed {ps['mixed']:6.1f}  reduction {100 * ps['reduction']:5.1f}%  ({', '.join(row['labels'])})")

    if args.json:
        report = {"model": m.to_dict(), "n_requests": len(traces),
                  "pearson": {"mean": float(valid.mean()), "std": float(valid.std()), "n": int(valid.size)},
                  "variants": table, "batch_size": args.batch_size, "locality": locality}
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
        print(f"\nwritten {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
