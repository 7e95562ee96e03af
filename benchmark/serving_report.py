"""What ``bench_serving_routers.py``'s runs come to: per-path medians over the rounds, ratios and
added latency paired per round, the targets, and the table and router counters it prints.

Reads only the run records (``doc["runs"]``) and the routers' ``after`` status in the result
document, so a saved ``benchmark/results/bench_serving_routers.json`` can be summarised again.
"""

from __future__ import annotations

import collections
import statistics
from typing import Any

TARGETS = {"eldr_throughput_ratio": 0.7, "eldr_w2_throughput_ratio": 1.0, "added_p50_ms": 0.5}


def _med(xs: list[float]) -> float:
    """Median, NaN for none."""
    return statistics.median(xs) if xs else float("nan")


def _spread(xs: list[float], fmt: str) -> str:
    """``"median [min-max]"`` (one value: itself; none: n/a)."""
    if not xs:
        return "n/a"
    if len(xs) == 1:
        return format(xs[0], fmt)
    return f"{format(_med(xs), fmt)} [{format(min(xs), fmt)}-{format(max(xs), fmt)}]"


def _us(v: float) -> str:
    """Microseconds as an integer, ``-`` for none."""
    return f"{v:.0f}" if v == v else "-"


def summarize(runs: list[dict], paths: list[str], thr_mode: str, lat_mode: str) -> dict:
    """Per path: medians over repeats; ratio and added latency paired per round."""
    by = collections.defaultdict(dict)  # (mode, path) -> {round: result}
    for r in runs:
        if "result" in r:
            by[(r["mode"], r["path"])][r["round"]] = r["result"]
    out: dict[str, Any] = {}
    for p in paths:
        thr = by[(thr_mode, p)]
        lat = by[(lat_mode, p)]
        s: dict[str, Any] = {
            "request_throughput": [v["request_throughput"] for v in thr.values()],
            "p50_ms": [v["median_e2e_latency_ms"] for v in lat.values()],
            "p99_ms": [v["p99_e2e_latency_ms"] for v in lat.values()],
            "failed": sum(r.get("failed", 0) for r in runs if r["path"] == p),
            "failed_runs": sum(1 for r in runs if r["path"] == p and "result" not in r),
        }
        cpu = [r["cpu_per_request"][p] for r in runs
               if r["path"] == p and r["mode"] == thr_mode and p in r.get("cpu_per_request", {})]
        s["router_cpu_us"] = [c["total_us"] for c in cpu]  # at the throughput mode's load
        s["router_user_cpu_us"] = [c["user_us"] for c in cpu]
        sg, d = by[(thr_mode, "sglang-router")], by[(lat_mode, "direct")]
        s["ratio_vs_sglang_router"] = [thr[k]["request_throughput"] / sg[k]["request_throughput"]
                                       for k in thr if k in sg and sg[k]["request_throughput"]]
        s["added_p50_ms"] = [lat[k]["median_e2e_latency_ms"] - d[k]["median_e2e_latency_ms"]
                             for k in lat if k in d]
        s["added_p99_ms"] = [lat[k]["p99_e2e_latency_ms"] - d[k]["p99_e2e_latency_ms"]
                             for k in lat if k in d]
        sgl = by[(lat_mode, "sglang-router")]
        s["p50_minus_sglang_router_ms"] = [lat[k]["median_e2e_latency_ms"] - sgl[k]["median_e2e_latency_ms"]
                                           for k in lat if k in sgl]
        s["median"] = {k: _med(s[k]) for k in ("request_throughput", "p50_ms", "p99_ms",
                                               "ratio_vs_sglang_router", "added_p50_ms", "added_p99_ms",
                                               "p50_minus_sglang_router_ms", "router_cpu_us",
                                               "router_user_cpu_us")}
        out[p] = s
    return out


def targets(summary: dict) -> list[dict]:
    """The ``TARGETS`` checks on the summary's medians (``met`` is None where the figure is missing)."""
    rows = []

    def add(what: str, path: str, key: str, goal: float, ge: bool) -> None:
        v = summary.get(path, {}).get("median", {}).get(key, float("nan"))
        met = (v >= goal if ge else v <= goal) if v == v else None
        rows.append({"target": what, "path": path, "value": v, "goal": goal, "met": met})

    add(f"{'eldr'} throughput >= {TARGETS['eldr_throughput_ratio']}x sglang-router", "eldr",
        "ratio_vs_sglang_router", TARGETS["eldr_throughput_ratio"], True)
    add(f"eldr --workers 2 throughput >= {TARGETS['eldr_w2_throughput_ratio']}x sglang-router",
        "eldr-w2", "ratio_vs_sglang_router", TARGETS["eldr_w2_throughput_ratio"], True)
    add(f"eldr added p50 <= {TARGETS['added_p50_ms']} ms (vs direct)", "eldr", "added_p50_ms",
        TARGETS["added_p50_ms"], False)
    add(f"eldr --workers 2 added p50 <= {TARGETS['added_p50_ms']} ms (vs direct)", "eldr-w2",
        "added_p50_ms", TARGETS["added_p50_ms"], False)
    return rows


def print_table(summary: dict, tgt: list[dict], modes: dict, repeats: int, quick: bool) -> None:
    """The per-path table and the targets, on stdout."""
    (tm, tc, tn), (lm, lc, ln) = modes["throughput"], modes["latency"]
    print(f"\nbench_serving (unmodified), median over {repeats} repeat(s) [min-max]; "
          f"throughput: {tm} mode (C={tc}, N={tn}); latency: {lm} mode (C={lc}, N={ln})"
          + ("; --quick smoke run: latency under load, not the targets' figures" if quick else ""))
    print("x sglang-rt, +p50/+p99 (vs direct) and p50-sgl (vs sglang-router) are paired per round "
          "(same round's figures), then the median over rounds; cpu us / user = the router process's "
          "CPU per request at the throughput load (all / user time); failed = failed requests")
    hdr = (f"  {'path':14s} {'req/s':>22s} {'x sglang-rt':>12s} {'p50 ms':>20s} {'p99 ms':>20s} "
           f"{'+p50 ms':>8s} {'+p99 ms':>8s} {'p50-sgl':>8s} {'cpu us':>7s} {'user':>6s} {'failed':>6s}")
    print(hdr)
    for p, s in summary.items():
        m = s["median"]
        fr = f"{s['failed']}" + (f"+{s['failed_runs']}run" if s["failed_runs"] else "")
        ratio = f"{m['ratio_vs_sglang_router']:.2f}" if m["ratio_vs_sglang_router"] == m["ratio_vs_sglang_router"] else "n/a"
        a50 = f"{m['added_p50_ms']:+.3f}" if p != "direct" and m["added_p50_ms"] == m["added_p50_ms"] else "-"
        a99 = f"{m['added_p99_ms']:+.3f}" if p != "direct" and m["added_p99_ms"] == m["added_p99_ms"] else "-"
        vs = m["p50_minus_sglang_router_ms"]
        vs = f"{vs:+.3f}" if p != "sglang-router" and vs == vs else "-"
        print(f"  {p:14s} {_spread(s['request_throughput'], '.0f'):>22s} {ratio:>12s} "
              f"{_spread(s['p50_ms'], '.3f'):>20s} {_spread(s['p99_ms'], '.3f'):>20s} "
              f"{a50:>8s} {a99:>8s} {vs:>8s} {_us(m['router_cpu_us']):>7s} {_us(m['router_user_cpu_us']):>6s} "
              f"{fr:>6s}")
    print("targets:")
    for t in tgt:
        v = t["value"]
        verdict = "n/a" if t["met"] is None else ("MET" if t["met"] else "NOT MET")
        print(f"  {t['target']:55s} {v:8.3f}  {verdict}")


def print_router_status(doc: dict, paths: list[str]) -> None:
    """One line per ELDR path: its /eldr/status counters and added-latency / signature-wait metrics."""
    for p in paths:
        after = doc["paths"][p].get("after")
        if after:
            st = after.get("status", {})
            c = st.get("counters") or {}
            al = after.get("added_latency_metric") or {}
            sw = after.get("signature_wait_metric") or {}
            print(f"  {p} (/eldr/status of one process): requests {c.get('requests')}, decisions "
                  f"{c.get('decisions')}, signatures_used {c.get('signatures_used')}, fallbacks "
                  f"{c.get('fallbacks', 0)}; added-latency metric p50/p99 <= "
                  f"{al.get('p50_le_ms')}/{al.get('p99_le_ms')} ms (n={al.get('count')}, "
                  f"{(al.get('buckets') or {}).get('1e-05')} in the <= 10 us bucket); signature "
                  f"wait p50/p99 <= {sw.get('p50_le_ms')}/{sw.get('p99_le_ms')} ms")


def record_summary(doc: dict, paths: list[str], modes: dict, repeats: int, quick: bool) -> None:
    """``doc["summary"]`` and ``doc["targets"]`` from ``doc["runs"]``; prints the table and the routers' counters."""
    thr_mode, lat_mode = modes["throughput"][0], modes["latency"][0]
    summary = summarize(doc["runs"], paths, thr_mode, lat_mode)
    doc["summary"] = summary
    doc["targets"] = targets(summary)
    print_table(summary, doc["targets"], modes, repeats, quick)
    print_router_status(doc, paths)
