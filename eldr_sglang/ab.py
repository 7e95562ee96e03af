"""``python -m eldr_sglang.ab`` / ``eldr-ab``: the verdict of an A/B run from its slice records.

    python -m eldr_sglang.ab RECORDS.jsonl [MORE.jsonl ...] [--baseline jsq] [--skip-first 1]
        [--plot ab.png] [--json verdict.json]

Reads the JSON lines routers write with ``--ab-record`` (time-sliced A/B: one router
alternating policies; pool-split A/B: one file per router and pool). Each slice is
one observation. Per arm and metric it prints the mean over slices and, against
the baseline arm, the relative difference with a 95% bootstrap confidence
interval (``scipy.stats.bootstrap``, resampling slices). Distinct experts per
decode step is also compared **at equal batch size**: an ordinary least-squares fit
over slices, ``unique_per_step ~ 1 + log(mean_batch) + arm``, whose arm coefficient
(with its t-based 95% interval) is the difference at the same batch size. A plot
shows every slice's value over time, by arm. Bad input ends with ``error: ...``
naming the file and line, exit status 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pydantic
from scipy import stats

from eldr_sglang.cliparse import OneLineParser

METRICS = (("unique_per_step", "distinct experts / decode step", "lower"),
           ("tpot_mean_s", "TPOT (s, engines)", "lower"),
           ("ttft_mean_s", "TTFT (s, engines)", "lower"),
           ("latency_p50_s", "router latency p50 (s)", "lower"),
           ("latency_p99_s", "router latency p99 (s)", "lower"),
           ("throughput_rps", "throughput (req/s)", "higher"),
           ("mean_batch", "mean decode batch", None))


class SliceRecord(pydantic.BaseModel):
    """The fields of an ``--ab-record`` line the verdict reads (others are kept as they are)."""

    model_config = pydantic.ConfigDict(extra="allow")
    arm: str
    start: float
    end: Optional[float] = None
    requests: int = 0
    errors: int = 0
    unique_per_step: Optional[float] = None
    tpot_mean_s: Optional[float] = None
    ttft_mean_s: Optional[float] = None
    latency_p50_s: Optional[float] = None
    latency_p99_s: Optional[float] = None
    throughput_rps: Optional[float] = None
    mean_batch: Optional[float] = None


def _record(rec: object, where: str) -> dict:
    """The typed record; ValueError ``FILE:LINE: FIELD: ...``."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: not a slice record (a JSON object with 'arm' and 'start')")
    try:
        return SliceRecord.model_validate(rec).model_dump()
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        field = ".".join(map(str, err["loc"])) or "record"
        got = "" if err["type"] == "missing" else f", got {err['input']!r}"
        raise ValueError(f"{where}: {field}: {err['msg'].lower()}{got}") from None


def load_records(paths: Sequence[str]) -> list[dict]:
    out = []
    for path in paths:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"{path}: cannot read ({e.strerror})") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            out.append({**_record(rec, f"{path}:{n}"), "_file": path})
    if not out:
        raise ValueError("no slice records in " + ", ".join(paths))
    return sorted(out, key=lambda r: r["start"])


def relative_difference(a: np.ndarray, b: np.ndarray, seed: int = 0) -> tuple[float, float, float]:
    """mean(a) / mean(b) - 1 with a 95% percentile bootstrap interval (slices resampled)."""
    point = float(a.mean() / b.mean() - 1.0)
    if a.size < 2 or b.size < 2:
        return point, float("nan"), float("nan")
    res = stats.bootstrap((a, b), lambda x, y, axis=-1: x.mean(axis) / y.mean(axis) - 1.0,
                          n_resamples=2000, method="percentile", random_state=seed, vectorized=True)
    return point, float(res.confidence_interval.low), float(res.confidence_interval.high)


def equal_batch_effect(recs: list[dict], arm: str, baseline: str) -> Optional[dict]:
    """OLS over slices of both arms: unique_per_step ~ 1 + log(mean_batch) + [arm];
    the arm coefficient relative to the baseline's mean, with a 95% t interval."""
    rows = [r for r in recs if r["arm"] in (arm, baseline)
            and r.get("unique_per_step") is not None and (r.get("mean_batch") or 0) > 0]
    y = np.array([r["unique_per_step"] for r in rows], dtype=float)
    X = np.array([[1.0, np.log(r["mean_batch"]), float(r["arm"] == arm)] for r in rows])
    if len(rows) < 4 or X[:, 2].sum() < 2 or (1 - X[:, 2]).sum() < 2:
        return None
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    dof = len(y) - X.shape[1]
    if dof < 1:
        return None
    resid = y - X @ coef
    cov = resid @ resid / dof * np.linalg.pinv(X.T @ X)
    se = float(np.sqrt(max(cov[2, 2], 0.0)))
    t = float(stats.t.ppf(0.975, dof))
    base = float(y[X[:, 2] == 0].mean())
    return {"difference": float(coef[2]), "relative": float(coef[2] / base),
            "ci_low": float((coef[2] - t * se) / base), "ci_high": float((coef[2] + t * se) / base),
            "slices": len(rows)}


def verdict(recs: list[dict], baseline: Optional[str] = None) -> dict:
    arms = sorted({r["arm"] for r in recs})
    if len(arms) < 2:
        raise ValueError(f"need slices of at least two arms, found {arms}")
    baseline = baseline or arms[0]
    if baseline not in arms:
        raise ValueError(f"--baseline {baseline!r} is not an arm of the records ({', '.join(arms)})")
    out: dict = {"baseline": baseline, "arms": {}, "comparisons": {}}
    for arm in arms:
        mine = [r for r in recs if r["arm"] == arm]
        out["arms"][arm] = {"slices": len(mine), "requests": int(sum(r.get("requests", 0) for r in mine)),
                            **{m: _mean(mine, m) for m, _, _ in METRICS}}
    for arm in arms:
        if arm == baseline:
            continue
        comp = {}
        for metric, _, _ in METRICS:
            a, b = _values(recs, arm, metric), _values(recs, baseline, metric)
            if a.size and b.size and b.mean() != 0:
                point, lo, hi = relative_difference(a, b)
                comp[metric] = {"relative": point, "ci_low": lo, "ci_high": hi, "slices": [a.size, b.size]}
        comp["unique_per_step_equal_batch"] = equal_batch_effect(recs, arm, baseline)
        out["comparisons"][arm] = comp
    return out


def _values(recs: list[dict], arm: str, metric: str) -> np.ndarray:
    return np.array([r[metric] for r in recs if r["arm"] == arm and r.get(metric) is not None], dtype=float)


def _mean(recs: list[dict], metric: str) -> Optional[float]:
    v = [r[metric] for r in recs if r.get(metric) is not None]
    return float(np.mean(v)) if v else None


def _pct(x: float) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{100 * x:+.1f}%"


def render(v: dict) -> str:
    lines = [f"baseline: {v['baseline']}"]
    for arm, s in v["arms"].items():
        figs = ", ".join(f"{m} {s[m]:.4g}" for m, _, _ in METRICS if s.get(m) is not None)
        lines.append(f"  {arm}: {s['slices']} slices, {s['requests']} requests; {figs}")
    for arm, comp in v["comparisons"].items():
        lines.append(f"{arm} vs {v['baseline']} (95% CI over slices):")
        eb = comp.get("unique_per_step_equal_batch")
        if eb is not None:
            sig = eb["ci_high"] < 0 or eb["ci_low"] > 0
            lines.append(f"  distinct experts per step at equal batch size: {_pct(eb['relative'])} "
                         f"[{_pct(eb['ci_low'])}, {_pct(eb['ci_high'])}], {eb['slices']} slices -> "
                         + (("fewer" if eb["relative"] < 0 else "more") if sig else "no significant difference"))
        for metric, label, better in METRICS:
            c = comp.get(metric)
            if c is None:
                continue
            lines.append(f"  {label}: {_pct(c['relative'])} [{_pct(c['ci_low'])}, {_pct(c['ci_high'])}]")
    return "\n".join(lines)


def plot(recs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = recs[0]["start"]
    panels = [(m, label) for m, label, _ in METRICS[:5] if any(r.get(m) is not None for r in recs)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), squeeze=False, sharex=True)
    for ax, (metric, label) in zip(axes[:, 0], panels):
        for arm in sorted({r["arm"] for r in recs}):
            pts = [((r["start"] + r.get("end", r["start"])) / 2 - t0, r[metric]) for r in recs
                   if r["arm"] == arm and r.get(metric) is not None]
            if pts:
                x, y = zip(*pts)
                ax.plot(x, y, "o", label=arm)
        ax.set_ylabel(label, fontsize=8)
        ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("seconds since the first slice")
    fig.suptitle("A/B slices by arm (each point one slice)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = OneLineParser(prog="eldr-ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("records", nargs="+", help="--ab-record files (JSON lines)")
    ap.add_argument("--baseline", default=None, help="the arm the others are compared with (default: first by name)")
    ap.add_argument("--skip-first", type=int, default=0, help="drop each file's first N slices (warm-up)")
    ap.add_argument("--plot", default=None, help="PNG of every slice by arm")
    ap.add_argument("--json", default=None, help="write the verdict as JSON")
    args = ap.parse_args(argv)
    if args.skip_first < 0:
        ap.error(f"--skip-first must be >= 0, got {args.skip_first}")
    try:
        recs = load_records(args.records)
        if args.skip_first:
            firsts: dict[str, int] = {}
            kept = []
            for r in recs:
                firsts[r["_file"]] = firsts.get(r["_file"], 0) + 1
                if firsts[r["_file"]] > args.skip_first:
                    kept.append(r)
            recs = kept
        v = verdict(recs, args.baseline)
    except ValueError as e:
        ap.error(str(e))
    print(render(v))
    if args.json:
        Path(args.json).write_text(json.dumps(v, indent=1))
    if args.plot:
        plot(recs, args.plot)
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
