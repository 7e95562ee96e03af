"""The MEASURED part of RESULTS.md: figures from real traces, the trained model and
real SGLang CPU servers, each next to the command that produced it."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPECIALISATION_MODELS = [ROOT / "models" / "eldr-tiny-moe", ROOT / "models" / "eldr-moe-12l"]
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
            "Real SGLang CPU server in the plugin's trace mode (`python -m tools.trace_workloads`), evaluation "
            "sets. Paper: Pearson 0.70-0.92 over three models; IDF-weighted counts mean Spearman 0.76 against "
            "0.62 for gate probabilities; same-kind batches of a real model activate fewer distinct experts.\n",
            "| workload | requests | prefill/decode Pearson | Spearman, IDF counts | Spearman, gate probs "
            f"| same-label batches of 16: fewer distinct decode experts (%) (paper: task {PAPER_REDUCTION['task']}, "
            f"language {PAPER_REDUCTION['language']}) | command |",
            "|---|---|---|---|---|---|---|", *rows, ""]


def specialisation_section(models: list[Path] | None = None) -> list[str]:
    """Routing specialisation of each trained model that has a ``specialisation.json``."""
    found = [(m, json.loads((m / "specialisation.json").read_text())) for m in (models or SPECIALISATION_MODELS)
             if (m / "specialisation.json").is_file()]
    if not found:
        return []
    lines = ["## MEASURED: does the trained model's routing specialise?\n",
             "Nearest-centroid accuracy of documents' expert-usage vectors (IDF-weighted counts over all layers): "
             "held out (centroids from the corpus' calib split, accuracy on its eval split; documents of one source "
             "never in both) and leave-one-out over both splits (each document against centroids computed without "
             "it), trained vs the same architecture with untrained weights:\n",
             "| model | layers | by | trained | untrained | chance |", "|---|---|---|---|---|---|"]
    width = max(len(s["trained"].get("per_layer", {}).get("language", [])) for _, s in found)
    for m, s in found:
        layers = len(s["trained"].get("per_layer", {}).get("language", [])) or "?"
        for k in ("language", "domain", "cell"):
            lines.append(f"| {m.name} | {layers} | {k} | {s['trained'][f'accuracy_{k}']:.3f} | "
                         f"{s['untrained'][f'accuracy_{k}']:.3f} | {s['chance'][k]:.3f} |")
        for k in ("language", "domain"):
            if f"loo_{k}" in s["trained"]:
                lines.append(f"| {m.name} | {layers} | {k}, leave-one-out | {s['trained'][f'loo_{k}']:.3f} | "
                             f"{s['untrained'][f'loo_{k}']:.3f} | {s['chance'][k]:.3f} |")
        lines.append(f"| {m.name} | {layers} | prefill/decode Pearson | {s['trained']['prefill_decode_pearson']:.3f} "
                     f"| {s['untrained']['prefill_decode_pearson']:.3f} | |")
    if width:
        lines += ["", "Per layer (that layer's signature alone, leave-one-out; trained / untrained):", "",
                  "| model | by | " + " | ".join(f"L{i}" for i in range(width)) + " |",
                  "|---|---|" + "---|" * width]
        for m, s in found:
            for k in ("language", "domain"):
                tr, un = s["trained"].get("per_layer", {}).get(k), s["untrained"].get("per_layer", {}).get(k)
                if tr and un:
                    lines.append(f"| {m.name} | {k} | " + " | ".join(f"{a:.2f} / {b:.2f}" for a, b in zip(tr, un))
                                 + " |" * (width - len(tr) + 1))
    lines += ["", "Commands: " + "; ".join(f"`{s['command']}`" for _, s in found), ""]
    return lines


def real_cpu_table(r: dict) -> list[str]:
    """The per-path table of ``benchmark/bench_real_cpu.py``'s JSON (median and min-max over rounds)."""
    base = r["equal_batch_base"]
    eb = r["equal_batch"].get("vs_" + base.replace("/", "_"), {})
    lines = ["| path | median TPOT ms | P99 TPOT ms | median TTFT ms | output tok/s | distinct experts per decode "
             f"step | same, at equal batch size: vs {base} (%) | mean batch | max/mean tokens per decode server |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, s in r["summary"].items():
        def cell(k, f=".0f", s=s):
            return f"{s[k]['median']:{f}} ({s[k]['min']:{f}}-{s[k]['max']:{f}})" if k in s else "n/a"
        lines.append(f"| {name} | {cell('median_tpot_ms')} | {cell('p99_tpot_ms')} | {cell('median_ttft_ms')} | "
                     f"{cell('output_throughput', '.1f')} | {cell('distinct_experts_per_step', '.1f')} | "
                     f"{eb.get(name, float('nan')):+.1f} | {cell('mean_batch', '.2f')} | "
                     f"{cell('token_max_over_mean', '.2f')} |")
    fit = r.get("step_time_fit")
    if fit:
        lines += ["", f"Decode forward time on this CPU (least squares over {fit['steps']} steps, R^2 "
                  f"{fit['r2']:.2f}): {fit['intercept_ms']:.1f} ms + {fit['ms_per_sequence']:.2f} ms per sequence "
                  f"in the batch + {fit['ms_per_distinct_expert']:.3f} ms per distinct expert (summed over layers); "
                  f"mean {fit['mean_forward_ms']:.1f} ms a step."]
    lines += online_law_lines(r)
    return lines


def online_law_lines(r: dict) -> list[str]:
    """The step laws the router fitted online per decode server (``--engine-metrics``),
    beside the offline fit: median (min-max) over runs of the per-expert term."""
    per: dict[str, list[dict]] = {}
    for run in r.get("runs", []):
        for url, law in (run.get("online_laws") or {}).items():
            per.setdefault(url, []).append(law)
    if not per:
        return []
    cells = []
    for url, laws in sorted(per.items()):
        pe = sorted(1e3 * law["per_expert_s"] for law in laws)
        r2 = sorted(law["r2"] for law in laws)
        cells.append(f"{url}: {pe[len(pe) // 2]:.3f} ms per distinct expert ({pe[0]:.3f}-{pe[-1]:.3f}), "
                     f"R^2 {r2[len(r2) // 2]:.2f}, over {len(laws)} runs")
    return ["", "Step law the router fitted online from each decode engine's samples (/eldr/batch): "
            + "; ".join(cells) + "."]


def pd_run_setup(r: dict, servers: str) -> str:
    """The setup sentence of a ``bench_real_cpu.py`` run: command, cluster, workload, rounds."""
    pins = f", decode servers pinned to cores {' and '.join(r['decode_cpus'])}" if r.get("decode_cpus") else ""
    threads = f", OMP_NUM_THREADS={r['threads']}" if r.get("threads") else ""
    return (f"`{r['command']}`: 1 prefill + {r['decodes']} decode real SGLang CPU servers, {servers}{pins}{threads}; "
            f"unmodified `sglang.bench_serving --dataset-name custom` on `{r['dataset']}` ({r['num_prompts']} "
            f"prompts, {r['output_len']} output tokens, {r['request_rate']} req/s), {r['repeats']} rounds with the "
            f"paths interleaved (median and min-max over rounds). {r['measured']}.")


def real_cpu_section(results_dir: Path) -> list[str]:
    path = results_dir / "real_cpu.json"
    if not path.is_file():
        return []
    r = json.loads(path.read_text())
    if "summary" not in r:  # an older single-run file
        return []
    return ["## MEASURED: real SGLang PD cluster on CPU, bench_serving through each router\n",
            pd_run_setup(r, "trained tiny MoE") + " Distinct experts per decode step "
            "are summed over the model's MoE layers, measured inside the decode servers; they grow with batch size, "
            "which the policies change, hence the equal-batch column.\n", *real_cpu_table(r), ""]


def state_aware_section(results_dir: Path) -> list[str]:
    """The state-aware policy's verdict, from ``benchmark/bench_state_aware.py``'s report."""
    path = results_dir / "state_aware.md"
    if not path.is_file():
        return []
    text = path.read_text()
    verdict = text.split("## Verdict", 1)[1].split("\n## ", 1)[0].strip() if "## Verdict" in text else ""
    return ["", "## State-aware policy vs ELDR (SIMULATED)", "",
            "`python -m benchmark.bench_state_aware` (2 workloads x 8/16/24 decode servers x 20-100 req/s "
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


def long_decodes_section(results_dir: Path) -> list[str]:
    """Recorded per-step sets vs the independence approximation, from ``bench_long_decodes.py``."""
    path = results_dir / "long_decodes.md"
    if not path.is_file():
        return []
    body = path.read_text().split("\n", 1)[1].strip()
    return ["", "## Long decodes: recorded per-step expert sets vs the independence approximation "
            "(MEASURED sets; section 2 SIMULATED)", "",
            "Details: [results/long_decodes.md](results/long_decodes.md), "
            "[results/long_decodes.json](results/long_decodes.json).", "", body.replace("\n## ", "\n### ")]


def fat_expert_section(results_dir: Path) -> list[str]:
    """Measured on a real server (``bench_fat_expert.py``) and the simulation driven by its law."""
    path = results_dir / "fat_expert.md"
    if not path.is_file():
        return []
    lines = ["", "## MEASURED: TPOT on a real SGLang server whose decode is bound by expert weights", "",
             "One real SGLang CPU server on the fat-expert model (the trained tiny MoE with every expert FFN "
             "zero-padded to 4096: same function, 3 MiB of weights per expert per layer; "
             "`tools/make_fat_expert_model.py`), batches of B concurrent requests all of one label (grouped) or of "
             "mixed labels, rounds interleaved. CPU memory bandwidth stands in for HBM; it is not a GPU. "
             "Testbed and caveats: [docs/MEASURED.md](../docs/MEASURED.md).", "", path.read_text().strip()]
    sim = results_dir / "fat_expert_sim.md"
    if sim.is_file():
        lines += ["", "### SIMULATED: the headline under the step-time law measured above", "",
                  "A simulated gain driven by a cost law measured on a real SGLang server.", "",
                  sim.read_text().split("\n", 1)[1].strip()]
    return lines


def fat_expert_pd_section(results_dir: Path) -> list[str]:
    """The end-to-end PD run on the fat-expert model (``bench_real_cpu.py`` JSON)."""
    path = results_dir / "fat_expert_pd.json"
    if not path.is_file():
        return []
    r = json.loads(path.read_text())
    return ["", "### MEASURED: end to end, PD cluster on the fat-expert model, bench_serving through the router", "",
            pd_run_setup(r, "fat-expert model"), "",
            *real_cpu_table(r), "", *forward_time_reading(r), *blind_default_caveat(r)]


def blind_default_caveat(r: dict) -> list[str]:
    """Records made before ``bench_real_cpu`` gave the default policy its artifact (it passed
    ``--calibration`` only to policies that need one): their ``eldr_balanced`` row routed by
    cost alone, with no region."""
    if "eldr_balanced" not in str(r.get("command", "")) or "artifact_policies" in r:
        return []
    return ["", "Caveat: in this record `eldr_balanced` ran WITHOUT the calibration artifact (the script passed "
            "`--calibration` only to policies that need one; fixed since, and the record lists "
            "`artifact_policies`): its row is the state-aware cost alone, with no region."]


def forward_time_reading(r: dict) -> list[str]:
    """Per path, the decode forward time the servers logged, and whether the step-time fit
    explains it (when it does not, TPOT differences are not locality's doing)."""
    per: dict[str, list[float]] = {}
    for run in r["runs"]:
        per.setdefault(run["router"], []).extend(ms for _, _, ms in run["steps"] if ms is not None)
    if not per:
        return []
    cells = "; ".join(f"{name} mean {sum(v) / len(v):.0f} ms, P99 {sorted(v)[int(0.99 * (len(v) - 1))]:.0f} ms"
                      for name, v in per.items() if v)
    lines = [f"Decode forward time per step, all rounds: {cells}."]
    fit = r.get("step_time_fit")
    if fit and fit["r2"] < 0.5:
        lines.append(f"The fit explains R^2 {fit['r2']:.2f} of the forward time: on this machine the step time is "
                     "set by contention between the servers sharing its cores, not by batch size and distinct "
                     "experts, so the TPOT differences above cannot be credited to expert locality; the "
                     "equal-batch distinct-expert column is the locality figure.")
    return lines


def render(traces_root: Path, workloads: list[str], results_dir: Path) -> str:
    lines = (trace_section(traces_root, workloads) + specialisation_section() + real_cpu_section(results_dir)
             + fat_expert_section(results_dir) + fat_expert_pd_section(results_dir)
             + long_decodes_section(results_dir) + state_aware_section(results_dir) + online_section(results_dir))
    return ("\n".join(lines) + "\n") if lines else ""
