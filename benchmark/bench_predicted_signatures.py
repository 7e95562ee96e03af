"""Predicted signatures: holdout accuracy, cost, and SIMULATED early vs late binding.

    .venv/bin/python -m benchmark.bench_predicted_signatures            # full (about 20 min of one core)
    .venv/bin/python -m benchmark.bench_predicted_signatures --quick    # smoke test (outputs under .cache/)

Data: traces recorded WITH their prompts' token ids (``tools/record_prompt_traces.py``;
the committed SGLang traces hold no prompts and a rebuilt corpus does not reproduce
them)::

    python -m tools.build_corpus --out .cache/corpus
    python -m tools.build_workloads --corpus .cache/corpus --tokenizer models/eldr-tiny-moe --out .cache/workloads
    python -m tools.record_prompt_traces --model models/eldr-tiny-moe --workloads .cache/workloads \\
        --limit 1000 --out .cache/prompt-traces

1. Accuracy, per model and workload, on the evaluation split (never used to fit): the
   artifact is calibrated on the calibration split (K = 16), the predictor fitted on
   the calibration split's prompts (ridge strength chosen on a 25% holdout OF THE
   CALIBRATION SPLIT), then for evaluation requests: Pearson correlation of predicted
   vs true pairwise signature similarity (sampled pairs), agreement of predicted vs
   true region (nearest centroid; also within the predicted best two), mean cosine of
   predicted and true signature, and the share and agreement of "confident"
   requests (margin between the best two predicted regions), which ``auto`` binding
   would bind early.
2. Cost per request: tokenise (the model's tokenizer) + predict + decide (eldr, 16
   servers), p50/p99 over the evaluation prompts.
3. SIMULATED (``eldr_sglang/sim``; 8 prefill / 16 decode servers, Qwen3-30B-A3B on
   MI300X cost model, lengths rescaled to 600 / 300 tokens as ``report.py``):
   round_robin and jsq (chosen at arrival), each ELDR policy late with its true
   prefill signature (signature wait ``--late-wait``), early with its PREDICTED
   signature, early with its true signature (reference: prediction error vs timing),
   and the oracle grouping (late, decode signatures). Seed ``s`` = simulator seed and
   calibration seed. Reports per workload, rate and run: distinct experts per step,
   median/P99 TPOT and TTFT, prompt tokens held on prefill servers, and the share of
   late binding's TPOT gain over the best balancer that early binding keeps.

Outputs: ``benchmark/results/predicted_signatures.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from benchmark.common import command_line, markdown_table, mean_sd, write_record
from eldr_sglang.sim import experiments
from eldr_sglang.core.artifact import load_artifact
from eldr_sglang.core.policies import Policy, PolicyContext, RouteRequest, build_policy
from eldr_sglang.core.predictor import SignaturePredictor, table_bytes
from eldr_sglang.core.traces import TraceSet, load_traces
from eldr_sglang.prompts import join_prompt_ids, read_prompt_ids
from eldr_sglang.sim.calibration import calibrate_artifact
from eldr_sglang.sim.simulator import SimConfig, simulate

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

K = 16
TAU = 0.1
ALPHAS = (0.01, 0.03, 0.1, 0.3, 1.0)
MARGINS = (0.01, 0.02, 0.05)
VOCAB = 150_000
BALANCERS = ("round_robin", "jsq")
FULL = dict(rates=(40.0, 70.0, 100.0), seeds=5, warmup_s=15.0, measure_s=40.0, pairs=20_000)
QUICK = dict(rates=(40.0, 100.0), seeds=2, warmup_s=3.0, measure_s=8.0, pairs=2_000)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmark.bench_predicted_signatures",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 seeds, 2 rates, 3 s + 8 s windows; outputs under .cache/")
    ap.add_argument("--traces-root", type=Path, default=ROOT / ".cache" / "prompt-traces",
                    help="<root>/<workload>/{calib,eval} with prompts.jsonl (tools/record_prompt_traces.py)")
    ap.add_argument("--extra-models", nargs="*", type=Path, default=[],
                    help="more trace roots (other models), accuracy only")
    ap.add_argument("--workloads-dir", type=Path, default=ROOT / ".cache" / "workloads",
                    help="the workloads' prompt text (for the tokenisation cost); skipped when absent")
    ap.add_argument("--tokenizer", type=Path, default=ROOT / "models" / "eldr-tiny-moe")
    ap.add_argument("--workloads", default="task,language")
    ap.add_argument("--policies", default=None,
                    help="ELDR policies simulated early and late (default: eldr, plus RouterConfig's default policy "
                         "if it differs)")
    ap.add_argument("--rates", default=None)
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--late-wait", type=float, default=0.02, help="late binding's signature wait (s)")
    ap.add_argument("--no-sim", action="store_true", help="accuracy and cost only")
    ap.add_argument("--render-only", action="store_true", help="recompute the summary and markdown from the JSON")
    ap.add_argument("--out-dir", type=Path, default=None)
    return ap


def default_policies() -> list[str]:
    from eldr_sglang.router.config import RouterConfig

    default = next(f.default for f in dataclasses.fields(RouterConfig) if f.name == "policy")
    return ["eldr"] + ([default] if default != "eldr" else [])


# -- data ---------------------------------------------------------------------------------------------------
def split_with_ids(root: Path, workload: str, split: str) -> tuple[TraceSet, list[list[int]]]:
    d = root / workload / split
    if not (d / "prompts.jsonl").is_file():
        raise SystemExit(f"{d}/prompts.jsonl not found: record it with tools/record_prompt_traces.py "
                         "(see this script's docstring)")
    traces = load_traces(d)
    rows, ids = join_prompt_ids(list(traces.request_ids), read_prompt_ids([d / "prompts.jsonl"]))
    if len(rows) != len(traces):
        traces = traces.subset(np.asarray(rows))
    return traces, ids


def choose_alpha(ids: list[list[int]], counts: np.ndarray, art, seed: int = 0) -> tuple[float, dict]:
    """Ridge strength with the best region agreement on a 25% holdout of the calibration split."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(ids))
    cut = int(0.75 * len(ids))
    fit, held = order[:cut], order[cut:]
    true = np.argmax(art.similarities(art.signature(counts[held])), axis=1)
    scores = {}
    for a in ALPHAS:
        p = SignaturePredictor("ridge", a).fit([ids[i] for i in fit], counts[fit])
        pred = np.argmax(art.similarities(art.signature(p.predict_many([ids[i] for i in held]))), axis=1)
        scores[a] = float(np.mean(pred == true))
    return max(scores, key=lambda a: (scores[a], -a)), scores


# -- 1. accuracy --------------------------------------------------------------------------------------------
def accuracy(root: Path, workload: str, work: Path, pairs: int, seed: int = 0) -> dict:
    calib, cids = split_with_ids(root, workload, "calib")
    ev, eids = split_with_ids(root, workload, "eval")
    out = work / "artifacts" / f"{root.name}-{workload}-K{K}-seed{seed}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    art = calibrate_artifact(root / workload / "calib", K, out, seed=seed, pairs=pairs, n_init=1,
                             log=out.with_suffix(".log"))
    layers = art.layers
    ccounts, ecounts = calib.prefill_counts[:, layers], ev.prefill_counts[:, layers]
    alpha, alpha_scores = choose_alpha(cids, ccounts, art, seed)
    t0 = time.perf_counter()
    pred = SignaturePredictor("ridge", alpha).fit(cids, ccounts)
    fit_s = time.perf_counter() - t0
    true_sig = art.signature(ecounts)
    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, len(ev), 20_000), rng.integers(0, len(ev), 20_000)
    keep = a != b
    a, b = a[keep], b[keep]
    true_sim = np.einsum("nd,nd->n", true_sig[a], true_sig[b])
    true_reg = np.argmax(art.similarities(true_sig), axis=1)

    def score(p: SignaturePredictor) -> dict:
        sig = art.signature(p.predict_many(eids))
        sims = art.similarities(sig)
        order = np.argsort(-sims, axis=1)
        reg = order[:, 0]
        margin = sims[np.arange(len(sims)), order[:, 0]] - sims[np.arange(len(sims)), order[:, 1]]
        psim = np.einsum("nd,nd->n", sig[a], sig[b])
        conf = {}
        for m in MARGINS:
            sel = margin >= m
            conf[str(m)] = {"share": float(sel.mean()),
                            "agreement": float(np.mean(reg[sel] == true_reg[sel])) if sel.any() else None}
        return {"pearson_pair_similarity": float(np.corrcoef(true_sim, psim)[0, 1]),
                "region_agreement": float(np.mean(reg == true_reg)),
                "region_in_predicted_top2": float(np.mean((order[:, :2] == true_reg[:, None]).any(axis=1))),
                "mean_cosine_pred_true": float(np.mean(np.einsum("nd,nd->n", sig, true_sig))),
                "confident": conf}

    ridge = score(pred)
    mean = score(SignaturePredictor("mean", 1.0).fit(cids, ccounts))
    coverage = float(np.mean([pred.coverage(t) for t in eids]))
    n_sel, E = len(layers), art.model.num_experts
    return {"model": art.model.name, "workload": workload, "layers": layers, "K": K,
            "calib_requests": len(calib), "eval_requests": len(ev), "alpha": alpha,
            "alpha_calib_holdout_agreement": {str(k): v for k, v in alpha_scores.items()},
            "ridge": ridge, "mean_baseline": mean, "chance_region_agreement": float(
                np.sum((np.bincount(true_reg, minlength=K) / len(true_reg)) ** 2)),
            "eval_token_coverage": coverage, "tokens_seen": int(len(pred.tokens_)), "table_bytes": pred.nbytes,
            "bytes_150k_vocab": {d: table_bytes(VOCAB, n_sel, E, d) for d in ("int8", "float16", "float32")},
            "fit_s": fit_s}


# -- 2. cost ------------------------------------------------------------------------------------------------
def cost(root: Path, workload: str, work: Path, workloads_dir: Path, tokenizer: Path, alpha: float) -> Optional[dict]:
    path = workloads_dir / workload / "eval.jsonl"
    art_path = work / "artifacts" / f"{root.name}-{workload}-K{K}-seed0.json"
    if not path.is_file() or not art_path.is_file():
        return None
    from eldr_sglang.prompts import load_tokenizer

    tok = load_tokenizer(tokenizer)
    art = load_artifact(art_path)
    calib, cids = split_with_ids(root, workload, "calib")
    pred = SignaturePredictor("ridge", alpha).fit(cids, calib.prefill_counts[:, art.layers])
    policy = build_policy("eldr", PolicyContext(K, seed=0, tau=TAU, centroids=art.centroids))
    loads = [3] * K
    with open(path, encoding="utf-8") as f:
        texts = [json.loads(line)["prompt"] for _, line in zip(range(1000), f)]
    parts = {"tokenise": [], "predict": [], "decide": [], "total": []}
    for text in texts:
        t0 = time.perf_counter()
        ids = tok.encode(text)
        t1 = time.perf_counter()
        counts = pred.predict(ids)
        sig = art.signature(counts)
        act = counts.reshape(-1) / np.float32(max(len(ids), 1))
        t2 = time.perf_counter()
        policy.choose(RouteRequest(signature=sig, activation=act), loads)
        t3 = time.perf_counter()
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
            parts[k].append(v)
    return {k: {"p50_us": 1e6 * float(np.percentile(v, 50)), "p99_us": 1e6 * float(np.percentile(v, 99))}
            for k, v in parts.items()} | {"requests": len(texts), "workload": workload}


# -- 3. simulation ------------------------------------------------------------------------------------------
class AtArrival(Policy):
    """Early binding with a signature known at arrival: the simulator passes each request's
    workload row as its label (see ``row_labels``); this looks the row's signature up."""

    def __init__(self, inner: Policy, signatures: np.ndarray, activations: Optional[np.ndarray],
                 labels: np.ndarray) -> None:
        self.inner, self.name = inner, inner.name
        self.sigs, self.acts, self.labels = signatures, activations, labels

    def _req(self, req: RouteRequest) -> RouteRequest:
        r = int(req.label)
        return RouteRequest(signature=self.sigs[r], label=str(self.labels[r]),
                            activation=None if self.acts is None else self.acts[r])

    def choose(self, request: RouteRequest, loads: Sequence[int], allowed=None) -> int:
        return self.inner.choose(self._req(request), loads, allowed)

    def admit(self, index: int, request: RouteRequest) -> Any:
        return self.inner.admit(index, self._req(request))

    def release(self, token: Any) -> None:
        self.inner.release(token)


def activations_of(counts: np.ndarray, prompt_tokens: np.ndarray) -> np.ndarray:
    """[N, n_sel * E] counts / prompt tokens, as the router builds RouteRequest.activation."""
    c = counts.astype(np.float64)
    tokens = np.maximum(prompt_tokens.astype(np.float64), c.max(axis=(1, 2)))
    return (c / np.maximum(tokens, 1.0)[:, None, None]).reshape(len(c), -1).astype(np.float32)


def simulate_workload(root: Path, workload: str, work: Path, grid: dict, policies: list[str], alpha: float,
                      late_wait: float, sweep: experiments.SweepConfig) -> list[dict]:
    data = experiments.load_workload(workload, root, work, sweep, 600.0, 300.0)
    _, cids = split_with_ids(root, workload, "calib")
    ev, eids = split_with_ids(root, workload, "eval")
    if len(ev) != len(data.evaluation) or list(ev.request_ids) != list(data.evaluation.request_ids):
        raise SystemExit(f"{workload}: evaluation rows without prompts; re-record the traces")
    rowwise = replace(data.sim, labels=np.array([str(i) for i in range(len(data.sim))]))
    rows = []
    for seed in range(grid["seeds"]):
        routing = experiments.prepare_routing(data, K, work / f"seed{seed}", sweep, seed=seed)
        art = load_artifact(work / f"seed{seed}" / "artifacts" / f"{workload}-K{K}-seed{seed}.json")
        pred = SignaturePredictor("ridge", alpha).fit(cids, data.calib.prefill_counts[:, art.layers])
        pcounts = pred.predict_many(eids)
        psig = art.signature(pcounts)
        pact = activations_of(pcounts, ev.prompt_tokens)
        tact = activations_of(ev.prefill_counts[:, art.layers], ev.prompt_tokens)
        for rate in grid["rates"]:
            base = SimConfig(num_prefill=8, num_decode=K, rate=rate, warmup_s=grid["warmup_s"],
                             measure_s=grid["measure_s"], seed=seed)
            ctx = PolicyContext(K, seed=seed, tau=TAU, centroids=routing.eldr_centroids, artifact_tau=TAU)
            runs: list[tuple[str, str, Policy, SimConfig, Any, Any, Any]] = []
            for b in BALANCERS:
                runs.append((b, "early", build_policy(b, ctx), replace(base, binding="early"), data.sim, None, None))
            octx = replace(ctx, centroids=routing.oracle_centroids)
            runs.append(("oracle", "late", build_policy("eldr", octx), replace(base, signature_wait_s=late_wait),
                         data.sim, routing.oracle_signatures, None))
            for p in policies:
                runs.append((p, "late", build_policy(p, ctx), replace(base, signature_wait_s=late_wait), data.sim,
                             routing.eldr_signatures, tact))
                runs.append((p, "early_predicted", AtArrival(build_policy(p, ctx), psig, pact, data.sim.labels),
                             replace(base, binding="early"), rowwise, None, None))
                runs.append((p, "early_true", AtArrival(build_policy(p, ctx), routing.eldr_signatures, tact,
                                                        data.sim.labels),
                             replace(base, binding="early"), rowwise, None, None))
            for name, binding, pol, cfg, wl, sigs, acts in runs:
                t0 = time.perf_counter()
                res = simulate(wl, pol, cfg, sigs, activations=acts)
                s = res.summary
                rows.append({"workload": workload, "seed": seed, "rate": rate, "policy": name, "binding": binding,
                             "run": f"{name}/{binding}", "wall_s": time.perf_counter() - t0,
                             **{m: s[m] for m in METRICS}, "conserved": s["conserved"]})
        print(f"  {workload} seed {seed}: {len(rows)} runs", flush=True)
    return rows


MIN_GAIN_MS = 0.1  # a P99 "gain" smaller than this is noise: no share of it is reported
METRICS = ("tpot_median_ms", "tpot_p99_ms", "ttft_median_ms", "ttft_p99_ms", "unique_experts_per_step",
           "prefill_kv_held_tokens", "load_cv")


def summarise(rows: list[dict], policies: list[str]) -> dict:
    """Per (workload, rate): each run's mean/sd over seeds, and the kept share of late's gain."""
    out: dict = {}
    for wl in sorted({r["workload"] for r in rows}):
        for rate in sorted({r["rate"] for r in rows if r["workload"] == wl}):
            sel = [r for r in rows if r["workload"] == wl and r["rate"] == rate]
            runs = {}
            for run in dict.fromkeys(r["run"] for r in sel):
                v = [r for r in sel if r["run"] == run]
                runs[run] = {m: list(mean_sd(x[m] for x in v)) for m in METRICS} | {"n": len(v)}
            best = min(BALANCERS, key=lambda b: runs[f"{b}/early"]["tpot_median_ms"][0])
            point = {"runs": runs, "best_balancer": best, "policies": {}}
            for p in policies:
                per_seed = {}
                for m in ("tpot_median_ms", "tpot_p99_ms"):
                    shares = []
                    for seed in sorted({r["seed"] for r in sel}):
                        g = {r["run"]: r[m] for r in sel if r["seed"] == seed}
                        gain = g[f"{best}/early"] - g[f"{p}/late"]
                        shares.append((g[f"{best}/early"] - g[f"{p}/early_predicted"]) / gain if gain > 0 else None)
                    ok = [s for s in shares if s is not None]
                    per_seed[m] = {"per_seed": shares, "mean": float(np.mean(ok)) if ok else None,
                                   "sd": float(np.std(ok, ddof=1)) if len(ok) > 1 else None}
                bal, late, early = runs[f"{best}/early"], runs[f"{p}/late"], runs[f"{p}/early_predicted"]
                gain_med = bal["tpot_median_ms"][0] - late["tpot_median_ms"][0]
                gain_p99 = bal["tpot_p99_ms"][0] - late["tpot_p99_ms"][0]
                point["policies"][p] = {
                    "kept_share_of_mean_gain_median_tpot": (bal["tpot_median_ms"][0] - early["tpot_median_ms"][0])
                    / gain_med if gain_med > 0 else None,
                    # None where late binding has no P99 gain to keep (<= MIN_GAIN_MS over the best balancer)
                    "kept_share_of_mean_gain_p99_tpot": (bal["tpot_p99_ms"][0] - early["tpot_p99_ms"][0])
                    / gain_p99 if gain_p99 > MIN_GAIN_MS else None,
                    "late_gain_ms": {"median": gain_med, "p99": gain_p99},
                    "kept_share_per_seed": per_seed,
                    "ttft_saved_median_ms": late["ttft_median_ms"][0] - early["ttft_median_ms"][0],
                    "ttft_saved_p99_ms": late["ttft_p99_ms"][0] - early["ttft_p99_ms"][0],
                    "kv_held_saved_tokens": late["prefill_kv_held_tokens"][0] - early["prefill_kv_held_tokens"][0]}
            out[f"{wl}@{rate:g}"] = point
    return out


# -- report -------------------------------------------------------------------------------------------------
def render(doc: dict) -> str:
    L = ["# Predicted signatures: accuracy, cost and early binding", "",
         f"Command: `{doc['command']}`", "",
         "Traces recorded with their prompts' token ids (`tools/record_prompt_traces.py`: teacher-forced "
         "transformers pass over prompt + the document's continuation; see the script). Accuracy is measured "
         "on evaluation requests never used to fit the predictor or the artifact.", "",
         "## Holdout accuracy (measured, not simulated)", ""]
    rows = []
    for a in doc["accuracy"]:
        r, c = a["ridge"], a["ridge"]["confident"]["0.02"]
        rows.append([a["model"], a["workload"], a["layers"], f"{a['alpha']:g}", f"{r['pearson_pair_similarity']:.3f}",
                     f"{r['region_agreement']:.3f}", f"{r['region_in_predicted_top2']:.3f}",
                     f"{r['mean_cosine_pred_true']:.3f}", f"{a['chance_region_agreement']:.3f}",
                     f"{a['mean_baseline']['region_agreement']:.3f}", f"{a['eval_token_coverage']:.3f}",
                     f"{c['share']:.2f} / {'n/a' if c['agreement'] is None else format(c['agreement'], '.3f')}"])
    L.append(markdown_table(["model", "workload", "layers", "alpha", "Pearson pair similarity",
                             "region agreement (K=16)", "true region in predicted top 2", "cos(pred, true)", "chance",
                             "mean-estimator region agreement", "token coverage",
                             "confident share / agreement (margin 0.02)"], rows))
    L += ["", "Memory of the per-token table (int8 deviations + one float32 scale per token + int32 ids):", ""]
    L.append(markdown_table(
        ["model", "workload", "tokens seen", "bytes now", "bytes, 150k vocabulary int8", "float16"],
        [[a["model"], a["workload"], a["tokens_seen"], f"{a['table_bytes'] / 2**20:.2f} MiB",
          f"{a['bytes_150k_vocab']['int8'] / 2**20:.1f} MiB", f"{a['bytes_150k_vocab']['float16'] / 2**20:.1f} MiB"]
         for a in doc["accuracy"]]))
    if doc.get("cost"):
        L += ["", "## Cost per request (measured on this machine's CPU)", ""]
        rows = []
        for c in doc["cost"]:
            f = lambda k: f"{c[k]['p50_us']:.0f} / {c[k]['p99_us']:.0f}"  # noqa: E731
            rows.append([c["workload"], f("tokenise"), f("predict"), f("decide"), f("total")])
        L.append(markdown_table(["workload", "tokenise p50/p99 us", "predict + signature p50/p99 us",
                                 "decide (eldr, 16) p50/p99 us", "total p50/p99 us"], rows))
    if doc.get("simulation"):
        g = doc["grid"]
        L += ["", f"## Early vs late binding (SIMULATED; {g['seeds']} seeds, mean ± sd; 8 prefill / 16 decode; "
              f"late signature wait {doc['late_wait_s'] * 1e3:g} ms)", ""]
        rows = []
        for key, point in doc["simulation"].items():
            wl, rate = key.split("@")
            for run, s in point["runs"].items():
                f = lambda m, d=2: f"{s[m][0]:.{d}f} ± {s[m][1]:.{d}f}"  # noqa: E731
                rows.append([wl, rate, run, f("unique_experts_per_step", 1), f("tpot_median_ms"), f("tpot_p99_ms"),
                             f("ttft_median_ms", 1), f("ttft_p99_ms", 1), f("prefill_kv_held_tokens", 0)])
        L.append(markdown_table(["workload", "req/s", "run", "distinct experts/step", "TPOT p50 ms", "TPOT p99 ms",
                                 "TTFT p50 ms", "TTFT p99 ms", "prompt tokens held on prefill"], rows))
        L += ["", "Share of late binding's median-TPOT gain over the best balancer that early binding with "
              "predicted signatures keeps (SIMULATED; of the seed means, and mean ± sd of per-seed shares), and "
              "what early binding saves:", ""]
        rows = []
        for key, point in doc["simulation"].items():
            wl, rate = key.split("@")
            for p, s in point["policies"].items():
                k = s["kept_share_of_mean_gain_median_tpot"]
                ps, k99, g = s["kept_share_per_seed"]["tpot_median_ms"], s["kept_share_of_mean_gain_p99_tpot"], \
                    s["late_gain_ms"]
                fmt = lambda d: "n/a" if d["mean"] is None else (  # noqa: E731
                    f"{100 * d['mean']:.0f}%" + ("" if d["sd"] is None else f" ± {100 * d['sd']:.0f}%"))
                pct = lambda v, why="n/a": why if v is None else format(100 * v, ".0f") + "%"  # noqa: E731
                rows.append([wl, rate, p, point["best_balancer"], f"{g['median']:.2f}", pct(k), fmt(ps),
                             f"{g['p99']:.2f}", pct(k99, "n/a (no late P99 gain)"), f"{s['ttft_saved_median_ms']:.1f}",
                             f"{s['ttft_saved_p99_ms']:.1f}", f"{s['kv_held_saved_tokens']:.0f}"])
        L.append(markdown_table(["workload", "req/s", "policy", "best balancer", "late's median gain ms",
                                 "kept (seed means)", "kept per seed", "late's P99 gain ms", "kept, P99 (seed means)",
                                 "TTFT p50 saved ms", "TTFT p99 saved ms", "prompt tokens held saved"], rows))
    return "\n".join(L) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    grid = dict(QUICK if a.quick else FULL)
    if a.rates:
        grid["rates"] = tuple(float(x) for x in a.rates.split(","))
    if a.seeds:
        grid["seeds"] = a.seeds
    workloads = [w.strip() for w in a.workloads.split(",") if w.strip()]
    policies = [p.strip() for p in a.policies.split(",")] if a.policies else default_policies()
    work = ROOT / ".cache" / "bench_predicted_signatures"
    out_dir = a.out_dir or (work / "quick" if a.quick else HERE / "results")
    if a.render_only:
        path = out_dir / "predicted_signatures.json"
        doc = json.loads(path.read_text())
        if doc.get("runs"):
            doc["simulation"] = summarise(doc["runs"], doc["policies"])
        write_record(path, doc)
        (out_dir / "predicted_signatures.md").write_text(render(doc))
        print(render(doc))
        return 0
    sweep = experiments.QUICK if a.quick else experiments.FULL
    sweep = replace(sweep, calib_pairs=grid["pairs"])
    t0 = time.time()
    doc: dict = {"simulated_sections": ["simulation"], "command": command_line(__file__, argv),
                 "grid": {**grid, "K": K, "tau": TAU},
                 "policies": policies, "late_wait_s": a.late_wait, "accuracy": [], "cost": []}
    for root in [a.traces_root, *a.extra_models]:
        for wl in workloads:
            acc = accuracy(root, wl, work, grid["pairs"])
            doc["accuracy"].append(acc)
            r = acc["ridge"]
            print(f"[measured] {acc['model']} {wl}: pearson {r['pearson_pair_similarity']:.3f}, region agreement "
                  f"{r['region_agreement']:.3f} (top-2 {r['region_in_predicted_top2']:.3f}, chance "
                  f"{acc['chance_region_agreement']:.3f}), alpha {acc['alpha']:g}, "
                  f"{acc['table_bytes'] / 2**20:.2f} MiB; 150k vocab int8 {acc['bytes_150k_vocab']['int8'] / 2**20:.1f} MiB",
                  flush=True)
    for wl in workloads:
        alpha = next(x["alpha"] for x in doc["accuracy"] if x["workload"] == wl)
        c = cost(a.traces_root, wl, work, a.workloads_dir, a.tokenizer, alpha)
        if c:
            doc["cost"].append(c)
            print(f"[measured] cost {wl}: total p50 {c['total']['p50_us']:.0f} us, p99 {c['total']['p99_us']:.0f} us "
                  f"(tokenise p50 {c['tokenise']['p50_us']:.0f} us)", flush=True)
    if not a.no_sim:
        rows = []
        for wl in workloads:
            alpha = next(x["alpha"] for x in doc["accuracy"] if x["workload"] == wl)
            rows += simulate_workload(a.traces_root, wl, work, grid, policies, alpha, a.late_wait, sweep)
        doc["runs"] = rows
        doc["simulation"] = summarise(rows, policies)
        for key, point in doc["simulation"].items():
            for p, s in point["policies"].items():
                k = s["kept_share_of_mean_gain_median_tpot"]
                print(f"[SIMULATED] {key} {p}: early-predicted keeps "
                      f"{'n/a' if k is None else format(100 * k, '.0f') + '%'} of late's median-TPOT gain over "
                      f"{point['best_balancer']}; TTFT p50 -{s['ttft_saved_median_ms']:.1f} ms", flush=True)
    doc["wall_s"] = round(time.time() - t0, 1)
    write_record(out_dir / "predicted_signatures.json", doc)
    (out_dir / "predicted_signatures.md").write_text(render(doc))
    print(f"written {out_dir / 'predicted_signatures.json'} and .md in {doc['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
