"""Offline calibration: traces -> IDF, greedy layers, balanced K-means -> artifact.

    python -m eldr_sglang.calibrate --traces traces/ --clusters 16 --out artifact.json \\
        [--variant auto] [--max-layers 8] [--min-gain 1e-3] [--seed 0] [--plot map.png]

Prints the layer-selection curve, the six signature variants' rho on held-out
requests (``--variant auto``, the default, builds the artifact with the best
count variant: the router receives counts only), cluster sizes and per-label
purity. Bad input ends with ``error: ...`` naming the file/field and exit
status 2 (no traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from .core.artifact import DEFAULT_TAU, CalibrationArtifact, creation_info
from .core.step_law import ARTIFACT_KEY as STEP_LAW_KEY
from .core.clustering import BalancedKMeans
from .core.layer_selection import select_layers
from .core.signature import COUNT_VARIANTS, GATE_VARIANTS, SignatureBuilder
from .core.traces import TraceSet, load_traces
from .core.variants import best_count_variant, best_gate_over, holdout_size, score_variants

VARIANT_HOLDOUT = 0.25  # share of requests held out when scoring the signature variants


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eldr_sglang.calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", nargs="+", required=True, help="trace directories or shard files")
    ap.add_argument("--clusters", type=int, required=True, help="K, normally the number of decode servers")
    ap.add_argument("--out", required=True, help="artifact JSON to write")
    ap.add_argument("--variant", type=_variant_arg, default="auto", metavar="{auto," + ",".join(COUNT_VARIANTS) + "}",
                    help="signature variant; auto (default): the count variant with the best held-out rho "
                         "(layer selection then runs with idf). The router only receives counts, so gate "
                         "variants are scored but cannot be chosen")
    ap.add_argument("--max-layers", type=int, default=None, help="cap on greedily selected layers")
    ap.add_argument("--min-gain", type=float, default=1e-3, help="stop when the best layer adds less rho")
    ap.add_argument("--layers", default=None, help="comma-separated layers: skip the greedy selection")
    ap.add_argument("--pairs", type=int, default=20_000, help="sampled request pairs for layer selection")
    ap.add_argument("--decode-overlap", choices=("counts", "profile"), default="profile",
                    help="weighted Jaccard of per-request decode count profiles (each scaled to sum 1; "
                         "default: compares which experts, not how many tokens) or of raw decode counts")
    ap.add_argument("--n-init", type=int, default=3)
    ap.add_argument("--max-iter", type=int, default=50)
    ap.add_argument("--tau", type=float, default=DEFAULT_TAU, help="default locality band stored in the artifact")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=None, help="PNG: 2D PCA map of signatures by label, centroids marked")
    ap.add_argument("--predictor-prompts", nargs="+", default=None, metavar="JSONL",
                    help="also fit the signature predictor (routing before prefill) on these JSON lines "
                         "(id + prompt or input_ids), joined to the trace records by request id")
    ap.add_argument("--tokenizer", default=None, help="model folder whose tokenizer turns prompt text into ids")
    ap.add_argument("--predictor-alpha", type=float, default=1.0, help="predictor ridge strength (> 0)")
    ap.add_argument("--step-law", nargs="+", default=None, metavar="FILE",
                    help="decode step records to fit the step-time law the cost-aware policies price with "
                         "(trace mode's steps-*.jsonl, or saved GET /eldr/batch answers of the decode "
                         "engines); kept in the artifact, used until the router's own engine reports fit one")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.clusters < 1:
        ap.error(f"--clusters must be >= 1, got {args.clusters}")
    if args.pairs < 1 or args.n_init < 1 or args.max_iter < 1:
        ap.error("--pairs, --n-init and --max-iter must be >= 1")
    if args.max_layers is not None and args.max_layers < 1:
        ap.error(f"--max-layers must be >= 1, got {args.max_layers}")
    if not (np.isfinite(args.tau) and args.tau >= 0.0):
        ap.error(f"--tau must be >= 0 (2 or more = join-shortest-queue), got {args.tau}")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        ap.error(f"--out {args.out}: directory {out_dir} does not exist (create it first)")
    try:
        return run(args)
    except ValueError as exc:
        ap.error(str(exc))
    return 2


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    t0 = time.perf_counter()
    traces = load_traces(args.traces)
    model = traces.model
    print(f"loaded {len(traces)} requests of {model.name} (L={model.num_layers}, E={model.num_experts}, "
          f"top-{model.top_k}); labels: {sorted(traces.labels) or 'none'}")
    if args.clusters > len(traces):
        raise ValueError(f"--clusters {args.clusters} exceeds the {len(traces)} requests in --traces")
    select_with = "idf" if args.variant == "auto" else args.variant
    builder = SignatureBuilder(select_with).fit(traces)

    if args.layers is not None:
        layers = _parse_layers(args.layers, model.num_layers)
        curve, reason = [], "layers given with --layers"
    else:
        limit = args.max_layers or model.num_layers
        with tqdm(total=limit, desc="layer selection", unit="layer", file=sys.stderr) as bar:
            def step(chosen: list[int], rho: float) -> None:
                bar.update(1)
                bar.set_postfix(rho=f"{rho:.4f}")

            sel = select_layers(traces.prefill_counts, traces.decode_counts, select_with, builder.idf_,
                                n_pairs=args.pairs, max_layers=args.max_layers, min_gain=args.min_gain,
                                random_state=args.seed, on_step=step,
                                decode_profile=args.decode_overlap == "profile")
        if not sel.layers:
            raise ValueError(f"no layer raised the correlation by min_gain={args.min_gain} ({sel.stopped_because})")
        layers, curve, reason = sel.layers, sel.curve, sel.stopped_because
    scores = score_variants(traces, layers, args.pairs, args.seed, VARIANT_HOLDOUT, args.decode_overlap)
    variant = best_count_variant(scores) if args.variant == "auto" else args.variant
    if variant != builder.variant:
        builder = SignatureBuilder(variant).fit(traces)
    builder = builder.with_layers(layers)
    signatures = builder.transform(traces)
    predictor, predictor_info = None, None
    if args.predictor_prompts:
        from .prompts import fit_predictor

        predictor, predictor_info = fit_predictor(traces, layers, args.predictor_prompts, args.tokenizer,
                                                  alpha=args.predictor_alpha)

    with tqdm(total=1, desc=f"balanced K-means (K={args.clusters}, n_init={args.n_init})", file=sys.stderr) as bar:
        km = BalancedKMeans(args.clusters, n_init=args.n_init, max_iter=args.max_iter, random_state=args.seed)
        km.fit(signatures)
        bar.update(1)

    step_law = fit_artifact_law(args.step_law, model.num_layers / len(layers)) if args.step_law else None
    sizes = np.bincount(km.labels_, minlength=args.clusters)
    purity = {kind: label_purity(km.labels_, values) for kind, values in traces.labels.items()}
    artifact = CalibrationArtifact(
        model=model, variant=variant, layers=layers, idf=builder.selected_idf(),
        centroids=km.cluster_centers_, tau=args.tau,
        created=creation_info(len(traces), seed=args.seed, n_pairs=args.pairs, decode_overlap=args.decode_overlap),
        extra={"layer_curve": [{"layers": l, "rho": round(r, 6)} for l, r in curve], "stopped_because": reason,
               "cluster_sizes": sizes.tolist(), "purity": purity, "inertia": km.inertia_,
               "variant_scores": {v: None if r is None else round(r, 6) for v, r in scores.items()},
               "variant_choice": "auto" if args.variant == "auto" else "given", "variant_holdout": VARIANT_HOLDOUT,
               **({"predictor": predictor_info} if predictor_info else {}),
               **({STEP_LAW_KEY: step_law} if step_law else {})},
        predictor=predictor,
    )
    artifact.save(args.out)
    print_summary(curve, reason, layers, sizes, purity, km.capacity_)
    print_variant_table(scores, variant, args.variant == "auto", len(traces))
    if predictor_info:
        print(f"\nsignature predictor: {predictor_info['requests']} requests, {predictor_info['tokens_seen']} "
              f"tokens seen, {predictor_info['bytes'] / 1024:.0f} KiB")
    if step_law:
        law = step_law["law"]
        print(f"\nstep law from {law['samples']} steps: {1e3 * law['base_s']:.3f} ms + "
              f"{1e3 * law['per_seq_s']:.4f} ms/sequence + {1e3 * law['per_expert_s']:.4f} ms/distinct expert "
              f"(R^2 {law['r2']:.2f}; {step_law['source']})")
    if args.plot:
        plot_map(signatures, km, traces, args.plot, args.seed)
        print(f"map written to {args.plot}")
    print(f"artifact written to {args.out} ({artifact.checksum()[:19]}...) in {time.perf_counter() - t0:.1f} s")
    return 0


def read_step_records(paths: Sequence[str]) -> list[dict]:
    """JSON lines of step records, or JSON objects with ``samples`` (a saved
    ``GET /eldr/batch`` answer); ValueError naming the file and line."""
    records: list[dict] = []
    for path in paths:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ValueError(f"--step-law {path}: {e.strerror or e}") from None
        try:  # one JSON object (a saved answer, or a one-line file)
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            records.extend(obj["samples"] if isinstance(obj.get("samples"), list) else [obj])
            continue
        for no, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"--step-law {path}:{no}: not a JSON line ({e.msg})") from None
    return records


def fit_artifact_law(paths: Sequence[str], expert_factor: float) -> dict:
    """The artifact entry of the law fitted on the step records in ``paths``."""
    from .core.step_law import MIN_SAMPLES, artifact_entry, fit_step_law, samples_from_step_records

    records = read_step_records(paths)
    try:
        samples = samples_from_step_records(records)
    except ValueError as e:
        raise ValueError(f"--step-law: {e}") from None
    law = fit_step_law(samples)
    if law is None:
        raise ValueError(f"--step-law: {len(samples)} usable decode steps, the fit needs {MIN_SAMPLES}")
    traced = any("forward_ms" in r for r in records)
    source = ("trace mode forward_ms: the host time of the forward call, the whole step on CPU, only its "
              "launch on a GPU (there, save the engines' GET /eldr/batch answers instead)" if traced
              else "engine step samples")
    return artifact_entry(law, samples, expert_factor, source)


def _variant_arg(text: str) -> str:
    """argparse type of ``--variant``: auto or a count variant."""
    if text == "auto" or text in COUNT_VARIANTS:
        return text
    why = " (the router receives counts only; gate variants are scored, never deployed)"
    why = why if text in GATE_VARIANTS else ""
    raise argparse.ArgumentTypeError(f"invalid choice {text!r}{why}; choose from auto, {', '.join(COUNT_VARIANTS)}")


def _parse_layers(text: str, num_layers: int) -> list[int]:
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--layers must be comma-separated integers, got {text!r}") from None
    bad = [l for l in layers if not 0 <= l < num_layers]
    if not layers or bad or len(set(layers)) != len(layers):
        raise ValueError(f"--layers {text!r}: need distinct layers in [0, {num_layers - 1}]")
    return layers


def label_purity(labels: np.ndarray, values: np.ndarray) -> dict:
    """Share of requests whose cluster's majority label equals their own (unknown "" ignored)."""
    known = values != ""
    if not known.any():
        return {"purity": None, "majority": {}}
    names, codes = np.unique(values[known], return_inverse=True)
    table = np.zeros((labels.max() + 1, len(names)), dtype=np.int64)
    np.add.at(table, (labels[known], codes), 1)
    majority = {int(k): str(names[table[k].argmax()]) for k in range(len(table)) if table[k].sum()}
    return {"purity": float(table.max(axis=1).sum() / known.sum()), "majority": majority}


def print_summary(curve, reason: str, layers: list[int], sizes: np.ndarray, purity: dict, capacity: int) -> None:
    print("\nlayer selection (greedy):")
    for chosen, rho in curve:
        print(f"  +layer {chosen[-1]:>3d}  -> {len(chosen):>2d} layers  rho = {rho:.4f}")
    print(f"  stopped: {reason}")
    print(f"  selected layers: {layers}")
    print(f"\ncluster sizes (capacity {capacity}): {sizes.tolist()}")
    for kind, info in purity.items():
        if info["purity"] is None:
            continue
        print(f"label purity [{kind}]: {info['purity']:.3f}  (cluster -> majority: "
              + ", ".join(f"{k}:{v}" for k, v in info["majority"].items()) + ")")


def print_variant_table(scores: dict, variant: str, auto: bool, n_requests: int) -> None:
    """The six variants' held-out rho, the variant used and why."""
    held = holdout_size(n_requests, VARIANT_HOLDOUT)
    print(f"\nsignature variants, Spearman rho on pairs of the {held} held-out requests "
          f"(weights fitted on the other {n_requests - held}; selected layers):")
    for name, rho in scores.items():
        mark = ""
        if name == variant:
            mark = "  <- used (best count variant)" if auto else "  <- used (--variant)"
        elif name in GATE_VARIANTS:
            mark = "  (gate sums: not available to the router)"
        print(f"  {name:<11s} {'n/a' if rho is None else f'{rho:.4f}':>7s}{mark}")
    best = best_count_variant(scores)
    if not auto and scores[best] > scores[variant]:
        print(f"  {best} {scores[best]:.3f} > {variant} {scores[variant]:.3f}; kept {variant} as given")
    gate = best_gate_over(scores, variant)
    if gate is not None:
        print(f"  {gate} {scores[gate]:.3f} > {variant} {scores[variant]:.3f}, but the router receives counts only")


def plot_map(signatures: np.ndarray, km: BalancedKMeans, traces: TraceSet, path: str, seed: int,
             max_points: int = 5000):
    """PCA 2D of (a sample of) the signatures: the first panel colours each point by its
    region (most similar centroid = the decode server the router's regions send it to),
    one more panel per label kind; centroids numbered in decode order. Returns the figure
    (saved to ``path`` and closed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from sklearn.decomposition import PCA

    rng = np.random.default_rng(seed)
    idx = np.sort(rng.choice(len(signatures), min(max_points, len(signatures)), replace=False))
    pca = PCA(n_components=2, random_state=seed).fit(signatures[idx])
    points, centers = pca.transform(signatures[idx]), pca.transform(km.cluster_centers_)
    region = np.argmax(signatures[idx] @ np.asarray(km.cluster_centers_).T, axis=1)
    panels = [("region", np.array([f"decode {k}" for k in region]))]
    panels += [(kind, traces.labels[kind][idx]) for kind in sorted(traces.labels)]
    var = pca.explained_variance_ratio_ * 100
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5.5), squeeze=False)
    for ax, (kind, values) in zip(axes[0], panels):
        names = sorted(np.unique(values), key=lambda v: (len(v), v))
        for name in names:
            sel = values == name
            ax.scatter(points[sel, 0], points[sel, 1], s=4, alpha=0.5, label=f"{name} ({int(sel.sum())})")
        ax.legend(markerscale=3, fontsize=8, loc="best")
        ax.scatter(centers[:, 0], centers[:, 1], marker="X", s=110, c="black", edgecolors="white")
        for k, (x, y) in enumerate(centers):  # centroid k = decode server k (the router's --decode order)
            ax.annotate(str(k), (x, y), xytext=(6, 6), textcoords="offset points", fontsize=11,
                        fontweight="bold")
        ax.set_xlabel(f"PC 1 ({var[0]:.0f}% of variance)")
        ax.set_ylabel(f"PC 2 ({var[1]:.0f}% of variance)")
        ax.set_title("signatures by region = decode server" if kind == "region"
                     else f"signatures by {kind}")
    fig.suptitle(f"{traces.model.name}: {len(signatures)} signatures, K={km.n_clusters} "
                 f"(X n = centroid n = decode server n)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


if __name__ == "__main__":
    sys.exit(main())
