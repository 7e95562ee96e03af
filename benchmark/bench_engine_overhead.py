"""What the engine plugin adds to a prefill, measured two ways.

* micro (default): the capture work itself on this machine's CPU, for one
  prefill batch of T tokens: writing the top-k ids of the selected layers into
  the KV-slot table (once per layer) and counting them for the signature
  (once per request), against the MoE layer's own top-k selection
  (softmax + topk over the gate logits) as a yardstick;
* --servers: two real SGLang CPU servers side by side, one stock, one with
  ``--eldr-layers all --eldr-metrics-port``: median latency of the same
  prompts (max_new_tokens=1, alternated between the two), and the ratio.

    python benchmark/bench_engine_overhead.py [--servers]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from eldr_sglang.radix_signature import ExpertSlotTable


def timeit(fn, repeat: int = 50) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def micro(tokens: int, layers: int, n_sel: int, experts: int, top_k: int) -> None:
    table = ExpertSlotTable(65536, list(range(n_sel)), experts, top_k)
    slots = torch.randperm(65536)[:tokens]
    logits = torch.randn(tokens, experts)
    ids = logits.topk(top_k, dim=-1).indices
    write = timeit(lambda: [table.write(slots, l, ids) for l in range(n_sel)])
    count = timeit(lambda: table.counts(slots))
    gate = timeit(lambda: [torch.softmax(logits, -1).topk(top_k, -1) for _ in range(layers)])
    print(f"T={tokens:5d} tokens, {n_sel:2d} of {layers} layers, E={experts}, top-{top_k}: "
          f"table writes {write * 1e3:7.3f} ms, signature count {count * 1e3:6.3f} ms | "
          f"the gates' own softmax+topk over {layers} layers {gate * 1e3:7.3f} ms "
          f"-> capture = {100 * (write + count) / gate:5.1f}% of top-k selection alone")


def servers(model: str, prompts: int) -> None:
    """Both servers up at once, requests alternated, so drift hits both alike."""
    from eldr_sglang.testing import local_cluster as lc

    texts = [f"Request {i}: " + "the quick brown fox jumps over the lazy dog " * 12 for i in range(prompts)]
    variants = {"stock": [], "eldr": ["--eldr-layers", "all", "--eldr-metrics-port", str(lc.free_port())]}
    procs = {}
    try:
        for name, extra in variants.items():
            spec = lc.ServerSpec(model, extra_args=extra + ["--disable-radix-cache"])
            procs[name] = lc.start_server(spec, Path(".cache/bench-logs"), f"overhead-{name}")
            procs[name].wait_ready()
        lat = {name: [] for name in procs}
        for i, text in enumerate(texts):
            order = list(procs) if i % 2 else list(reversed(procs))
            for name in order:
                t0 = time.perf_counter()
                lc.http_json(procs[name].url + "/generate", {"text": text, "sampling_params": {"max_new_tokens": 1}})
                lat[name].append(time.perf_counter() - t0)
    finally:
        for proc in procs.values():
            proc.stop()
    med = {name: statistics.median(v[2:]) for name, v in lat.items()}
    print(f"real servers side by side, {prompts} prompts of ~120 tokens alternated, median prefill request "
          f"latency: stock {med['stock'] * 1e3:.1f} ms, with ELDR capture (all layers) {med['eldr'] * 1e3:.1f} ms "
          f"(ratio {med['eldr'] / med['stock']:.3f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", action="store_true", help="also measure real SGLang CPU servers")
    p.add_argument("--model", default=".cache/models/tiny-qwen3-moe")
    p.add_argument("--prompts", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(1)
    for tokens in (128, 2048, 8192):
        micro(tokens, 48, 4, 128, 8)  # Qwen3-30B-A3B shapes, 4 selected layers
    micro(2048, 48, 48, 128, 8)  # trace mode: every layer
    if args.servers:
        servers(args.model, args.prompts)


if __name__ == "__main__":
    main()
