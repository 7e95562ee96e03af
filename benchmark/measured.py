"""The MEASURED part of RESULTS.md: figures from real traces, the trained model and
real SGLang CPU servers, each next to the command that produced it."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPECIALISATION = ROOT / "models" / "eldr-tiny-moe" / "specialisation.json"
PAPER_REDUCTION = {"task": "17-21 (same-task batches)", "language": "3-10 (same-language batches)"}


def analyze(traces: Path) -> dict:
    """``python -m eldr_sglang.analyze`` on one trace set (its JSON output)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "a.json"
        subprocess.run([sys.executable, "-m", "eldr_sglang.analyze", "--traces", str(traces), "--json", str(out)],
                       check=True, capture_output=True, text=True)
        return json.loads(out.read_text())


def trace_section(traces_root: Path, workloads: list[str]) -> list[str]:
    rows = []
    for wl in workloads:
        path = traces_root / wl / "eval"
        if not path.is_dir():
            continue
        a = analyze(path)
        key = "domain" if wl == "task" else "language"
        loc = a["locality"].get(key) or {}
        rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        rows.append(f"| {wl} | {a['n_requests']} | {a['pearson']['mean']:.3f} | {a['variants']['idf']['profile']:.3f} "
                    f"| {a['variants']['gate_prob']['profile']:.3f} | "
                    f"{100 * loc.get('reduction', float('nan')):.1f} ({', '.join(loc.get('labels', []))}) | "
                    f"`python -m eldr_sglang.analyze --traces {rel}` |")
    if not rows:
        return []
    return ["## MEASURED: expert traces of the trained tiny MoE\n",
            "Real SGLang CPU server in the plugin's trace mode (`python tools/trace_workloads.py`), evaluation "
            "sets. Paper: Pearson 0.70-0.92 over three models; IDF-weighted counts mean Spearman 0.76 against "
            "0.62 for gate probabilities; same-kind batches of a real model activate fewer distinct experts.\n",
            "| workload | requests | prefill/decode Pearson | Spearman, IDF counts | Spearman, gate probs "
            f"| same-label batches of 16: fewer distinct decode experts (%) (paper: task {PAPER_REDUCTION['task']}, "
            f"language {PAPER_REDUCTION['language']}) | command |",
            "|---|---|---|---|---|---|---|", *rows, ""]


def specialisation_section() -> list[str]:
    if not SPECIALISATION.is_file():
        return []
    s = json.loads(SPECIALISATION.read_text())
    rows = [f"| {k} | {s['trained'][f'accuracy_{k}']:.3f} | {s['untrained'][f'accuracy_{k}']:.3f} "
            f"| {s['chance'][k]:.3f} |" for k in ("language", "domain", "cell")]
    rows.append(f"| prefill/decode Pearson | {s['trained']['prefill_decode_pearson']:.3f} "
                f"| {s['untrained']['prefill_decode_pearson']:.3f} | |")
    return ["## MEASURED: does the trained model's routing specialise?\n",
            f"Nearest-centroid accuracy of held-out documents' expert-usage vectors (`{s['command']}`; "
            f"{s['trained']['eval_docs']} evaluation documents):\n",
            "| by | trained | untrained (same architecture) | chance |", "|---|---|---|---|", *rows, ""]


def real_cpu_section(results_dir: Path) -> list[str]:
    path = results_dir / "real_cpu.json"
    if not path.is_file():
        return []
    r = json.loads(path.read_text())
    rows = [f"| {run['router']} | {run['completed']} | {run['median_tpot_ms']:.1f} | {run['p99_tpot_ms']:.1f} "
            f"| {run['median_ttft_ms']:.0f} | {run['distinct_experts_per_step']:.1f} | {run['decode_steps']:.0f} |"
            for run in r["runs"]]
    return ["## MEASURED: real SGLang PD cluster on CPU, bench_serving through each router\n",
            f"`{r['command']}`: 1 prefill + {r['decodes']} decode real SGLang CPU servers, trained tiny MoE, "
            f"`sglang.bench_serving --dataset-name custom` on `{r['dataset']}` ({r['num_prompts']} prompts, "
            f"{r['output_len']} output tokens, {r['request_rate']} req/s). {r['measured']}. Distinct experts per "
            "decode step are summed over the 4 MoE layers, measured inside the decode servers; they also grow "
            "with batch size, which the policies change.\n",
            "| router/policy | completed | median TPOT ms | P99 TPOT ms | median TTFT ms "
            "| distinct experts per decode step | decode steps |", "|---|---|---|---|---|---|---|", *rows, ""]


def state_aware_section(results_dir: Path) -> list[str]:
    """The state-aware policy's verdict, from ``benchmark/bench_state_aware.py``'s report."""
    path = results_dir / "state_aware.md"
    if not path.is_file():
        return []
    text = path.read_text()
    verdict = text.split("## Verdict", 1)[1].split("\n## ", 1)[0].strip() if "## Verdict" in text else ""
    return ["", "## State-aware policy vs ELDR (SIMULATED)", "",
            "`python benchmark/bench_state_aware.py` (2 workloads x 8/16/24 decode servers x 20-100 req/s "
            "x 5 seeds x 6 policies; every table, the goodput and the decision rule: "
            "[results/state_aware.md](results/state_aware.md)).", "", verdict]


def online_section(results_dir: Path) -> list[str]:
    """The online-calibration scenarios, from ``benchmark/bench_online.py``'s report."""
    path = results_dir / "online.md"
    if not path.is_file():
        return []
    body = path.read_text().split("\n", 1)[1].strip()  # its own title replaced by this section's
    return ["", "## Online calibration: cold start, drift, scale-out, scale-in (SIMULATED)", "",
            "Details and per-seed figures: [results/online.md](results/online.md), "
            "[results/online.json](results/online.json).", "", body]


def render(traces_root: Path, workloads: list[str], results_dir: Path) -> str:
    lines = (trace_section(traces_root, workloads) + specialisation_section() + real_cpu_section(results_dir)
             + state_aware_section(results_dir) + online_section(results_dir))
    return ("\n".join(lines) + "\n") if lines else ""
