"""The main job in one command: ELDR routing a real SGLang PD cluster on CPU.

1. start 1 prefill + N decode real SGLang CPU servers (mooncake_tcp, late
   binding) with the trained tiny MoE (``models/eldr-tiny-moe``) and the ELDR
   plugin: the prefill server captures the calibrated layers' top-k expert ids
   and publishes each request's signature to the router;
2. load the committed calibration artifact for N decode servers, or calibrate
   one from the committed traces (``python -m eldr_sglang.calibrate``);
3. replay a mixed workload (``benchmark/workloads/demo.jsonl``: code, maths,
   medicine, law; English, Chinese, Russian, French) through the ELDR router
   with ``--policy round_robin``, then restart only the router with
   ``--policy eldr`` (the paper's band rule) and ``--policy eldr_balanced`` (the
   default) and replay it again each time;
4. print, per policy: each decode server's label mix and request count, the mean distinct experts
   per decode step measured inside the decode servers, latency figures and a
   verdict; save a PNG; tear everything down (also on Ctrl-C).

    python -m eldr_sglang.demo
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from eldr_sglang.core.policies import policy_spec
from eldr_sglang.testing import local_cluster as lc

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "models" / "eldr-tiny-moe"
MIN_PLOT_STEPS = 5  # batch sizes seen in fewer decode steps are left off the plot
DEFAULT_WORKLOAD = ROOT / "benchmark" / "workloads" / "demo.jsonl"
CALIBRATION_TRACES = [ROOT / "benchmark" / "traces" / "task" / "calib", ROOT / "benchmark" / "traces" / "language" / "calib"]


@dataclass
class RequestResult:
    rid: str
    label: str
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass
class PhaseReport:
    policy: str
    results: list[RequestResult]
    label_mix: dict[str, Counter] = field(default_factory=dict)
    unique_per_step: dict[str, float] = field(default_factory=dict)
    steps: dict[str, float] = field(default_factory=dict)
    by_batch: dict[int, list[int]] = field(default_factory=dict)  # batch size -> distinct experts per step
    router_counters: dict[str, int] = field(default_factory=dict)  # the router's /eldr/status counters
    home: list[bool] = field(default_factory=list)  # per scored decision: went to its most similar region
    band_home: list[bool] = field(default_factory=list)  # per decision with a band of 2+: its most similar member
    wall: float = 0.0

    def unique_overall(self) -> float:
        steps = sum(self.steps.values())
        return sum(self.unique_per_step[u] * self.steps[u] for u in self.steps) / steps if steps else float("nan")

    def latency_figures(self) -> dict[str, float]:
        ok = [r for r in self.results if r.ok]
        tpots = [r.tpot * 1000 for r in ok if r.tpot is not None]
        return {
            "completed": len(ok), "failed": len(self.results) - len(ok),
            "median_ttft_ms": statistics.median(r.ttft * 1000 for r in ok) if ok else float("nan"),
            "median_tpot_ms": statistics.median(tpots) if tpots else float("nan"),
            "p99_tpot_ms": float(np.percentile(tpots, 99)) if tpots else float("nan"),
            "median_e2e_ms": statistics.median(r.latency * 1000 for r in ok) if ok else float("nan"),
            "output_tok_per_s": sum(r.output_tokens for r in ok) / self.wall if self.wall else float("nan"),
        }


def workload(path: Path, repeat: int, limit: int = 0, seed: int = 0) -> list[tuple[str, str, str]]:
    """(rid, "domain/language" label, prompt) of the first ``limit`` requests (0 = all)
    of a workload file, ``repeat`` times, in one fixed shuffled order (both policies
    replay the same order; the file alternates the two workloads, and round robin
    over 2 servers would otherwise split them by workload by accident)."""
    with open(path, encoding="utf-8") as f:
        reqs = [json.loads(line) for line in f]
    reqs = reqs[:limit] if limit else reqs
    random.Random(seed).shuffle(reqs)
    return [(f"{r['id']}-{k}", f"{r['labels']['domain']}/{r['labels']['language']}", r["prompt"])
            for k in range(repeat) for r in reqs]


async def _one(session, url: str, rid: str, label: str, prompt: str, max_new: int, tag: str) -> RequestResult:
    import aiohttp

    body = {"text": prompt, "rid": f"{tag}-{rid}", "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    t0 = time.perf_counter()
    ttft, tokens = 0.0, 0
    try:
        async with session.post(url + "/generate", json=body) as resp:
            if resp.status != 200:
                return RequestResult(rid, label, False, error=f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                tokens = json.loads(line[5:])["meta_info"].get("completion_tokens", tokens)
                if not ttft and tokens:
                    ttft = time.perf_counter() - t0
        return RequestResult(rid, label, True, ttft, time.perf_counter() - t0, tokens)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return RequestResult(rid, label, False, error=repr(exc))


async def replay(url: str, rows, max_new: int, concurrency: int, tag: str) -> tuple[list[RequestResult], float]:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=600)

    async def bounded(session, row):
        async with sem:
            return await _one(session, url, *row, max_new=max_new, tag=tag)

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout) as session:
        results = await asyncio.gather(*(bounded(session, row) for row in rows))
    return list(results), time.perf_counter() - t0


def decode_counters(cluster: lc.PDCluster) -> dict[str, tuple[float, float]]:
    out = {}
    for proc, spec in cluster.decodes:
        m = lc.scrape_metrics(spec.eldr_metrics_port)
        out[proc.url] = (m["eldr_decode_unique_experts_total"], m["eldr_decode_steps_total"])
    return out


def step_lines(trace_dir: Path) -> dict[Path, list[dict]]:
    """Per-step records (batch size, distinct experts per layer) the decode servers logged."""
    return {f: [json.loads(line) for line in f.open()] for f in trace_dir.glob("steps-*.jsonl")}


def run_phase(cluster: lc.PDCluster, router: lc.ManagedProcess, policy: str, rows, args,
              decode_trace: Path) -> PhaseReport:
    before, steps_before = decode_counters(cluster), step_lines(decode_trace)
    results, wall = asyncio.run(replay(router.url, rows, args.max_new_tokens, args.concurrency, policy))
    after = decode_counters(cluster)
    # the servers' trace thread writes a step line per decode step they counted: wait for them
    steps = sum(after[u][1] - before[u][1] for u in after) + sum(map(len, steps_before.values()))
    deadline = time.monotonic() + 30.0
    while sum(map(len, step_lines(decode_trace).values())) < steps and time.monotonic() < deadline:
        time.sleep(0.05)
    report = PhaseReport(policy, results, wall=wall)
    for f, lines in step_lines(decode_trace).items():
        for step in lines[len(steps_before.get(f, [])):]:
            report.by_batch.setdefault(step["batch_size"], []).append(sum(step["unique_per_layer"]))
    report.router_counters = lc.http_json(router.url + "/eldr/status")["counters"]
    label_of = {f"{policy}-{r.rid}": r.label for r in results}
    report.label_mix = {proc.url: Counter() for proc, _ in cluster.decodes}
    for decision in lc.http_json(router.url + f"/eldr/decisions?last={len(rows) + 10}"):
        mine = [rid for rid in decision["rids"] if rid in label_of]
        for rid in mine:
            report.label_mix[decision["decode"]][label_of[rid]] += 1
        sims = decision.get("server_similarities")
        if mine and sims:
            report.home.append(decision["decode"] == max(sims, key=sims.get))
            band = [u for u in decision.get("band") or () if u in sims]
            if len(band) > 1:
                report.band_home.append(decision["decode"] == max(band, key=sims.get))
    for url in after:
        du, ds = after[url][0] - before[url][0], after[url][1] - before[url][1]
        report.steps[url] = ds
        report.unique_per_step[url] = du / ds if ds else float("nan")
    return report


def calibration_artifact(model: Path, n_decode: int, out: Path) -> Path:
    """The committed artifact for ``n_decode`` servers, else one calibrated now
    from the committed traces (the operator's command)."""
    committed = model / f"calibration-k{n_decode}.json"
    if committed.exists():
        return committed
    from eldr_sglang.calibrate import main as calibrate_main

    artifact = out / f"calibration-k{n_decode}.json"
    print(f"No committed artifact for {n_decode} decode servers: calibrating from {CALIBRATION_TRACES[0].parent.parent}"
          " ...", flush=True)
    if calibrate_main(["--traces", *map(str, CALIBRATION_TRACES), "--clusters", str(n_decode),
                       "--out", str(artifact)]):
        raise RuntimeError("calibration failed")
    return artifact


def matched_change(base: PhaseReport, other: PhaseReport) -> tuple[float, int]:
    """Relative change of distinct experts per step at equal batch size: the
    per-batch-size means compared, weighted by the smaller step count."""
    num = den = 0.0
    matched = 0
    for b in set(base.by_batch) & set(other.by_batch):
        w = min(len(base.by_batch[b]), len(other.by_batch[b]))
        mb, mo = np.mean(base.by_batch[b]), np.mean(other.by_batch[b])
        num += w * (mo - mb) / mb
        den += w
        matched += w
    return (100.0 * num / den if den else float("nan")), matched


def max_over_mean(mix: dict[str, Counter]) -> float:
    """Requests of the busiest decode server over the mean per server (1.0 = even)."""
    per = [sum(c.values()) for c in mix.values()]
    return max(per) / (sum(per) / len(per)) if per and sum(per) else float("nan")


def label_entropy(mix: dict[str, Counter]) -> float:
    """Mean Shannon entropy (bits) of the label mix per decode server, weighted by
    requests: 0 when each server gets one label, log2(labels) when all mix evenly."""
    total = sum(sum(c.values()) for c in mix.values())
    h = 0.0
    for c in mix.values():
        n = sum(c.values())
        p = np.array([v / n for v in c.values() if v]) if n else np.array([])
        h += n / total * float(-(p * np.log2(p)).sum()) if total else 0.0
    return h


def report_json(reports: list[PhaseReport], decode_urls: list[str]) -> dict:
    """What the demo printed, as data (``report.json`` next to ``report.txt``)."""
    change, matched = matched_change(reports[0], reports[-1])
    return {
        "decode_servers": decode_urls,
        "policies": {rep.policy: {
            "label_mix": {u: dict(rep.label_mix[u]) for u in decode_urls},
            "label_entropy_bits": label_entropy(rep.label_mix),
            "requests_per_server": [sum(rep.label_mix[u].values()) for u in decode_urls],
            "requests_max_over_mean": max_over_mean(rep.label_mix),
            "unique_experts_per_step": {u: rep.unique_per_step[u] for u in decode_urls},
            "decode_steps": {u: rep.steps[u] for u in decode_urls},
            "mean_unique_experts_per_step": rep.unique_overall(),
            "latency": rep.latency_figures(), "wall_s": rep.wall,
            "router_counters": rep.router_counters,
            # share of signature-scored decisions sent to the most similar region (None: not scored;
            # a signature-blind balancer sends 1/N there on average)
            "home_share": sum(rep.home) / len(rep.home) if rep.home else None,
            # decisions whose band (the servers the rule let similarity choose among) held 2 or more,
            # and the share of them that went to the band's most similar region
            "band_decisions": len(rep.band_home),
            "band_home_share": sum(rep.band_home) / len(rep.band_home) if rep.band_home else None,
        } for rep in reports},
        "equal_batch_change_pct": change, "matched_steps": matched,
        "vs_baseline": {rep.policy: dict(zip(("equal_batch_change_pct", "matched_steps"),
                                             matched_change(reports[0], rep))) for rep in reports[1:]},
    }


def print_report(reports: list[PhaseReport], decode_urls: list[str]) -> str:
    lines = []
    w = 18
    lines.append("")
    lines.append("=" * 78)
    lines.append("Per decode server: mean distinct experts per decode step (summed over MoE layers) | label mix")
    for rep in reports:
        lines.append(f"  policy {rep.policy}:")
        for i, url in enumerate(decode_urls):
            mix = ", ".join(f"{k} {v}" for k, v in sorted(rep.label_mix[url].items()))
            lines.append(f"    decode-{i}: {rep.unique_per_step[url]:5.1f} experts/step over "
                         f"{rep.steps[url]:.0f} steps | {mix}")
    lines.append("")
    figs = [rep.latency_figures() for rep in reports]
    lines.append("".ljust(26) + "".join(rep.policy.rjust(w) for rep in reports))
    lines.append("mean experts/decode step".ljust(26) + "".join(f"{rep.unique_overall():{w}.2f}" for rep in reports))
    lines.append("requests per server".ljust(26) + "".join(
        "/".join(str(sum(rep.label_mix[u].values())) for u in decode_urls).rjust(w) for rep in reports))
    lines.append("max/mean requests".ljust(26) + "".join(f"{max_over_mean(rep.label_mix):{w}.2f}" for rep in reports))
    lines.append("label entropy/server, bits".ljust(26) + "".join(f"{label_entropy(rep.label_mix):{w}.2f}"
                                                              for rep in reports))
    lines.append("to most similar region".ljust(26) + "".join(
        (f"{sum(rep.home) / len(rep.home):.0%}" if rep.home else "-").rjust(w) for rep in reports))
    for key in figs[0]:
        lines.append(key.ljust(26) + "".join(f"{f[key]:{w}.1f}" for f in figs))
    lines.append("distinct experts per step by batch size (batch: "
                 + " | ".join(r.policy for r in reports) + "):")
    for b in sorted(set().union(*(r.by_batch for r in reports))):
        cells = [f"{np.mean(r.by_batch[b]):5.1f} ({len(r.by_batch[b])} steps)" if b in r.by_batch else "-"
                 for r in reports]
        lines.append(f"  {b:3d}: " + " | ".join(cells))
    lines.append("")
    for rep in reports[1:]:
        change, matched = matched_change(reports[0], rep)
        lines.append(f"Verdict: at equal batch size, {rep.policy} activated {abs(change):.1f}% "
                     f"{'fewer' if change < 0 else 'more'} distinct experts per decode step than "
                     f"{reports[0].policy} ({matched} matched steps), with max/mean requests per decode "
                     f"server {max_over_mean(rep.label_mix):.2f} ({reports[0].policy}: "
                     f"{max_over_mean(reports[0].label_mix):.2f}).")
    lines.append("Note: CPU latency here does not stand for GPU latency; distinct experts per decode step is the")
    lines.append("hardware-independent figure (a GPU decode step reads the weights of each distinct expert once).")
    lines.append("=" * 78)
    text = "\n".join(lines)
    print(text)
    return text


def save_plot(reports: list[PhaseReport], decode_urls: list[str], out: Path) -> Path:
    """Label mix per decode server for each policy, and distinct experts per decode
    step against batch size (the policies produce different batch sizes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({label for rep in reports for mix in rep.label_mix.values() for label in mix})
    colors = plt.get_cmap("tab20").colors
    fig, axes = plt.subplots(1, len(reports) + 1, figsize=(5 * (len(reports) + 1), 4.2))
    for ax, rep in zip(axes, reports):
        bottom = np.zeros(len(decode_urls))
        for j, label in enumerate(labels):
            vals = np.array([rep.label_mix[u][label] for u in decode_urls], dtype=float)
            ax.bar([f"decode-{i}" for i in range(len(decode_urls))], vals, bottom=bottom, label=label,
                   color=colors[j % len(colors)])
            bottom += vals
        ax.set_title(f"{rep.policy}: requests per decode server\n(label mix; max/mean {max_over_mean(rep.label_mix):.2f})")
    top = max(sum(mix.values()) for rep in reports for mix in rep.label_mix.values())
    for ax in axes[:-1]:
        ax.set_ylim(0, top * 1.5)  # one scale for both policies; headroom for the legend
    axes[0].legend(fontsize=7, ncol=3, loc="upper center")
    ax = axes[-1]
    for rep, style in zip(reports, ("o--", "s-", "^-", "d-", "v-")):
        sizes = sorted(b for b, v in rep.by_batch.items() if len(v) >= MIN_PLOT_STEPS)
        ax.plot(sizes, [np.mean(rep.by_batch[b]) for b in sizes], style, label=rep.policy)
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("distinct experts per step (all MoE layers)")
    changes = ", ".join(f"{rep.policy} {matched_change(reports[0], rep)[0]:+.1f}%" for rep in reports[1:])
    ax.set_title(f"measured inside the decode servers\nat equal batch size vs {reports[0].policy}: {changes}",
                 fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="ELDR (and other policies) vs round robin on a real SGLang CPU PD cluster")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD, help="requests (our workload format)")
    p.add_argument("--decodes", type=int, default=3, help="decode servers (each ~2.5 GB RAM)")
    p.add_argument("--requests", type=int, default=48, help="first N requests of the workload (0 = all)")
    p.add_argument("--repeat", type=int, default=1, help="times the workload is replayed per policy")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--out", type=Path, default=Path(".cache/demo"))
    p.add_argument("--policies", nargs="+", default=["round_robin", "eldr", "eldr_balanced"],
                   help="router policies replayed in turn; the first is the baseline the others "
                        "are compared with at equal batch size")
    args = p.parse_args(argv)
    if len(args.policies) < 2:
        p.error("--policies: give a baseline and at least one policy to compare")
    for name in args.policies:
        try:
            if policy_spec(name).needs_domain_map:
                p.error(f"--policies: {name} needs request labels mapped to servers; not in the demo")
        except ValueError as e:
            p.error(f"--policies: {e}")
    if not (args.model / "config.json").is_file():
        p.error(f"--model: no Hugging Face model at {args.model}")
    if not args.workload.is_file():
        p.error(f"--workload: {args.workload} not found")
    if args.decodes < 2:
        p.error("--decodes must be at least 2")
    if args.requests < 0 or args.repeat < 1 or args.max_new_tokens < 2 or args.concurrency < 1:
        p.error("--repeat and --concurrency must be >= 1, --max-new-tokens >= 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out
    decode_trace = out / "trace-decode"
    for f in decode_trace.glob("*.jsonl") if decode_trace.exists() else ():
        f.unlink()
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"

    def progress(name: str, elapsed: float) -> None:
        if int(elapsed) % 10 == 0:
            print(f"  ... {name} starting ({elapsed:.0f}s)", flush=True)

    artifact = calibration_artifact(args.model, args.decodes, out)
    rows = workload(args.workload, args.repeat, args.requests)
    print(f"Calibration artifact: {artifact}", flush=True)
    print(f"Starting 1 prefill + {args.decodes} decode SGLang CPU servers (one at a time, ~30-90 s each); "
          f"logs in {logs}", flush=True)
    cluster = router = None
    try:
        cluster = lc.start_pd_cluster(
            str(args.model), logs, n_prefill=1, n_decode=args.decodes, eldr_metrics=True, progress=progress,
            # each router names its own signature port in every request it sends
            prefill_args=["--eldr-calibration", str(artifact), "--eldr-publish", "request"],
            decode_args=["--eldr-trace-dir", str(decode_trace)])
        decode_urls = [p.url for p, _ in cluster.decodes]
        reports = []
        for policy in args.policies:
            lc.flush_cache(cluster.prefills[0][0].url)  # both policies start from a cold prefix cache
            router = lc.start_eldr_router_ready(
                cluster, logs, policy=policy,
                artifact=artifact,
                extra_args=["--signature-port", "0"])
            n_labels = len({label for _, label, _ in rows})
            print(f"Replaying {len(rows)} requests ({n_labels} labels, concurrency {args.concurrency}) "
                  f"through the ELDR router, --policy {policy} ...", flush=True)
            reports.append(run_phase(cluster, router, policy, rows, args, decode_trace))
            router.stop()
            router = None
        text = print_report(reports, decode_urls)
        (out / "report.txt").write_text(text + "\n")
        (out / "report.json").write_text(json.dumps(report_json(reports, decode_urls), indent=1) + "\n")
        png = save_plot(reports, decode_urls, out / "demo.png")
        print(f"Saved the comparison to {png} (and {out / 'report.txt'}).")
        return 0
    except KeyboardInterrupt:
        print("\nInterrupted; stopping all servers.", file=sys.stderr)
        return 130
    finally:
        if router is not None:
            router.stop()
        if cluster is not None:
            cluster.stop()
        print("All servers stopped.", flush=True)


if __name__ == "__main__":
    sys.exit(main())
