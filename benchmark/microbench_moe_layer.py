"""Measure one MoE layer's time against the number of distinct experts its batch uses.

    python -m benchmark.microbench_moe_layer [--device cpu|cuda] [--hidden 2048 --ffn 768]
        [--experts 128 --top-k 8] [--batches 32,128] [--unique 8,16,32,64,128] [--json out.json]

A decode-style layer: the batch's routing is built so that exactly ``u`` distinct
experts are hit (every token picks ``top_k`` of them); the layer gathers those
experts' weights (``W[unique_ids]``), runs the SwiGLU expert MLPs as one batched
matmul over per-expert token groups, and combines the outputs. This is a MEASURED
figure on whatever hardware runs it; ``benchmark/report.py`` compares its shape
(time vs distinct experts, and vs batch size) with the cost model.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from typing import Sequence

from benchmark.common import parse_with_quick, positive_int_list, write_record



def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1 ...")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                    help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--hidden", type=int, default=2048, help="model width (Qwen3-30B-A3B: 2048)")
    ap.add_argument("--ffn", type=int, default=768, help="expert FFN width (Qwen3-30B-A3B: 768)")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--batches", type=positive_int_list, default=[32, 128], help="batch sizes (tokens per step)")
    ap.add_argument("--unique", type=positive_int_list, default=[8, 16, 32, 64, 96, 128], help="distinct experts to hit")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--no-graph", action="store_true",
                    help="cuda: time eager calls by wall clock (launch overhead included) "
                         "instead of CUDA graph replays")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the measurements here")
    return ap


def routing(batch: int, unique: int, top_k: int, experts: int, gen):
    """[batch, top_k] expert ids hitting exactly ``unique`` distinct experts, and their weights."""
    import torch

    chosen = torch.randperm(experts, generator=gen)[:unique]
    slots = torch.arange(batch * top_k).reshape(batch, top_k) % unique  # distinct per token (unique >= top_k)
    ids = chosen[slots]
    weights = torch.softmax(torch.randn(batch, top_k, generator=gen), dim=-1)
    return ids, weights


def dispatch_plan(ids, batch: int) -> dict:
    """Token groups per distinct expert for ``ids`` [batch, top_k] (host-side sizes)."""
    import torch

    top_k = ids.shape[1]
    flat_e = ids.reshape(-1)
    flat_tok = torch.arange(batch, device=ids.device).repeat_interleave(top_k)
    uniq, inv = torch.unique(flat_e, return_inverse=True)
    order = torch.argsort(inv, stable=True)
    group = inv[order]
    counts = torch.bincount(group, minlength=uniq.numel())
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(group.numel(), device=ids.device) - starts[group]
    return {"uniq": uniq, "order": order, "group": group, "pos": pos, "tok": flat_tok[order],
            "n": uniq.numel(), "cap": int(counts.max())}


def moe_compute(x, plan: dict, weights, w13, w2, buf13=None, buf2=None):
    """Gather the distinct experts' weights, batched SwiGLU MLPs over token groups, combine."""
    import torch

    group, pos, n = plan["group"], plan["pos"], plan["n"]
    disp = x.new_zeros(n, plan["cap"], x.shape[1])
    disp[group, pos] = x[plan["tok"]]
    uniq = plan["uniq"]
    # gather: reads the distinct experts' weights only (into preallocated buffers when given)
    g13 = w13[uniq] if buf13 is None else torch.index_select(w13, 0, uniq, out=buf13[:n])
    g2 = w2[uniq] if buf2 is None else torch.index_select(w2, 0, uniq, out=buf2[:n])
    gate_up = torch.bmm(disp, g13.transpose(1, 2))
    g, u = gate_up.chunk(2, dim=-1)
    out = torch.bmm(torch.nn.functional.silu(g) * u, g2.transpose(1, 2))
    y = x.new_zeros(x.shape)
    y.index_add_(0, plan["tok"], out[group, pos] * weights.reshape(-1)[plan["order"], None].to(x.dtype))
    return y


def moe_layer(x, ids, weights, w13, w2, buf13=None, buf2=None):
    """One decode MoE layer: dispatch plan + compute (what the CPU run times)."""
    return moe_compute(x, dispatch_plan(ids, x.shape[0]), weights, w13, w2, buf13, buf2)


def time_graph(x, plan, weights, w13, w2, buf13, buf2, warmup: int, repeats: int) -> list[float]:
    """CUDA: capture the layer's kernels (dispatch planned beforehand, as SGLang's
    decode runs from CUDA graphs) and time each replay with CUDA events, in s."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(max(warmup, 1)):
            moe_compute(x, plan, weights, w13, w2, buf13, buf2)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_compute(x, plan, weights, w13, w2, buf13, buf2)
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def expert_weights(args: argparse.Namespace, device, dtype, gen):
    """The experts' SwiGLU weights ``[E, 2 ffn, hidden]`` and ``[E, hidden, ffn]``, N(0, 0.02): drawn on
    the host (CPU runs), or on the GPU itself (seconds, not a minute, at the Qwen3-235B-A22B shape)."""
    import torch

    shapes = ((args.experts, 2 * args.ffn, args.hidden), (args.experts, args.hidden, args.ffn))
    if device.type != "cuda":
        return tuple((torch.randn(shape, generator=gen) * 0.02).to(device, dtype) for shape in shapes)
    on_gpu = torch.Generator(device=device).manual_seed(args.seed)
    return tuple(torch.empty(shape, device=device, dtype=dtype).normal_(0.0, 0.02, generator=on_gpu)
                 for shape in shapes)


def measure(args: argparse.Namespace) -> dict:
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: CUDA is not available on this machine")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    w13, w2 = expert_weights(args, device, dtype, gen)
    buf13, buf2 = torch.empty_like(w13), torch.empty_like(w2)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    graph = device.type == "cuda" and not args.no_graph
    rows = []
    for batch in args.batches:
        x = torch.randn(batch, args.hidden, generator=gen).to(device, dtype)
        for unique in args.unique:
            ids, weights = routing(batch, unique, args.top_k, args.experts, gen)
            ids, weights = ids.to(device), weights.to(device)
            times = []
            if graph:
                with torch.inference_mode():
                    plan = dispatch_plan(ids, batch)
                    times = time_graph(x, plan, weights, w13, w2, buf13, buf2, args.warmup, args.repeats)
            with torch.inference_mode():
                for i in range(0 if graph else args.warmup + args.repeats):
                    sync()
                    t0 = time.perf_counter()
                    moe_layer(x, ids, weights, w13, w2, buf13, buf2)
                    sync()
                    if i >= args.warmup:
                        times.append(time.perf_counter() - t0)
            rows.append({"batch": batch, "unique": unique, "median_ms": 1e3 * statistics.median(times),
                         "min_ms": 1e3 * min(times)})
    return {
        "measured": True,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "dtype": str(dtype).replace("torch.", ""),
        "hidden": args.hidden, "ffn": args.ffn, "experts": args.experts, "top_k": args.top_k,
        "bytes_per_expert": 3 * args.hidden * args.ffn * torch.tensor([], dtype=dtype).element_size(),
        "torch": torch.__version__,
        "timing": ("CUDA graph replay, CUDA events (dispatch planned beforehand)" if graph
                   else "wall clock per call (dispatch included)"),
        "rows": rows,
    }


def table(result: dict) -> str:
    lines = [f"MoE layer on {result['device']} ({result['device_name']}, {result['dtype']}, "
             f"hidden {result['hidden']}, ffn {result['ffn']}, {result['experts']} experts, top-{result['top_k']}; "
             f"{result.get('timing', 'wall clock per call')})",
             f"{'batch':>6} {'unique':>7} {'median ms':>10} {'x vs min unique':>16}"]
    for batch in sorted({r["batch"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["batch"] == batch]
        base = rows[0]["median_ms"]
        lines += [f"{batch:>6} {r['unique']:>7} {r['median_ms']:>10.3f} {r['median_ms'] / base:>16.2f}" for r in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = parse_with_quick(ap, argv, hidden=64, ffn=32, experts=16, top_k=4, batches=[8], unique=[4, 8],
                            repeats=2, warmup=1)
    for flag, value in (("--hidden", args.hidden), ("--ffn", args.ffn), ("--experts", args.experts),
                        ("--top-k", args.top_k), ("--repeats", args.repeats)):
        if value < 1:
            ap.error(f"{flag} must be >= 1, got {value}")
    if args.top_k > args.experts:
        ap.error(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    bad = [u for u in args.unique if not args.top_k <= u <= args.experts]
    if bad:
        ap.error(f"--unique values {bad} must lie in [--top-k, --experts] = [{args.top_k}, {args.experts}]")
    bad = [(b, u) for b in args.batches for u in args.unique if b * args.top_k < u]
    if bad:
        ap.error(f"--batches x --top-k cannot reach --unique for (batch, unique) {bad}")
    try:
        result = measure(args)
    except (ValueError, RuntimeError) as exc:
        ap.error(str(exc))
    print(table(result))
    if args.json:
        write_record(args.json, result, argv, script=__file__)
        print(f"written {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
