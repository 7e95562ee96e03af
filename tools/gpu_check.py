"""One GPU check of the engine plugin: its real hooks inside CUDA graphs, and the MoE layer's
decode-step cost against the distinct experts a batch uses.

    python -m tools.gpu_check --out gpu_check.json    # or: make gpu-check

One process that needs torch only: no SGLang, numpy, orjson or aiohttp, no network,
nothing to install (run it from the repository root). About two minutes on one GPU; the
94-layer runs start only while ``--budget-s`` (540 s) allows, so it stays within ten.

1. ``hooks/*``: the plugin's own functions, as SGLang 0.5.23 calls them.
   ``capture.init_cuda_graphs_before`` allocates the state through ``state.initialise``.
   Each MoE layer runs softmax top-k, then ``capture.select_experts_after`` (and
   ``stage_ids``) on the ids, inside a real ``torch.cuda.CUDAGraph``.
   - Graphs are captured at padded decode batch sizes and at one extend size, then replayed
     on new batches.
   - Every forward goes through ``capture.forward_around``, whose ``after_forward`` runs
     eagerly: DP row blocks, KV-slot scatter, EPLB physical -> logical, decode statistics,
     the batch report and trace-mode decode counts.
   - The same batches also run eagerly (graphs off). These must be bit for bit equal between
     the two runs and equal to a reference computed from the batches alone: the KV-slot
     table, per-request expert counts (``request_counts``, as the publisher reads them),
     signatures (IDF, L2) and distinct experts per decode step (and the per-layer sets).
   - Scenarios: plain, attention DP (4 ranks: the table of rank 2, and decode statistics
     over every block), EPLB (physical slots, int16 staging, a rebalance while the graphs
     are live), trace mode (per-request decode counts), all at 48 layers with top-8 of 128.
     The same runs at 94 layers (Qwen3-235B-A22B) when the budget allows.
2. ``hook_cost``: a decode graph of every layer's top-k, captured with the plugin's in-graph
   writes and without, replay times (CUDA events). Each ``hooks`` check also reports the
   after-forward time per step.
3. ``microbench/*``: ``benchmark.microbench_moe_layer`` under CUDA graphs: distinct experts
   8 -> 128 at batch 32 and 128, at the Qwen3-30B-A3B and Qwen3-235B-A22B layer shapes.

It writes one JSON (device, torch/CUDA/HIP versions, pass/fail per check, timings), rewritten
after every part, so a run cut short still leaves what it did. Exit status 0 when every check
passed.

Without CUDA it is a dry run of the same code at small shapes. The graphs are then the
replay stand-in of ``tests/unit/graph_replay.py``: it records each captured forward's aten
ops, refuses host syncs and data-dependent shapes, and replays the ops on new inputs. Graph
path and eager path are still compared bit for bit. On either device, the SGLang functions
the hooks consult (``runtime_context``, ``dp_attention``, the EPLB metadata) are a stand-in
module tree, installed only while a scenario runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import types
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import torch

from eldr_sglang.patches import capture
from eldr_sglang.patches import state as engine
from eldr_sglang.patches.flags import EngineConfig
from eldr_sglang.radix_signature import request_counts
from tools.gpu_capture_check import timed

TOPK_CONFIG = SimpleNamespace(allow_routed_experts_capture=True)  # a target model's topk_config


@dataclass(frozen=True)
class Shape:
    """A model's MoE routing shape and the server sizes the check captures at."""

    name: str
    layers: int
    experts: int
    top_k: int
    published: int  # layers in the signature (the table)
    extend: int  # captured extend size (gathered tokens; chunked prefill x DP ranks)
    decode_bs: tuple[int, ...]  # captured decode batch sizes (per DP rank)
    kv_slots: int
    redundant: int  # EPLB: physical slots beyond the logical experts (> 256 ids: int16 staging)
    decode_live: tuple[int, ...] = ()  # the local rank's live decode batch, step after step


QWEN3_30B = Shape("qwen3-30b-a3b", layers=48, experts=128, top_k=8, published=4, extend=8192,
                  decode_bs=(1, 2, 4, 8, 16, 32, 64, 128, 256), kv_slots=1 << 16, redundant=160,
                  decode_live=(256, 200, 129, 100, 64, 37, 8, 3, 1))
QWEN3_235B = replace(QWEN3_30B, name="qwen3-235b-a22b", layers=94, published=8)
SMALL = Shape("small", layers=6, experts=16, top_k=4, published=2, extend=64, decode_bs=(1, 4, 8),
              kv_slots=4096, redundant=248, decode_live=(8, 7, 5, 4, 3, 2, 1, 1, 2))
#: (name, hidden, expert FFN) of the microbenchmark's layer shapes; small: the dry run's
MOE_LAYERS = (("qwen3-30b-a3b", 2048, 768), ("qwen3-235b-a22b", 4096, 1536))
MOE_LAYERS_SMALL = (("small-a", 64, 32), ("small-b", 128, 64))


@dataclass(frozen=True)
class Scenario:
    name: str
    dp: int = 1  # attention-DP ranks (1: off)
    dp_slot: int = 0  # this rank's block in the DP gather
    tp_rank: int = 0  # TP rank 0 serves decode statistics (--eldr-metrics-port)
    metrics: bool = True  # decode statistics: every layer staged
    eplb: bool = False  # select_experts returns physical slots (EPLB dispatch)
    trace: bool = False  # trace mode: per-request decode counts, prefill graph off


SCENARIOS = (
    Scenario("plain"),
    Scenario("dp_rank2_table", dp=4, dp_slot=2, tp_rank=2, metrics=False),
    Scenario("dp_rank0_stats", dp=4, dp_slot=0, tp_rank=0),
    Scenario("eplb_rebalance", eplb=True),
    Scenario("trace_decode_counts", trace=True),
)


# ------------------------------------------------------------------ the SGLang context, stood in
MISSING = object()


@contextlib.contextmanager
def sglang_stand_in(scn: Scenario, redundant: int, eplb_meta=None):
    """The few SGLang functions the hooks consult, as modules in ``sys.modules`` for the
    scenario's lifetime (the GPU machine has no SGLang; a real one is set aside meanwhile)."""
    parallel = SimpleNamespace(tp_rank=scn.tp_rank, attn_tp_rank=0, attn_cp_rank=0, num_dp_ranks=scn.dp)
    funcs = {
        "sglang.srt.runtime_context": {
            "get_parallel": lambda: parallel,
            "get_exec": lambda: SimpleNamespace(moe=SimpleNamespace(
                ep_num_redundant_experts=redundant if scn.eplb else 0))},
        "sglang.srt.layers.dp_attention": {"dp_gather_slot": lambda: scn.dp_slot,
                                           "is_dp_attention_enabled": lambda: scn.dp > 1},
        "sglang.srt.eplb.expert_location": {"get_global_expert_location_metadata": lambda: eplb_meta},
    }
    names = {"sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.eplb", *funcs}
    saved = {n: sys.modules[n] if n in sys.modules else MISSING for n in names}  # None: refused, kept so
    for n in sorted(names, key=len):
        mod = types.ModuleType(n)
        mod.__path__ = []  # a package: its submodules import
        mod.__dict__.update(funcs.get(n, {}))
        sys.modules[n] = mod
    try:
        yield
    finally:
        for n, mod in saved.items():
            if mod is MISSING:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = mod


# ------------------------------------------------------------------ graphs
class Captured:
    """One captured forward: a real ``torch.cuda.CUDAGraph`` on CUDA (warm-up on a side
    stream, and one memory pool for a runner's graphs, as SGLang's runners do), the replay
    stand-in on CPU."""

    def __init__(self, fn, device: torch.device, pool=None) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                fn()
        else:
            from tests.unit.graph_replay import GraphRecorder  # torch only

            self.graph = GraphRecorder()
            with self.graph:
                fn()

    def replay(self) -> None:
        self.graph.replay()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------ the batches
@dataclass
class Step:
    kind: str  # "extend" | "decode"
    live: list[int]  # live tokens per DP rank (one entry without DP)
    inputs: list[torch.Tensor]  # per rank [layers, live, experts] uint8: each token's gate order
    slots: torch.Tensor  # the local rank's KV slots, one per token
    rows: torch.Tensor  # extend: request-pool row per request; decode: per token
    seq_lens: torch.Tensor | None = None  # extend: new tokens per request


@dataclass
class Workload:
    steps: list[Step]
    prompts: dict[int, torch.Tensor] = field(default_factory=dict)  # request row -> its prompt's slots
    max_rows: int = 0


def gate_orders(gen, layers: int, n: int, experts: int, device, kinds=None, groups=None) -> torch.Tensor:
    """``[layers, n, experts]`` uint8: each token's rank of every expert, a random permutation
    (distinct logits, no ties). A token of kind ``c`` ranks the experts of its group
    ``groups[layer, c]`` first, as a domain's tokens favour some experts; without kinds
    (padding rows) every expert is as likely."""
    scores = torch.rand((layers, n, experts), generator=gen, device=device)
    if kinds is not None:
        scores += 2.0 * groups[:, kinds]
    return scores.argsort(dim=-1).argsort(dim=-1).to(torch.uint8)


def expert_groups(gen, shape: Shape, device) -> torch.Tensor:
    """``[layers, kinds, experts]`` bool: per layer, disjoint groups of ``2 top_k`` experts, one
    per kind of request, covering half the experts. A decode step then hits fewer than all
    experts, and padding rows (any expert) counted by mistake would show."""
    size = 2 * shape.top_k
    kinds = max(1, shape.experts // (2 * size))
    order = torch.rand((shape.layers, shape.experts), generator=gen, device=device).argsort(dim=-1)
    groups = torch.zeros((shape.layers, kinds, shape.experts), dtype=torch.bool, device=device)
    for c in range(kinds):
        groups[:, c].scatter_(1, order[:, c * size:(c + 1) * size], True)
    return groups


def token_kinds(step: Step, scn: Scenario, kinds: int, gen) -> list[torch.Tensor]:
    """The kind of each token of each rank: the local rank's from its requests (row mod kinds),
    the other ranks' at random."""
    device = step.slots.device
    out = []
    for rank, n in enumerate(step.live):
        if rank != scn.dp_slot:
            out.append(torch.randint(0, kinds, (n,), generator=gen).to(device))
        elif step.kind == "extend":
            out.append((step.rows % kinds).repeat_interleave(step.seq_lens, output_size=n))
        else:
            out.append(step.rows % kinds)
    return out


def split_requests(gen, n: int, longest: int) -> list[int]:
    """Random request lengths 1..longest summing to ``n``."""
    sizes = []
    while n > 0:
        sizes.append(min(n, int(torch.randint(1, longest + 1, (1,), generator=gen))))
        n -= sizes[-1]
    return sizes


class Slots:
    """KV slots handed out once each, in random order (slot 0: SGLang's padding slot)."""

    def __init__(self, gen, kv_slots: int, device) -> None:
        self.free = (torch.randperm(kv_slots - 1, generator=gen) + 1).to(device)
        self.used = 0

    def take(self, n: int) -> torch.Tensor:
        out = self.free[self.used:self.used + n]
        self.used += n
        return out


def extend_step(wl: Workload, shape: Shape, scn: Scenario, live_local: int, kv: Slots, gen, device,
                cached_from: int | None) -> Step:
    """Prompts of new requests; the first one, given ``cached_from``, reuses that request's
    first slots as a cached prefix (its new tokens only are computed)."""
    chunk = shape.extend // scn.dp
    sizes = split_requests(gen, live_local, 48 if shape.extend > 1024 else 6)
    rows = list(range(wl.max_rows + 1, wl.max_rows + 1 + len(sizes)))
    wl.max_rows = rows[-1]
    slots = kv.take(live_local)
    start = 0
    for row, n in zip(rows, sizes):
        wl.prompts[row] = slots[start:start + n]
        start += n
    if cached_from is not None:
        prefix = wl.prompts[cached_from][: max(1, len(wl.prompts[cached_from]) // 2)]
        wl.prompts[rows[0]] = torch.cat([prefix, wl.prompts[rows[0]]])
    live = [live_local if r == scn.dp_slot else int(torch.randint(0, chunk + 1, (1,), generator=gen))
            for r in range(scn.dp)]
    return Step("extend", live, [], slots, torch.tensor(rows, device=device), torch.tensor(sizes, device=device))


def decode_step(wl: Workload, shape: Shape, scn: Scenario, live_local: int, kv: Slots, gen, device) -> Step:
    """One token of each of the first ``live_local`` running requests (capped at those running)."""
    n = max(1, min(live_local, wl.max_rows))
    top = max(shape.decode_bs)
    live = [n if r == scn.dp_slot else int(torch.randint(0, top + 1, (1,), generator=gen)) for r in range(scn.dp)]
    rows = torch.arange(1, n + 1, device=device)
    return Step("decode", live, [], kv.take(n), rows)


def make_workload(shape: Shape, scn: Scenario, device, seed: int) -> Workload:
    """Extends and decode steps interleaved: E1, D1-D4, E2 (a cached prefix), D5-D7, E3, D8-D9."""
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    kv = Slots(cpu_gen, shape.kv_slots, device)
    wl = Workload([])
    chunk = shape.extend // scn.dp
    extends = iter((chunk, chunk // 2 + 7, 3))
    decodes = iter(shape.decode_live)
    for kind in "EDDDDEDDDEDD":
        if kind == "E":
            first = len(wl.prompts) == 0
            wl.steps.append(extend_step(wl, shape, scn, next(extends), kv, cpu_gen, device,
                                        None if first else 1))
        else:
            wl.steps.append(decode_step(wl, shape, scn, next(decodes), kv, cpu_gen, device))
    groups = expert_groups(gen, shape, device)
    for step in wl.steps:  # sizes were drawn on the host; the gate orders are drawn on the device
        kinds = token_kinds(step, scn, groups.shape[1], cpu_gen)
        step.inputs = [gate_orders(gen, shape.layers, n, shape.experts, device, k, groups)
                       for n, k in zip(step.live, kinds)]
    return wl


# ------------------------------------------------------------------ EPLB
class Eplb:
    """Physical expert slots: each logical expert has one or two (a redundant replica).
    ``l2p`` [layers, experts, 2] is read inside the forward (the dispatch), ``p2l``
    [layers, physical] after it (SGLang's ``physical_to_logical_map``); a rebalance
    rewrites both in place while the graphs stay captured."""

    def __init__(self, shape: Shape, gen, device) -> None:
        self.shape, self.gen = shape, gen
        physical = shape.experts + shape.redundant
        self.l2p = torch.zeros((shape.layers, shape.experts, 2), dtype=torch.long, device=device)
        self.p2l = torch.zeros((shape.layers, physical), dtype=torch.long, device=device)
        self.meta = SimpleNamespace(physical_to_logical_map=self.p2l)
        self.info = SimpleNamespace(ep_dispatch_algorithm="static")  # select_experts' dispatch info
        self.rebalance()

    def rebalance(self) -> None:
        e = self.shape.experts
        l2p, p2l = torch.zeros_like(self.l2p, device="cpu"), torch.zeros_like(self.p2l, device="cpu")
        for layer in range(self.shape.layers):
            slots = torch.randperm(p2l.shape[1], generator=self.gen)
            extra = torch.randint(0, e, (self.shape.redundant,), generator=self.gen)
            logical = torch.cat([torch.arange(e), extra])
            p2l[layer, slots] = logical
            l2p[layer, :, 0] = l2p[layer, :, 1] = slots[:e]
            l2p[layer, extra, 1] = slots[e:]  # the replica a token of odd index goes to
        self.l2p.copy_(l2p)
        self.p2l.copy_(p2l)


# ------------------------------------------------------------------ the model's MoE routing
def model_forward(x: torch.Tensor, top_k: int, eplb: Eplb | None, replica: torch.Tensor) -> None:
    """What a forward runs of the plugin, for every MoE layer of ``x`` ``[layers, rows, experts]``:
    the gate's softmax top-k (SGLang's ``select_experts``), the EPLB dispatch to physical
    slots, then the plugin's AFTER hook on ``select_experts`` with the same arguments."""
    for layer in range(x.shape[0]):
        logits = x[layer].float() * 0.1
        weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
        ids = ids.to(torch.int32)
        if eplb is not None:
            ids = eplb.l2p[layer][ids.long(), replica[: ids.shape[0]]].to(torch.int32)
        out = SimpleNamespace(topk_weights=weights, topk_ids=ids, router_logits=logits)
        capture.select_experts_after(out, hidden_states=logits, router_logits=logits, topk_config=TOPK_CONFIG,
                                     layer_id=layer, expert_location_dispatch_info=eplb.info if eplb else None)


def reference_ids(x: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[layers, n, top_k]`` logical ids: the largest gate orders, computed without the hooks."""
    return x.long().argsort(dim=-1, descending=True)[..., :top_k]


def published_layers(shape: Shape) -> list[int]:
    return list(range(shape.layers))[:: max(1, shape.layers // shape.published)][: shape.published]


# ------------------------------------------------------------------ one run of the batches
def model_runner_stub(shape: Shape, scn: Scenario, wl: Workload, device) -> SimpleNamespace:
    """The attributes of SGLang's ``ModelRunner`` the plugin reads."""
    hf = SimpleNamespace(num_hidden_layers=shape.layers, num_experts=shape.experts, num_experts_per_tok=shape.top_k)
    longest = max(len(s) for s in wl.prompts.values())
    req_to_token = torch.zeros((wl.max_rows + 1, longest), dtype=torch.int32, device=device)
    for row, slots in wl.prompts.items():
        req_to_token[row, : len(slots)] = slots.to(torch.int32)
    args = SimpleNamespace(chunked_prefill_size=shape.extend // scn.dp, max_prefill_tokens=shape.extend,
                           disaggregation_mode="null", enable_two_batch_overlap=False)
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf, model_path=f"stand-in/{shape.name}"), device=device,
        token_to_kv_pool=SimpleNamespace(size=shape.kv_slots - 1, page_size=1),
        req_to_token_pool=SimpleNamespace(size=wl.max_rows, req_to_token=req_to_token),
        server_args=args, max_running_requests=max(shape.decode_bs),
        decode_cuda_graph_runner=SimpleNamespace(bs=None), is_draft_worker=False)


def mode(kind: str) -> SimpleNamespace:
    return SimpleNamespace(is_extend=lambda: kind == "extend", is_decode=lambda: kind == "decode")


def layout(step: Step, scn: Scenario, rows_graph: int | None) -> tuple[list[int], list[int], int]:
    """(block widths of the rows the MoE layers see, the DP layout's padded widths the forward
    batch carries, rows of the forward). Graphed decode: every block the graph's batch size;
    graphed extend: max-length blocks inside the captured size; eager decode: max-length;
    eager extend: sum-length (each rank's own count)."""
    live = step.live
    if scn.dp == 1:
        return live, live, rows_graph or live[0]
    longest = [max(live)] * scn.dp
    if step.kind == "decode":
        widths = [rows_graph // scn.dp] * scn.dp if rows_graph else longest
        return widths, longest, sum(widths)
    widths = longest if rows_graph else live
    return widths, widths, rows_graph or sum(widths)


class Run:
    """The batches through the plugin's hooks: graphed (``graphs``) or eager."""

    def __init__(self, shape: Shape, scn: Scenario, wl: Workload, device, graphs: bool, eplb: Eplb | None,
                 trace_dir: str | None) -> None:
        self.shape, self.scn, self.wl, self.device, self.eplb = shape, scn, wl, device, eplb
        self.mr = model_runner_stub(shape, scn, wl, device)
        config = EngineConfig(layers=tuple(published_layers(shape)), metrics_port=9 if scn.metrics else None,
                              trace_dir=trace_dir)
        self.state = engine.CaptureState(config)
        engine.STATE = self.state
        capture.init_cuda_graphs_before(self.mr)  # BEFORE ModelRunner.init_cuda_graphs: the state
        rows = self.state.stage.rows
        gen = torch.Generator(device=device).manual_seed(7)
        self.garbage = gate_orders(gen, shape.layers, rows, shape.experts, device)  # padding rows' gates
        self.static = self.garbage.clone()  # the graphs' input buffer (one, sliced, as SGLang's)
        self.replica = (torch.arange(rows, device=device) % 2).unsqueeze(1)
        self.graphs: dict[tuple[str, int], Captured] = {}
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        t0 = time.perf_counter()
        if graphs:  # the largest first, so that the smaller ones reuse its pool (as SGLang captures)
            if not scn.trace:  # trace mode keeps the prefill graph off (graph_safe_argv)
                self.graphs[("extend", shape.extend)] = self.capture(shape.extend)
            for bs in sorted(shape.decode_bs, reverse=True):
                self.graphs[("decode", bs * scn.dp)] = self.capture(bs * scn.dp)
        self.capture_s = time.perf_counter() - t0
        self.replays = {"decode": 0, "extend": 0}
        self.unique: list[int] = []
        self.active: list[torch.Tensor] = []
        self.after_ms: dict[str, list[float]] = {"decode": [], "extend": []}

    def capture(self, rows: int) -> Captured:
        view = self.static[:, :rows]
        return Captured(lambda: model_forward(view, self.shape.top_k, self.eplb, self.replica), self.device, self.pool)

    def graph_for(self, step: Step) -> tuple[Captured | None, int | None]:
        if step.kind == "decode":
            fits = [bs for bs in self.shape.decode_bs if bs >= max(step.live) and ("decode", bs * self.scn.dp)
                    in self.graphs]
            key = ("decode", min(fits) * self.scn.dp) if fits else None
        else:
            key = ("extend", self.shape.extend) if ("extend", self.shape.extend) in self.graphs else None
        return (self.graphs[key], key[1]) if key else (None, None)

    def fill(self, target: torch.Tensor, step: Step, widths: list[int]) -> None:
        target.copy_(self.garbage[:, : target.shape[1]])
        start = 0
        for width, x in zip(widths, step.inputs):
            target[:, start:start + x.shape[1]] = x
            start += width

    def forward_batch(self, step: Step, padded: list[int]) -> SimpleNamespace:
        n_local = int(step.slots.shape[0])
        fb = SimpleNamespace(forward_mode=mode(step.kind), out_cache_loc=step.slots,
                             batch_size=int(step.rows.shape[0]), req_pool_indices=step.rows,
                             extend_seq_lens=step.seq_lens, seq_lens_sum=n_local,
                             global_num_tokens_cpu=None, global_num_tokens_padded_cpu=None)
        if self.scn.dp > 1:
            fb.global_num_tokens_cpu, fb.global_num_tokens_padded_cpu = list(step.live), list(padded)
        return fb

    def step(self, step: Step) -> None:
        graph, rows_graph = self.graph_for(step)
        widths, padded, rows = layout(step, self.scn, rows_graph)
        done = {}

        def original(model_runner, forward_batch):  # ModelRunner.forward: a graph replay, or eager
            if graph is not None:
                self.fill(self.static[:, :rows], step, widths)
                model_runner.decode_cuda_graph_runner.bs = rows // self.scn.dp if step.kind == "decode" else None
                graph.replay()
                self.replays[step.kind] += 1
            else:
                x = torch.empty((self.shape.layers, rows, self.shape.experts), dtype=torch.uint8, device=self.device)
                self.fill(x, step, widths)
                model_forward(x, self.shape.top_k, self.eplb, self.replica)
            sync(self.device)
            done["t"] = time.perf_counter()
            return SimpleNamespace(can_run_graph=graph is not None)

        capture.forward_around(original, self.mr, self.forward_batch(step, padded))
        sync(self.device)
        self.after_ms[step.kind].append(1e3 * (time.perf_counter() - done["t"]))
        d = self.state.decode
        if step.kind == "decode" and d.hits is not None:
            self.unique.append(int(d.unique_total.item()) - sum(self.unique))
            self.active.append(d.active.cpu().clone())

    def run(self, rebalance_after: int | None = None) -> dict:
        t0 = time.perf_counter()
        for i, step in enumerate(self.wl.steps):
            self.step(step)
            if self.eplb is not None and i == rebalance_after:
                self.eplb.rebalance()
        seconds = time.perf_counter() - t0
        return self.collect(seconds)

    def collect(self, seconds: float) -> dict:
        st = self.state
        out = {"failed": sorted(st.failed), "ready": st.ready, "stage": [list(st.stage.buf.shape), str(st.stage.buf.dtype)],
               "replays": dict(self.replays), "capture_s": self.capture_s, "run_s": seconds,
               "after_forward_ms": {k: statistics.median(v) for k, v in self.after_ms.items() if v}}
        if st.table is not None:
            counts = torch.stack([request_counts(self.mr.req_to_token_pool, request(row, slots), st.table)
                                  .index_select(0, st.publish_columns).cpu() for row, slots in sorted(self.wl.prompts.items())])
            out.update(table=st.table.ids.cpu(), counts=counts, table_layers=list(st.table.layers))
        if st.decode.hits is not None:
            out.update(unique_per_step=list(self.unique), active=torch.stack(self.active))
        if st.decode.report is not None:
            out.update(report_usage=st.decode.report.usage.cpu(), report_unique=st.decode.report.unique.cpu())
        if st.decode_acc is not None:
            out["decode_acc"] = st.decode_acc.cpu()
        if st.trace_writer is not None:
            st.trace_writer.flush()
            out["trace_steps"] = [json.loads(line)["unique_per_layer"] for path in Path(st.config.trace_dir).glob("steps-*")
                                  for line in path.read_text().splitlines()]
        return out


def request(row: int, slots: torch.Tensor) -> SimpleNamespace:
    """The fields of SGLang's ``Req`` that ``request_counts`` reads."""
    return SimpleNamespace(origin_input_ids=range(len(slots)), kv=SimpleNamespace(req_pool_idx=row))


def signatures(counts: torch.Tensor, idf: torch.Tensor) -> torch.Tensor:
    """The router's signature of each request's counts ``[n, layers, experts]``: counts x IDF,
    concatenated, L2-normalised (float32, float64 norm), as ``core.signature`` computes it."""
    x = (counts.to(torch.float32) * idf).reshape(counts.shape[0], -1)
    norm = torch.sqrt((x.double() ** 2).sum(dim=1)).to(torch.float32).unsqueeze(1)
    return torch.where(norm > 0, x / norm.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(x))


def reference(shape: Shape, scn: Scenario, wl: Workload, table_layers: list[int], publish: list[int]) -> dict:
    """What the hooks must produce, from the batches alone (no plugin code)."""
    device = wl.steps[0].slots.device
    k, e = shape.top_k, shape.experts
    by_slot = torch.zeros((shape.kv_slots, shape.layers, k), dtype=torch.int16, device=device)
    acc = torch.zeros((wl.max_rows + 1, shape.layers, e), dtype=torch.int32, device=device)
    unique, active = [], []
    for step in wl.steps:
        ids = [reference_ids(x, k) for x in step.inputs]
        local = ids[scn.dp_slot]
        by_slot[step.slots] = local.permute(1, 0, 2).to(torch.int16)
        if step.kind == "decode":
            every = torch.cat(ids, dim=1).reshape(shape.layers, -1)
            hit = torch.zeros((shape.layers, e), dtype=torch.bool, device=device).scatter_(1, every, True)
            unique.append(int(hit.sum()))
            active.append(hit.cpu())
            n = local.shape[1]
            rows = step.rows.view(n, 1, 1).expand(n, shape.layers, k)
            layer = torch.arange(shape.layers, device=device).view(1, -1, 1).expand(n, shape.layers, k)
            acc.index_put_((rows.flatten(), layer.flatten(), local.permute(1, 0, 2).flatten()),
                           torch.ones(n * shape.layers * k, dtype=torch.int32, device=device), accumulate=True)
    pub = [table_layers.index(layer) for layer in publish]
    counts = []
    for _, slots in sorted(wl.prompts.items()):
        rows = by_slot[slots.long()][:, table_layers][:, pub].long()  # [n, published, k]
        counts.append(torch.stack([torch.bincount(rows[:, j].flatten(), minlength=e) for j in range(len(pub))]).cpu())
    return {"table": by_slot[:, table_layers].cpu(), "counts": torch.stack(counts),
            "unique_per_step": unique, "active": torch.stack(active), "decode_acc": acc.cpu()}


COMPARED = ("table", "counts", "signatures", "unique_per_step", "active", "report_usage", "report_unique",
            "decode_acc", "trace_steps")


def same(a, b) -> bool:
    """Bit for bit: tensors of equal shape and equal values (integers compared as int64)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.is_floating_point() or b.is_floating_point():
            return a.dtype == b.dtype and torch.equal(a, b)
        return a.shape == b.shape and torch.equal(a.long(), b.long())
    return a == b


def compare(graph: dict, eager: dict, ref: dict, idf: torch.Tensor, scn: Scenario) -> dict:
    """Each comparison by name: True when equal."""
    for run in (graph, eager):
        if "counts" in run:
            run["signatures"] = signatures(run["counts"], idf)
    ref["signatures"] = signatures(ref["counts"], idf)
    out = {"no hook failed, state ready": not graph["failed"] and not eager["failed"] and graph["ready"] and eager["ready"],
           "graphs replayed": graph["replays"]["decode"] > 0 and (scn.trace or graph["replays"]["extend"] > 0),
           "eager run replayed no graph": eager["replays"] == {"decode": 0, "extend": 0}}
    for key in COMPARED:
        if key in graph or key in eager:
            out[f"{key}: graph == eager"] = key in graph and key in eager and same(graph[key], eager[key])
            if key in ref:
                out[f"{key}: == reference"] = key in graph and same(graph[key], ref[key])
    return out


# ------------------------------------------------------------------ the checks
def hooks_check(shape: Shape, scn: Scenario, device, seed: int) -> dict:
    """One scenario: the batches graphed and eager, each against the other and the reference."""
    t0 = time.perf_counter()
    wl = make_workload(shape, scn, device, seed)
    runs = {}
    for graphs in (True, False):
        eplb = Eplb(shape, torch.Generator().manual_seed(seed + 1), device) if scn.eplb else None
        with contextlib.ExitStack() as stack:
            trace_dir = stack.enter_context(tempfile.TemporaryDirectory()) if scn.trace else None
            stack.enter_context(sglang_stand_in(scn, shape.redundant, eplb.meta if eplb else None))
            try:
                run = Run(shape, scn, wl, device, graphs, eplb, trace_dir)
                runs[graphs] = run.run(rebalance_after=4 if scn.eplb else None)
            finally:
                engine.STATE = None
    graph, eager = runs[True], runs[False]
    layers = graph.get("table_layers", published_layers(shape))
    ref = reference(shape, scn, wl, layers, published_layers(shape))
    idf = 1.0 + torch.rand((shape.published, shape.experts), generator=torch.Generator().manual_seed(seed))
    comparisons = compare(graph, eager, ref, idf, scn)
    details = {"comparisons": comparisons, "stage": graph["stage"], "replays": graph["replays"],
               "requests": len(wl.prompts), "decode_steps": sum(s.kind == "decode" for s in wl.steps),
               "distinct_per_step": graph.get("unique_per_step"),
               "capture_s": round(graph["capture_s"], 4), "graph_run_s": round(graph["run_s"], 4),
               "eager_run_s": round(eager["run_s"], 4),
               "after_forward_ms": {"graph": graph["after_forward_ms"], "eager": eager["after_forward_ms"]},
               "failed_hooks": graph["failed"] + eager["failed"]}
    return {"name": f"hooks/{shape.name}/{scn.name}", "ok": all(comparisons.values()),
            "seconds": round(time.perf_counter() - t0, 3), "details": details}


def timed_replays(fn, device, repeat: int) -> float:
    """Mean milliseconds per call (CUDA events on a GPU; :func:`tools.gpu_capture_check.timed`)."""
    return 1e3 * timed(fn, device.type, repeat)


def hook_cost(shape: Shape, device, seed: int, repeat: int) -> dict:
    """A decode forward of every layer's top-k with the plugin's in-graph writes and without
    (no state: the hook returns at once): CUDA graph replays timed with CUDA events on a GPU,
    eager calls on CPU."""
    t0 = time.perf_counter()
    scn = SCENARIOS[0]
    wl = make_workload(shape, scn, device, seed)
    sizes = [bs for bs in shape.decode_bs if bs in (32, 128, 256)] or list(shape.decode_bs[-2:])
    rows = {}
    with sglang_stand_in(scn, shape.redundant):
        try:
            run = Run(shape, scn, wl, device, False, None, None)
            for bs in sizes:
                a, b = (timed_replays(forward_of(run, bs, hooks), device, repeat) for hooks in (True, False))
                rows[str(bs)] = {"with_hooks_ms": round(a, 5), "without_ms": round(b, 5),
                                 "added_us": round(1e3 * (a - b), 2), "layers": shape.layers}
        finally:
            engine.STATE = None
    ok = bool(rows) and all(r["with_hooks_ms"] > 0 for r in rows.values())
    return {"name": f"hook_cost/{shape.name}", "ok": ok, "seconds": round(time.perf_counter() - t0, 3),
            "details": {"decode_forward": rows, "repeat": repeat,
                        "timing": "CUDA graph replays, CUDA events" if device.type == "cuda"
                        else "eager calls on CPU (not a GPU figure)"}}


def forward_of(run: Run, bs: int, hooks: bool):
    """A decode forward of ``bs`` rows, with the plugin's state (hooks) or without: a
    captured graph's replay on CUDA, an eager call on CPU."""
    view = run.static[:, :bs]

    def eager():
        engine.STATE = run.state if hooks else None
        model_forward(view, run.shape.top_k, None, run.replica)
        engine.STATE = run.state

    if run.device.type != "cuda":
        return eager
    engine.STATE = run.state if hooks else None
    graph = run.capture(bs)
    engine.STATE = run.state
    return graph.replay


def microbench(name: str, hidden: int, ffn: int, device, small: bool) -> dict:
    """``benchmark.microbench_moe_layer`` at one layer shape (CUDA graph replays on a GPU)."""
    from benchmark import microbench_moe_layer as mb  # torch only

    t0 = time.perf_counter()
    argv = ["--device", device.type, "--hidden", str(hidden), "--ffn", str(ffn)]
    argv += (["--experts", "16", "--top-k", "4", "--batches", "8,32", "--unique", "4,8,16", "--repeats", "2",
              "--warmup", "1"] if small else ["--batches", "32,128", "--unique", "8,16,32,64,96,128"])
    result = mb.measure(mb.build_parser().parse_args(argv))
    for row in result["rows"]:
        base = min(r["median_ms"] for r in result["rows"] if r["batch"] == row["batch"])
        row["x_vs_fewest_distinct"] = round(row["median_ms"] / base, 3)
    graphed = result["timing"].startswith("CUDA graph")
    ok = len(result["rows"]) > 0 and all(r["median_ms"] > 0 for r in result["rows"]) and (graphed or device.type != "cuda")
    return {"name": f"microbench/{name}", "ok": ok, "seconds": round(time.perf_counter() - t0, 3),
            "details": {**result, "command": "python -m benchmark.microbench_moe_layer " + " ".join(argv)}}


# ------------------------------------------------------------------ the run
def environment(device) -> dict:
    """Device, torch, CUDA/HIP and triton versions."""
    try:
        from importlib.metadata import version

        triton = version("triton")
    except Exception:
        triton = None
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
            "triton": triton, "python": platform.python_version(), "platform": platform.platform()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["device"] = {"type": "cuda", "name": props.name, "capability": f"{props.major}.{props.minor}",
                          "memory_gib": round(props.total_memory / 2 ** 30, 1), "count": torch.cuda.device_count()}
        info["device"]["arch"] = getattr(props, "gcnArchName", None)  # ROCm: gfx942 on MI300X
        info["cudnn"] = torch.backends.cudnn.version()
    else:
        info["device"] = {"type": "cpu", "name": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    return info


def attempt(name: str, fn, *args) -> dict:
    """A check that raised is a failed check, with its error (the run goes on)."""
    t0 = time.perf_counter()
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 (reported in the JSON, the run goes on)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"name": name, "ok": False, "seconds": round(time.perf_counter() - t0, 3),
                "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}


class Report:
    """The JSON, rewritten (atomically) after every check."""

    def __init__(self, path: Path, head: dict) -> None:
        self.path, self.doc, self.t0 = path, {**head, "checks": []}, time.monotonic()

    def add(self, check: dict) -> dict:
        self.doc["checks"].append(check)
        label = "OK  " if check.get("ok") else ("SKIP" if check.get("ok") is None else "FAIL")
        print(f"{label} {check['name']} ({check.get('seconds', 0):.1f} s){' ' + check['error'] if 'error' in check else ''}",
              flush=True)
        self.write()
        return check

    def write(self) -> None:
        ran = [c for c in self.doc["checks"] if c.get("ok") is not None]
        self.doc.update(ok=bool(ran) and all(c["ok"] for c in ran), elapsed_s=round(time.monotonic() - self.t0, 2))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)


def deep_shape_runs(report: Report, shape: Shape, device, seed: int, deadline: float, per_layer_s: float) -> None:
    """The scenarios again at the deep shape, each only while the budget allows it."""
    for scn in SCENARIOS:
        need = 3 * per_layer_s * shape.layers + 10  # three times the 48-layer pace, and a margin
        left = deadline - time.monotonic()
        if left < need:
            report.add({"name": f"hooks/{shape.name}/{scn.name}", "ok": None,
                        "skipped": f"time budget: {left:.0f} s left, about {need:.0f} s needed"})
            continue
        report.add(attempt(f"hooks/{shape.name}/{scn.name}", hooks_check, shape, scn, device, seed))


def shapes_for(args, device) -> tuple[bool, Shape, Shape, tuple]:
    """(small, the hooks' shape, the deep shape, the microbenchmark's layer shapes)."""
    if args.small or device.type != "cuda":
        return True, SMALL, replace(SMALL, name="small-deep", layers=12, published=3), MOE_LAYERS_SMALL
    return False, QWEN3_30B, QWEN3_235B, MOE_LAYERS


def run_all(args, device, report: Report) -> None:
    small, shape, deep, moe_layers = shapes_for(args, device)
    deadline = time.monotonic() + args.budget_s
    t0 = time.monotonic()
    for scn in SCENARIOS:
        report.add(attempt(f"hooks/{shape.name}/{scn.name}", hooks_check, shape, scn, device, args.seed))
    per_layer_s = (time.monotonic() - t0) / len(SCENARIOS) / shape.layers
    report.add(attempt(f"hook_cost/{shape.name}", hook_cost, shape, device, args.seed, 20 if small else 200))
    if not args.no_microbench:
        for name, hidden, ffn in moe_layers:
            report.add(attempt(f"microbench/{name}", microbench, name, hidden, ffn, device, small))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if not args.no_deep:
        deep_shape_runs(report, deep, device, args.seed, deadline, per_layer_s)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="the JSON report (default: gpu_check.json)")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="auto: cuda when available, else the CPU dry run (replay stand-in, small shapes)")
    ap.add_argument("--small", action="store_true", help="small shapes on a GPU too (the dry run's)")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="the deep (94-layer) runs start only while this budget allows (default 540 s)")
    ap.add_argument("--no-microbench", action="store_true", help="skip the MoE-layer microbenchmark")
    ap.add_argument("--no-deep", action="store_true", help="skip the 94-layer (Qwen3-235B-A22B) runs")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (leave --device out for the CPU dry run)")
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    graphs = "torch.cuda.CUDAGraph" if device.type == "cuda" else "replay stand-in (tests/unit/graph_replay.py)"
    head = {"tool": "python -m tools.gpu_check", "argv": list(sys.argv[1:] if argv is None else argv),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "mode": "gpu" if device.type == "cuda" else "cpu dry run", "graphs": graphs,
            **environment(device), "budget_s": args.budget_s}
    _, shape, deep, moe_layers = shapes_for(args, device)
    head["shapes"] = {"hooks": asdict(shape), "deep": asdict(deep), "scenarios": [asdict(s) for s in SCENARIOS],
                      "moe_layers": [dict(zip(("name", "hidden", "ffn"), m)) for m in moe_layers]}
    gpu_nodes = [p for p in ("/dev/nvidiactl", "/dev/kfd") if Path(p).exists()]
    if device.type == "cpu" and gpu_nodes:
        head["warning"] = (f"{', '.join(gpu_nodes)} present but this torch ({torch.__version__}) sees no GPU: "
                           f"a dry run only; run it with the GPU's python (make gpu-check GPU_PY=...)")
        print("WARNING:", head["warning"], flush=True)
    report = Report(args.out, head)
    print(f"gpu_check: {head['device']['name']} ({head['mode']}, graphs: {graphs}), torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}, HIP {head['hip']}", flush=True)
    run_all(args, device, report)
    report.write()
    print(f"{'PASS' if report.doc['ok'] else 'FAIL'}: {args.out} ({report.doc['elapsed_s']:.1f} s)")
    return 0 if report.doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
