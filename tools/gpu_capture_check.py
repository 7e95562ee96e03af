"""The engine plugin's in-graph write path inside a real ``torch.cuda.CUDAGraph``.

Needs torch (and a GPU) only: no SGLang, no network. It captures exactly what the
plugin runs inside a forward (``ExpertStage.write`` of every MoE layer) into a
CUDA graph at realistic sizes, replays it on new batches, runs the after-forward
scatter and decode statistics eagerly, and checks everything equals the eager
path. Then it times the capture against a bf16 MoE layer forward (gate, top-k,
expert SwiGLU GEMMs over the routed tokens).

    python -m tools.gpu_capture_check                      # GPU, realistic sizes
    python -m tools.gpu_capture_check --device cpu --small  # dry run: the code path, no graph

Sizes: an 8k-token extend over 48 layers with top-8 of 128 experts (4 published
layers scattered to the KV-slot table) and a decode batch of 256 (every layer
staged for decode statistics). Prints one line per check and a JSON summary.

These are the staging primitives alone. ``python -m tools.gpu_check`` is the one
check for a lent GPU: the plugin's hook functions themselves inside the graphs
(DP row blocks, EPLB, decode statistics) and the MoE-layer microbenchmark.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eldr_sglang.radix_signature.staging import ExpertStage, mark_distinct, scatter_rows


@dataclass
class Sizes:
    extend_tokens: int = 8192
    decode_batch: int = 256
    layers: int = 48
    published: int = 4
    experts: int = 128
    top_k: int = 8
    hidden: int = 2048
    expert_ffn: int = 768
    kv_slots: int = 200_000


SMALL = Sizes(extend_tokens=256, decode_batch=32, layers=8, published=2, experts=32, top_k=4, hidden=64,
              expert_ffn=32, kv_slots=4096)


class Forward:
    """The plugin's in-graph work for one forward of ``rows`` tokens: a static
    input of top-k ids per layer (what each MoE layer's top-k would produce)
    written into the staging buffer, captured once, replayed after new ids are
    copied in (as the graph runners do with their static buffers)."""

    def __init__(self, stage: ExpertStage, rows: int, sizes: Sizes, device: str) -> None:
        self.stage = stage
        self.ids = torch.zeros((sizes.layers, rows, sizes.top_k), dtype=torch.int32, device=device)
        self.graph = None
        if device == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.body()  # warm-up, as SGLang's runners do before capture
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.body()

    def body(self) -> None:
        for layer in range(self.ids.shape[0]):
            self.stage.write(layer, self.ids[layer])

    def run(self, new_ids: torch.Tensor) -> None:
        self.ids.copy_(new_ids)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.body()


def random_ids(gen: torch.Generator, layers: int, rows: int, experts: int, top_k: int, device: str) -> torch.Tensor:
    scores = torch.rand((layers, rows, experts), generator=gen, device=device)
    return scores.topk(top_k, dim=-1).indices.to(torch.int32)


def check_extend(sizes: Sizes, device: str, gen: torch.Generator) -> dict:
    """Three prefill batches of different live lengths through one captured graph."""
    layers = list(range(sizes.layers))
    published = layers[:: max(1, sizes.layers // sizes.published)][: sizes.published]
    columns = torch.tensor(published, device=device)
    stage = ExpertStage(sizes.extend_tokens, layers, sizes.experts, sizes.top_k, device=device)
    fwd = Forward(stage, sizes.extend_tokens, sizes, device)
    table = torch.zeros((sizes.kv_slots, len(published), sizes.top_k), dtype=torch.uint8, device=device)
    expected = table.clone()
    for live in (sizes.extend_tokens, sizes.extend_tokens // 2 + 7, 3):
        ids = random_ids(gen, sizes.layers, sizes.extend_tokens, sizes.experts, sizes.top_k, device)
        slots = torch.randperm(sizes.kv_slots - 1, generator=gen, device=device)[:live] + 1
        fwd.run(ids)
        scatter_rows(table, slots, stage.buf[:live].long(), columns)
        expected[slots.long()] = ids[columns][:, :live].permute(1, 0, 2).to(torch.uint8)  # eager reference
    ok = bool(torch.equal(table, expected)) and int(table[0].sum()) == 0
    return {"check": "extend replay == eager", "ok": ok, "graph": fwd.graph is not None,
            "stage_bytes": stage.nbytes, "table_bytes": table.numel()}


def check_decode(sizes: Sizes, device: str, gen: torch.Generator) -> dict:
    """Decode steps with padding rows: distinct experts equal the eager count."""
    stage = ExpertStage(sizes.decode_batch, list(range(sizes.layers)), sizes.experts, sizes.top_k, device=device)
    fwd = Forward(stage, sizes.decode_batch, sizes, device)
    hits = torch.zeros((sizes.layers, sizes.experts + 1), dtype=torch.bool, device=device)
    ok = True
    for live in (sizes.decode_batch, sizes.decode_batch - 5, 1):
        ids = random_ids(gen, sizes.layers, sizes.decode_batch, sizes.experts, sizes.top_k, device)
        fwd.run(ids)
        got = mark_distinct(hits, stage.buf[:live])
        want = sum(int(ids[l, :live].unique().numel()) for l in range(sizes.layers))
        ok &= int(got) == want
    return {"check": "decode replay == eager (distinct experts)", "ok": ok, "graph": fwd.graph is not None,
            "stage_bytes": stage.nbytes}


def timed(fn, device: str, repeat: int) -> float:
    """Mean seconds per call."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / repeat
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def moe_layer(sizes: Sizes, tokens: int, device: str, gen: torch.Generator):
    """One bf16 MoE layer forward (gate, softmax top-k, SwiGLU experts over their tokens)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    h = torch.randn((tokens, sizes.hidden), generator=gen, device=device).to(dtype)
    gate = torch.randn((sizes.hidden, sizes.experts), generator=gen, device=device).to(dtype) * 0.02
    w13 = torch.randn((sizes.experts, sizes.hidden, 2 * sizes.expert_ffn), generator=gen, device=device).to(dtype) * 0.02
    w2 = torch.randn((sizes.experts, sizes.expert_ffn, sizes.hidden), generator=gen, device=device).to(dtype) * 0.02

    def forward():
        weights, ids = torch.softmax((h @ gate).float(), dim=-1).topk(sizes.top_k, dim=-1)
        flat = ids.flatten()
        order = flat.argsort()
        counts = torch.bincount(flat, minlength=sizes.experts).tolist()
        token_of = order // sizes.top_k
        out = torch.zeros_like(h)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = token_of[start:start + n]
                x = h[rows] @ w13[e]
                y = (torch.nn.functional.silu(x[:, : sizes.expert_ffn]) * x[:, sizes.expert_ffn:]) @ w2[e]
                out.index_add_(0, rows, y * weights.flatten()[order[start:start + n]].unsqueeze(1).to(dtype))
                start += n
        return out

    return forward


def timings(sizes: Sizes, device: str, gen: torch.Generator, repeat: int) -> dict:
    res = {}
    for phase, rows in (("extend", sizes.extend_tokens), ("decode", sizes.decode_batch)):
        stage = ExpertStage(rows, list(range(sizes.layers)), sizes.experts, sizes.top_k, device=device)
        fwd = Forward(stage, rows, sizes, device)
        ids = random_ids(gen, sizes.layers, rows, sizes.experts, sizes.top_k, device)
        fwd.ids.copy_(ids)
        replay = fwd.graph.replay if fwd.graph is not None else fwd.body
        res[f"{phase}_capture_all_layers_ms"] = 1e3 * timed(replay, device, repeat)
        res[f"{phase}_moe_layer_ms"] = 1e3 * timed(moe_layer(sizes, rows, device, gen), device, max(3, repeat // 10))
        res[f"{phase}_capture_vs_one_moe_layer"] = res[f"{phase}_capture_all_layers_ms"] / res[f"{phase}_moe_layer_ms"]
        res[f"{phase}_capture_vs_forward_of_{sizes.layers}_layers"] = \
            res[f"{phase}_capture_vs_one_moe_layer"] / sizes.layers
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: real CUDA graphs; cpu: a dry run of the same code path without a graph")
    p.add_argument("--small", action="store_true", help="small sizes (the dry run's default)")
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--out", type=Path, help="write the JSON summary here too")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: use --device cpu for the dry run")
    sizes = SMALL if (args.small or args.device == "cpu") else Sizes()
    gen = torch.Generator(device=args.device).manual_seed(0)
    checks = [check_extend(sizes, args.device, gen), check_decode(sizes, args.device, gen)]
    for c in checks:
        print(f"{'OK  ' if c['ok'] else 'FAIL'} {c['check']} ({'CUDA graph' if c['graph'] else 'eager dry run'})")
    summary = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "torch": torch.__version__, "sizes": asdict(sizes), "checks": checks}
    if not args.no_timing:
        summary["timings"] = timings(sizes, args.device, gen, args.repeat)
        for k, v in summary["timings"].items():
            print(f"  {k}: {v:.4g}")
    text = json.dumps(summary)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
