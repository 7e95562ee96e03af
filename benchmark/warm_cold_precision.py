"""Warm (prefix-cache hit) vs cold signatures on a real SGLang CPU server, per dtype.

    python -m benchmark.warm_cold_precision [--prompts 8] [--tokens 500] [--dtypes bfloat16 float32]

For each dtype one plain server of the trained tiny MoE (``--eldr-layers all``)
serves every prompt three times: ``flush_cache``; the first 60% of the prompt
(cached); the whole prompt asking for its signature (warm: the first 60% comes
from the KV-slot table, the rest is computed on top of the cached prefix);
``flush_cache``; the whole prompt again (cold). The bookkeeping is exact when the
two agree; where they do not, SGLang computed different top-k experts for the same
token (its arithmetic on top of a cached prefix is not the cold forward's). Prints
per dtype how many prompts agree exactly and the largest per-layer L1 difference
of the counts; writes ``benchmark/results/warm_cold_precision.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from benchmark.common import parse_with_quick, write_record
from eldr_sglang.testing import local_cluster as lc

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def long_prompts(n: int, tokens: int, tokenizer) -> list[list[int]]:
    """``n`` prompts of ``tokens`` token ids, from the workload texts joined in order."""
    texts = [json.loads(line)["prompt"] for line in (HERE / "workloads" / "demo.jsonl").read_text().splitlines()]
    ids = tokenizer("\n\n".join(texts))["input_ids"]
    if len(ids) < n * tokens:
        raise SystemExit(f"error: the workload holds {len(ids)} tokens, {n} x {tokens} needed")
    return [ids[i * tokens:(i + 1) * tokens] for i in range(n)]


def signature(url: str, ids: list[int]) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0,
                                                  "custom_params": {"eldr_signature": True}}}
    return lc.http_json(url + "/generate", body, timeout=300)["meta_info"]["eldr_signature"][0]


def measure(model: Path, dtype: str, prompts: list[list[int]], log_dir: Path) -> dict:
    spec = lc.ServerSpec(str(model), extra_args=["--eldr-layers", "all", "--dtype", dtype])
    server = lc.start_server_ready(spec, log_dir, f"precision-{dtype}")
    diffs = []
    try:
        for ids in prompts:
            lc.flush_cache(server.url)
            lc.http_json(server.url + "/generate", {"input_ids": ids[: int(0.6 * len(ids))],
                                                    "sampling_params": {"max_new_tokens": 1}}, timeout=300)
            warm = signature(server.url, ids)
            lc.flush_cache(server.url)
            cold = signature(server.url, ids)
            assert warm["cached_tokens"] > 0 and cold["cached_tokens"] == 0
            diffs.append(np.abs(np.array(warm["counts"]) - np.array(cold["counts"])).sum(axis=1).tolist())
    finally:
        server.stop()
    d = np.array(diffs)
    return {"dtype": dtype, "prompts": len(prompts), "exact": int((d == 0).all(axis=1).sum()),
            "max_layer_l1": int(d.max()), "mean_layer_l1": float(d.mean()), "per_prompt_layer_l1": diffs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmark.warm_cold_precision", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "eldr-tiny-moe"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--out", default=str(HERE / "results" / "warm_cold_precision.json"))
    args = parse_with_quick(ap, argv)
    if args.prompts < 1 or args.tokens < 10:
        ap.error("--prompts must be >= 1 and --tokens >= 10")
    if args.quick:  # real SGLang servers: the smoke run checks the arguments and the plan only
        print(f"plan: {len(args.dtypes)} server(s) of {args.model} ({', '.join(args.dtypes)}), "
              f"{args.prompts} prompts of {args.tokens} tokens, 3 requests each; would write {args.out}")
        return 0
    from transformers import AutoTokenizer

    prompts = long_prompts(args.prompts, args.tokens, AutoTokenizer.from_pretrained(args.model))
    log_dir = ROOT / ".cache" / "precision-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = [measure(Path(args.model), dtype, prompts, log_dir) for dtype in args.dtypes]
    for r in rows:
        print(f"{r['dtype']:>9}: {r['exact']}/{r['prompts']} prompts warm == cold exactly; largest per-layer "
              f"L1 difference {r['max_layer_l1']} counts (mean {r['mean_layer_l1']:.2f}) of "
              f"{args.tokens} tokens x top-k")
    write_record(args.out, {"tokens": args.tokens, "rows": rows}, argv, script=__file__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
