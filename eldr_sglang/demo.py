"""The main job in one command: ELDR routing a real SGLang PD cluster on CPU.

1. start 1 prefill + N decode real SGLang CPU servers (mooncake_tcp, late
   binding) with the ELDR plugin: the prefill server captures every layer's
   top-k expert ids, publishes signatures to the router and logs them;
2. start the ELDR router with ``--policy round_robin`` and replay a mixed
   workload (code, medicine, law, maths; English, Chinese, Russian, French);
3. calibrate from the trace logs of step 2 the way an operator would:
   ``tools/collect_traces.py`` then ``python -m eldr_sglang.calibrate``
   (IDF, balanced K-means with K = N, label purity, a PCA map);
4. restart only the router with ``--policy eldr`` and replay the same workload;
5. print, per policy: each decode server's label mix, the mean distinct experts
   per decode step measured inside the decode servers, latency figures; save
   a PNG; tear everything down (also on Ctrl-C).

    python -m eldr_sglang.demo --model .cache/models/tiny-qwen3-moe
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from eldr_sglang import local_cluster as lc

# Short prompts per (domain, language) label. The fixture model has random
# weights: its routing follows token identity (script, vocabulary), not meaning.
WORKLOAD: dict[str, list[str]] = {
    "code/en": [
        "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    mid = len(items) // 2",
        "import numpy as np\nx = np.arange(10)\nprint(x.reshape(2, 5).sum(axis=1))",
        "for (int i = 0; i < n; ++i) { total += values[i] * weights[i]; }",
        "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):",
        "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 3;",
        "async def fetch(session, url):\n    async with session.get(url) as resp:\n        return await resp.json()",
    ],
    "medical/en": [
        "Patients with type 2 diabetes showed improved glycemic control after twelve weeks of metformin.",
        "The randomized trial compared low-dose aspirin with placebo for secondary prevention of stroke.",
        "Chronic kidney disease is associated with anemia, hypertension and secondary hyperparathyroidism.",
        "Symptoms of pneumonia include fever, productive cough, pleuritic chest pain and dyspnea.",
        "The cohort study followed 4,000 adults to assess the risk factors for atrial fibrillation.",
        "Intravenous antibiotics were administered after blood cultures confirmed bacteremia.",
    ],
    "legal/en": [
        "Permission is hereby granted, free of charge, to any person obtaining a copy of this software.",
        "The licensee shall not sublicense, assign or transfer any rights under this agreement.",
        "In no event shall the authors be liable for any claim, damages or other liability.",
        "This agreement shall be governed by and construed in accordance with the laws of the State.",
        "Redistributions of source code must retain the above copyright notice and this list of conditions.",
        "The court held that the contract was void for lack of consideration between the parties.",
    ],
    "math/en": [
        "Solve for x: 3x + 7 = 22. Then compute x squared minus 4.",
        "Let f(x) = x^3 - 6x^2 + 11x - 6. Find all real roots of f.",
        "What is the derivative of sin(x) * exp(2x) with respect to x?",
        "Calculate the sum of the first 100 positive integers divisible by 3.",
        "A triangle has sides 5, 12 and 13. What is its area and its inradius?",
        "Evaluate the integral of 1 / (1 + x^2) from 0 to 1.",
    ],
    "general/zh": [
        "人工智能正在改变我们的生活方式和工作方式。",
        "中华人民共和国宪法规定公民享有言论自由。",
        "医生建议患者每天坚持锻炼并保持健康饮食。",
        "这个城市的交通在早高峰时非常拥堵。",
        "请计算三角形的面积，已知底为十厘米，高为六厘米。",
        "合同双方应当按照约定全面履行自己的义务。",
    ],
    "general/ru": [
        "Москва является столицей и крупнейшим городом России.",
        "Врач назначил пациенту курс антибиотиков на семь дней.",
        "Договор вступает в силу с момента его подписания сторонами.",
        "Решите уравнение: два икс плюс пять равно семнадцати.",
        "Погода в Санкт-Петербурге часто бывает дождливой и ветреной.",
        "Программа читает файл и выводит количество строк на экран.",
    ],
    "general/fr": [
        "Le contrat de licence accorde au titulaire un droit non exclusif d'utilisation.",
        "Le patient présente une fièvre persistante et une toux sèche depuis trois jours.",
        "La ville de Lyon est connue pour sa gastronomie et son patrimoine historique.",
        "Résoudre l'équation suivante : deux x plus trois égale onze.",
        "Cette commande affiche la liste des fichiers du répertoire courant.",
        "Les parties conviennent de soumettre tout litige au tribunal compétent.",
    ],
}


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


def workload(repeat: int) -> list[tuple[str, str, str]]:
    """(rid, label, prompt), interleaved so consecutive requests differ in label."""
    rows = []
    for r in range(repeat):
        for i in range(max(len(v) for v in WORKLOAD.values())):
            for label, prompts in WORKLOAD.items():
                if i < len(prompts):
                    rows.append((f"{label.replace('/', '-')}-{r}-{i}", label, prompts[i]))
    return rows


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
    time.sleep(1.0)  # trace lines are written by a background thread
    after = decode_counters(cluster)
    report = PhaseReport(policy, results, wall=wall)
    for f, lines in step_lines(decode_trace).items():
        for step in lines[len(steps_before.get(f, [])):]:
            report.by_batch.setdefault(step["batch_size"], []).append(sum(step["unique_per_layer"]))
    label_of = {f"{policy}-{r.rid}": r.label for r in results}
    report.label_mix = {proc.url: Counter() for proc, _ in cluster.decodes}
    for decision in lc.http_json(router.url + f"/eldr/decisions?last={len(rows) + 10}"):
        for rid in decision["rids"]:
            if rid in label_of:
                report.label_mix[decision["decode"]][label_of[rid]] += 1
    for url in after:
        du, ds = after[url][0] - before[url][0], after[url][1] - before[url][1]
        report.steps[url] = ds
        report.unique_per_step[url] = du / ds if ds else float("nan")
    return report


def calibrate(trace_dirs: list[Path], rows, tag: str, n_clusters: int, model_path: Path, out: Path) -> Path:
    """The operator's path: join the servers' trace logs into trace shards
    (``tools/collect_traces.py``), then ``python -m eldr_sglang.calibrate``
    on the layers the prefill server publishes (all 4)."""
    from eldr_sglang.calibrate import main as calibrate_main

    labels = out / "labels.jsonl"
    labels.write_text("".join(json.dumps({"rid": f"{tag}-{rid}", "task": label.split("/")[0],
                                          "language": label.split("/")[1]}) + "\n"
                              for rid, label, _ in rows))
    traces = out / "traces"
    shutil.rmtree(traces, ignore_errors=True)
    collect = Path(__file__).resolve().parents[1] / "tools" / "collect_traces.py"
    subprocess.run([sys.executable, str(collect), "--logs", *map(str, trace_dirs), "--model", str(model_path),
                    "--out", str(traces), "--labels", str(labels)], check=True)
    artifact = out / "artifact.json"
    num_layers = json.loads((model_path / "config.json").read_text())["num_hidden_layers"]
    if calibrate_main(["--traces", str(traces), "--clusters", str(n_clusters), "--out", str(artifact),
                       "--layers", ",".join(map(str, range(num_layers))), "--plot", str(out / "map.png")]):
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


def print_report(reports: list[PhaseReport], decode_urls: list[str]) -> str:
    lines = []
    w = 18
    lines.append("")
    lines.append("=" * 78)
    lines.append("Per decode server: label mix | mean distinct experts per decode step (all 4 layers)")
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
    for key in figs[0]:
        lines.append(key.ljust(26) + "".join(f"{f[key]:{w}.1f}" for f in figs))
    change, matched = matched_change(reports[0], reports[-1])
    lines.append("distinct experts per step by batch size (batch: " + reports[0].policy + " | "
                 + reports[-1].policy + "):")
    for b in sorted(set(reports[0].by_batch) | set(reports[-1].by_batch)):
        cells = [f"{np.mean(r.by_batch[b]):5.1f} ({len(r.by_batch[b])} steps)" if b in r.by_batch else "-"
                 for r in (reports[0], reports[-1])]
        lines.append(f"  {b:3d}: {cells[0]} | {cells[1]}")
    verdict = (f"at equal batch size, ELDR activated {abs(change):.1f}% {'fewer' if change < 0 else 'more'} "
               f"distinct experts per decode step than {reports[0].policy} ({matched} matched steps).")
    lines.append("")
    lines.append("Verdict: " + verdict)
    lines.append("Note: CPU latency here does not stand for GPU latency; distinct experts per decode step is the")
    lines.append("hardware-independent figure (a GPU decode step reads the weights of each distinct expert once).")
    lines.append("The fixture model has random weights: its routing follows token identity, not topic.")
    lines.append("=" * 78)
    text = "\n".join(lines)
    print(text)
    return text


def save_plot(reports: list[PhaseReport], decode_urls: list[str], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(WORKLOAD)
    fig, axes = plt.subplots(1, len(reports) + 1, figsize=(5 * (len(reports) + 1), 4))
    for ax, rep in zip(axes, reports):
        bottom = np.zeros(len(decode_urls))
        for label in labels:
            vals = np.array([rep.label_mix[u][label] for u in decode_urls], dtype=float)
            ax.bar([f"decode-{i}" for i in range(len(decode_urls))], vals, bottom=bottom, label=label)
            bottom += vals
        ax.set_title(f"{rep.policy}: requests per decode server")
    axes[0].legend(fontsize=7)
    ax = axes[-1]
    ax.bar([r.policy for r in reports], [r.unique_overall() for r in reports], color=["tab:gray", "tab:green"])
    ax.set_title("mean distinct experts per decode step\n(measured inside the decode servers)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="ELDR vs round robin on a real SGLang CPU PD cluster")
    p.add_argument("--model", type=Path, default=Path(".cache/models/tiny-qwen3-moe"))
    p.add_argument("--decodes", type=int, default=3, help="decode servers (each ~2.5 GB RAM)")
    p.add_argument("--repeat", type=int, default=1, help="times the workload is replayed per policy")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--out", type=Path, default=Path(".cache/demo"))
    args = p.parse_args(argv)
    if not (args.model / "config.json").is_file():
        p.error(f"--model: no Hugging Face model at {args.model} (run `make model`)")
    if args.decodes < 2:
        p.error("--decodes must be at least 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out
    trace_dir, decode_trace = out / "trace", out / "trace-decode"
    for d in (trace_dir, decode_trace):
        for f in d.glob("*.jsonl") if d.exists() else ():
            f.unlink()
    logs = out / "logs"
    router_port = lc.free_port()

    def progress(name: str, elapsed: float) -> None:
        if int(elapsed) % 10 == 0:
            print(f"  ... {name} starting ({elapsed:.0f}s)", flush=True)

    print(f"Starting 1 prefill + {args.decodes} decode SGLang CPU servers (one at a time, ~40-90 s each); "
          f"logs in {logs}", flush=True)
    cluster = router = None
    try:
        cluster = lc.start_pd_cluster(
            str(args.model), logs, n_prefill=1, n_decode=args.decodes, eldr_metrics=True, progress=progress,
            prefill_args=["--eldr-layers", "all", "--eldr-trace-dir", str(trace_dir),
                          "--eldr-publish", f"http://127.0.0.1:{router_port}/eldr/signature"],
            decode_args=["--eldr-trace-dir", str(decode_trace)])
        decode_urls = [p.url for p, _ in cluster.decodes]
        rows = workload(args.repeat)
        reports = []
        artifact = None
        for policy in ("round_robin", "eldr"):
            if policy == "eldr":
                print(f"Calibrating from the trace logs of round_robin's run (K={args.decodes}) ...", flush=True)
                artifact = calibrate([trace_dir, decode_trace], rows, "round_robin", args.decodes, args.model, out)
                lc.flush_cache(cluster.prefills[0][0].url)  # same cold start as phase 1
            router = lc.start_eldr_router(cluster, logs, policy=policy, port=router_port,
                                          artifact=artifact if policy == "eldr" else None)
            router.wait_ready(timeout=60)
            print(f"Replaying {len(rows)} requests ({len(WORKLOAD)} labels, concurrency {args.concurrency}) "
                  f"through the ELDR router, --policy {policy} ...", flush=True)
            reports.append(run_phase(cluster, router, policy, rows, args, decode_trace))
            router.stop()
            router = None
        text = print_report(reports, decode_urls)
        (out / "report.txt").write_text(text + "\n")
        png = save_plot(reports, decode_urls, out / "demo.png")
        print(f"Saved the comparison to {png} (and {out / 'report.txt'}, artifact {artifact}).")
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
