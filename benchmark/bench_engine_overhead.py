"""What the engine plugin adds, measured three ways, and what it holds in memory.

* forward (default): the plugin's whole per-forward path as SGLang runs it,
  eager on this machine's CPU (the staging write in every MoE layer's
  ``select_experts`` hook, then the after-forward scatter to KV slots and the
  decode statistics), against the same forward with the plugin off; the
  forward stand-in is each MoE layer's own top-k selection (softmax + topk over
  the gate logits), at Qwen3-30B-A3B shapes;
* micro: the table write and the signature count alone, for one prefill batch;
* --servers: two real SGLang CPU servers side by side, one stock, one with
  ``--eldr-layers all --eldr-metrics-port``: median latency of the same
  prompts (max_new_tokens=1, alternated between the two), and the ratio;
* --memory: the KV-slot table and the staging buffer per GPU for the shipped
  deploy presets (eldr_sglang/deploy/presets), with the assumptions printed.

    python -m benchmark.bench_engine_overhead [--servers] [--memory]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmark.common import parse_with_quick, seconds_per_call
from eldr_sglang.radix_signature import ExpertSlotTable


def timeit(fn, repeat: int = 50) -> float:
    """Seconds per call after one warm-up call."""
    fn()
    return seconds_per_call(fn, repeat)


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


def forward_overhead(phase: str, rows: int, layers: int = 48, experts: int = 128, top_k: int = 8,
                     repeat: int = 30) -> None:
    """Per-forward host time with the plugin's hooks vs without (both eager)."""
    from types import SimpleNamespace

    from eldr_sglang.patches import capture, state as engine
    from eldr_sglang.patches.flags import EngineConfig

    config = EngineConfig(layers=(9, 19, 28, 38)) if phase == "extend" else EngineConfig(metrics_port=1)
    hf = SimpleNamespace(num_hidden_layers=layers, num_experts=experts, num_experts_per_tok=top_k)
    runner = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf, model_path="qwen3-30b-a3b"), device="cpu",
                             token_to_kv_pool=SimpleNamespace(size=200_000, page_size=1),
                             req_to_token_pool=SimpleNamespace(size=256), is_draft_worker=False,
                             server_args=SimpleNamespace(chunked_prefill_size=8192, enable_two_batch_overlap=False),
                             max_running_requests=256)
    state = engine.CaptureState(config)
    engine.initialise(state, runner)
    logits = torch.randn(rows, experts)
    mode = SimpleNamespace(is_extend=lambda: phase == "extend", is_decode=lambda: phase == "decode")
    fb = SimpleNamespace(forward_mode=mode, out_cache_loc=torch.randperm(200_000)[:rows], batch_size=rows,
                         req_pool_indices=torch.arange(rows), global_num_tokens_cpu=None)
    cfg = SimpleNamespace(allow_routed_experts_capture=True)

    ids = [torch.softmax(logits, -1).topk(top_k, -1).indices.to(torch.int32) for _ in range(layers)]

    def gates():  # the plugin off: each MoE layer's own top-k selection
        for _ in range(layers):
            torch.softmax(logits, -1).topk(top_k, -1)

    def hooks():  # what the plugin adds to the same forward: its hooks on precomputed ids
        def model(r, b):
            for layer in range(layers):
                capture.select_experts_after(SimpleNamespace(topk_ids=ids[layer]), layer_id=layer, topk_config=cfg)
            return SimpleNamespace(can_run_graph=False)

        capture.forward_around(model, runner, fb)

    engine.STATE = state
    try:
        t_gates, t_hooks = timeit(gates, repeat), timeit(hooks, repeat * 3)
    finally:
        engine.STATE = None
    assert not state.failed, state.failed
    print(f"{phase:6s} {rows:5d} rows, {layers} layers, E={experts}, top-{top_k} ({len(state.stage.layers):2d} layers "
          f"staged): capture +{t_hooks * 1e6:7.1f} us per forward (hooks, staging, scatter"
          f"{', decode statistics' if phase == 'decode' else ''}) vs the {layers} gates' top-k alone "
          f"{t_gates * 1e3:7.3f} ms = {100 * t_hooks / t_gates:5.1f}%")


MODELS = {  # layers, experts, top-k, KV heads x head dim, bf16 weight bytes
    "Qwen3-30B-A3B": (48, 128, 8, 4 * 128, 30.5e9 * 2),
    "Qwen3-235B-A22B": (94, 128, 8, 4 * 128, 235e9 * 2),
}


def memory(gpu_bytes: float = 192e9, mem_fraction: float = 0.88, chunk: int = 16384, running: int = 1024) -> None:
    """Table + staging per GPU for each preset (prefill: published layers on every
    DP leader; decode: decode statistics, every layer staged, on TP rank 0 only)."""
    from eldr_sglang.deploy.presets import load_description, preset_names

    print(f"assumed: {gpu_bytes / 1e9:.0f} GB per GPU (MI300X), --mem-fraction-static {mem_fraction}, "
          f"chunked_prefill_size {chunk}, max_running_requests {running}, 4 published layers, uint8 ids, "
          "attention DP = TP (late binding), KV pool = what the weights leave")
    for name in preset_names():
        d = load_description(preset=name)
        if d["vendor"] == "cpu":  # the one-machine trial: no GPU memory to plan
            continue
        model = Path(d["model_path"]).name
        n_layers, _, top_k, kv_width, weights = MODELS[model]
        for role in ("prefill", "decode"):
            tp = int(d[role].get("tp_size", 1))
            kv_per_token = n_layers * 2 * kv_width * 2  # attention TP 1: every KV head on each GPU
            slots = int((gpu_bytes * mem_fraction - weights / tp) / kv_per_token)
            # staging_rows: times the attention-DP ranks gathered; a decode server: running requests only
            rows = (max(chunk, running) if role == "prefill" else running) * tp
            if role == "prefill":
                table, staged = slots * 4 * top_k, rows * 4 * top_k
            else:
                table, staged = 0, rows * n_layers * top_k
            print(f"{name:36s} {role:7s} TP{tp}: {slots / 1e3:7.0f}k KV slots/GPU, table {table / 2**20:6.1f} MiB, "
                  f"staging {staged / 2**20:6.1f} MiB per GPU{' (TP rank 0 only)' if role == 'decode' else ''}")


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
    p.add_argument("--memory", action="store_true", help="only the memory per preset")
    p.add_argument("--model", default=".cache/models/tiny-qwen3-moe")
    p.add_argument("--prompts", type=int, default=30)
    args = parse_with_quick(p, None)
    torch.set_num_threads(1)
    if args.memory:
        memory()
        return
    if args.quick:  # one small case of each kind, no servers
        forward_overhead("decode", 16, layers=4, experts=32, top_k=4, repeat=3)
        micro(128, 4, 2, 32, 4)
        memory()
        return
    for phase, rows in (("extend", 2048), ("extend", 8192), ("decode", 64), ("decode", 256)):
        forward_overhead(phase, rows)
    for tokens in (128, 2048, 8192):
        micro(tokens, 48, 4, 128, 8)  # Qwen3-30B-A3B shapes, 4 selected layers
    micro(2048, 48, 48, 128, 8)  # trace mode: every layer
    if args.servers:
        servers(args.model, args.prompts)


if __name__ == "__main__":
    main()
