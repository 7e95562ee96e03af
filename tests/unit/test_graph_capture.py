"""The capture is graph-safe by construction: what runs inside a forward records
into a CUDA-graph stand-in (tests/unit/graph_replay.py) and replays on new
batches exactly as the eager path computes them; what reads the live batch runs
after the forward. Stubs of SGLang's objects, no server."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eldr_sglang.patches import after_forward as af
from eldr_sglang.patches import capture
from eldr_sglang.patches import state as engine
from eldr_sglang.patches.dp_rows import RowBlock, local_block, rank_blocks
from eldr_sglang.patches.flags import EngineConfig
from eldr_sglang.radix_signature import ExpertSlotTable, request_counts
from eldr_sglang.radix_signature.staging import ExpertStage
from tests.unit.graph_replay import GraphRecorder, GraphUnsafe, on_meta

N_LAYERS, N_EXP, TOP_K, N_SLOTS, SENTINEL = 4, 16, 4, 64, 77
TARGET = SimpleNamespace(allow_routed_experts_capture=True)  # a target model's topk_config
DRAFT = SimpleNamespace(allow_routed_experts_capture=False)  # a draft model's (SGLang's opt-out)


def mode(name: str):
    return SimpleNamespace(is_extend=lambda: name == "extend", is_decode=lambda: name == "decode")


def batch(slots, kind="extend", rows=None, **extra):
    """A live ForwardBatch stand-in: one token per slot."""
    slots = torch.as_tensor(slots)
    rows = torch.arange(len(slots)) if rows is None else torch.as_tensor(rows)
    return SimpleNamespace(**{"forward_mode": mode(kind), "out_cache_loc": slots, "batch_size": len(rows),
                              "req_pool_indices": rows, "global_num_tokens_cpu": None, **extra})


def make_state(monkeypatch, layers=(1, 3), stage_rows=32, decode_stats=True, trace=False) -> engine.CaptureState:
    staged = list(range(N_LAYERS)) if decode_stats else list(layers)
    table_layers = list(range(N_LAYERS)) if trace else list(layers)
    state = engine.CaptureState(EngineConfig(layers=tuple(layers)), ready=True,
                                table=ExpertSlotTable(N_SLOTS, table_layers, N_EXP, TOP_K),
                                stage=ExpertStage(stage_rows, staged, N_EXP, TOP_K))
    state.table.ids.fill_(SENTINEL)  # untouched rows keep it
    if table_layers != staged:
        state.table_columns = torch.tensor([staged.index(l) for l in table_layers])
    if decode_stats:
        d = state.decode
        d.unique_total = torch.zeros((), dtype=torch.int64)
        d.hits = torch.zeros((N_LAYERS, N_EXP + 1), dtype=torch.bool)
        d.active = d.hits[:, :N_EXP]
    if trace:
        state.decode_acc = torch.zeros((8, N_LAYERS, N_EXP), dtype=torch.int32)
    monkeypatch.setattr(engine, "STATE", state)
    monkeypatch.setattr(af, "dp_rank", lambda: 0)
    return state


def routed(rng, n) -> dict[int, torch.Tensor]:
    """Top-k ids [n, k] int32 of every layer (distinct experts per token)."""
    return {l: torch.tensor(np.stack([rng.permutation(N_EXP)[:TOP_K] for _ in range(n)]), dtype=torch.int32)
            for l in range(N_LAYERS)}


def model_forward(ids: dict[int, torch.Tensor], config=TARGET) -> None:
    """What a forward runs of the plugin: the select_experts hook of every MoE layer."""
    for layer in range(N_LAYERS):
        capture.select_experts_after(SimpleNamespace(topk_ids=ids[layer]), layer_id=layer, topk_config=config)


def reference_table(state, slots, ids) -> torch.Tensor:
    """The eager expectation: table[slot] = that token's ids, layer by layer."""
    ref = state.table.ids.clone()
    for col, layer in enumerate(state.table.layers):
        for i, slot in enumerate(slots):
            ref[slot, col] = ids[layer][i, :TOP_K].to(ref.dtype)
    return ref


class Graph:
    """One captured forward at a padded batch size, replayed inside ModelRunner.forward."""

    def __init__(self, padded: int, rng) -> None:
        self.inputs = {l: torch.zeros((padded, TOP_K), dtype=torch.int32) for l in range(N_LAYERS)}
        dummy = routed(rng, padded)
        for l in range(N_LAYERS):
            self.inputs[l].copy_(dummy[l])
        with GraphRecorder() as self.recorder:  # capture: the live batch is not set
            model_forward(self.inputs)

    def run(self, fb, ids: dict[int, torch.Tensor]):
        """``ModelRunner.forward`` with this graph: copy the live rows in, replay."""
        def original(runner, forward_batch):
            n = len(forward_batch.out_cache_loc)
            for l in range(N_LAYERS):
                self.inputs[l][:n].copy_(ids[l])
                self.inputs[l][n:] = 15  # padding rows: whatever the runner left there
            self.recorder.replay()
            return SimpleNamespace(can_run_graph=True)

        return capture.forward_around(original, SimpleNamespace(is_draft_worker=False), fb)


def eager_run(fb, ids):
    def original(runner, forward_batch):
        model_forward(ids)
        return SimpleNamespace(can_run_graph=False)

    return capture.forward_around(original, SimpleNamespace(is_draft_worker=False), fb)


# ------------------------------------------------------------------ the stand-in itself
def test_the_replay_stand_in_refuses_what_a_graph_cannot_hold():
    x = torch.tensor([0, 3, 3, 1])
    for unsafe in (lambda: x.sum().item(), lambda: x.nonzero(), lambda: x[x > 1], lambda: torch.bincount(x),
                   lambda: x.repeat_interleave(x), lambda: x.tolist(), lambda: bool(x.any())):
        with pytest.raises(GraphUnsafe), GraphRecorder():
            unsafe()
    with GraphRecorder():  # the graph-safe forms pass
        x.repeat_interleave(x, output_size=7)
        torch.zeros(4).index_put_((x,), torch.ones(4), accumulate=True)


def test_the_old_capture_is_blind_under_a_graph(monkeypatch):
    """Today's blindness, as a regression test of the stand-in: a hook that reads the
    live batch records nothing when the batch is unset (as during a capture), and
    when it is set, a replay writes the capture-time slots, not the new batch's."""
    table = ExpertSlotTable(N_SLOTS, [1], N_EXP, TOP_K)
    ids = torch.zeros((2, TOP_K), dtype=torch.int32)

    def old_hook(fb):
        if fb is not None:
            table.write(fb.out_cache_loc, 1, ids)

    with GraphRecorder() as rec:
        old_hook(None)
    assert rec.ops == []
    with GraphRecorder() as rec:
        old_hook(batch([1, 2]))
    ids.fill_(9)  # the next batch: other ids for slots 5 and 6
    rec.replay()
    assert (table.ids[[1, 2]] == 9).all() and (table.ids[[5, 6]] == 0).all()


# ------------------------------------------------------------------ inside the graph
def test_with_the_live_batch_unset_the_hook_still_records_the_staging_write(monkeypatch):
    state = make_state(monkeypatch)
    assert state.forward_batch is None
    with GraphRecorder() as rec:
        model_forward(routed(np.random.default_rng(0), 5))
    copies = [op for op in rec.ops if op[0] is torch.ops.aten.copy_.default]
    assert len(copies) == N_LAYERS, rec.op_names()  # one staging copy per staged layer
    assert all(op[1][0].untyped_storage().data_ptr() == state.stage.buf.untyped_storage().data_ptr()
               for op in copies)


def test_every_in_graph_function_runs_on_the_meta_device(monkeypatch):
    stage = ExpertStage(8, list(range(N_LAYERS)), N_EXP, TOP_K, device="meta")
    state = make_state(monkeypatch)
    state.stage = stage
    ids = on_meta(torch.zeros((6, TOP_K + 1), dtype=torch.int32))
    stage.write(2, ids)
    capture.stage_ids(state, 1, ids, dispatched=False)
    capture.select_experts_after(SimpleNamespace(topk_ids=ids), layer_id=3, topk_config=TARGET)
    assert state.failed == set()  # select_experts_after swallows errors: none happened
    state.cursor = {}
    capture.stage_ids(state, 0, ids, dispatched=False)
    assert state.cursor == {0: 6}


def test_replay_of_three_batches_equals_eager(monkeypatch):
    rng = np.random.default_rng(1)
    graph_state = make_state(monkeypatch, trace=True)
    graph = Graph(8, rng)
    batches = [([5, 9, 2, 40], "extend"), ([11, 12, 13, 14, 15, 16, 17], "extend"), ([20, 21, 22], "decode")]
    runs = [(batch(s, kind), routed(rng, len(s))) for s, kind in batches]
    for fb, ids in runs:
        graph.run(fb, ids)
    eager_state = make_state(monkeypatch, trace=True)
    for fb, ids in runs:
        eager_run(fb, ids)
    assert torch.equal(graph_state.table.ids, eager_state.table.ids)
    assert torch.equal(graph_state.decode_acc, eager_state.decode_acc)
    assert int(graph_state.decode.unique_total) == int(eager_state.decode.unique_total) > 0
    expected = graph_state.table.ids.clone().fill_(SENTINEL)
    for fb, ids in runs:
        expected = reference_table(SimpleNamespace(table=SimpleNamespace(ids=expected, layers=graph_state.table.layers)),
                                   fb.out_cache_loc.tolist(), ids)
    assert torch.equal(graph_state.table.ids, expected)


def test_padding_and_sink_rows_are_untouched(monkeypatch):
    """A padded graph's extra rows (their KV slot is the pool's sink, slot 0) and
    every slot outside the batch keep their contents."""
    rng = np.random.default_rng(2)
    state = make_state(monkeypatch)
    graph = Graph(8, rng)
    slots = [7, 8, 9]
    fb = batch(slots, "decode")
    fb.out_cache_loc = torch.tensor(slots)  # live rows only; the runner pads its own copy with slot 0
    ids = routed(rng, 3)
    graph.run(fb, ids)
    untouched = [s for s in range(N_SLOTS) if s not in slots]
    assert (state.table.ids[untouched] == SENTINEL).all()
    assert torch.equal(state.table.ids, reference_table(state, slots, ids).where(
        torch.isin(torch.arange(N_SLOTS), torch.tensor(slots)).view(-1, 1, 1), state.table.ids))
    expected = sum(len({int(e) for e in ids[l][:3].flatten()}) for l in range(N_LAYERS))
    assert int(state.decode.unique_total) == expected  # the padding rows' ids (15) not counted


def test_buffers_keep_their_address_over_many_forwards(monkeypatch):
    rng = np.random.default_rng(3)
    state = make_state(monkeypatch, trace=True)
    def tensors():  # read anew: a rebound attribute is a reallocation too
        return [state.stage.buf, state.table.ids, state.decode.hits, state.decode.active, state.decode.unique_total,
                state.decode_acc]

    before = [t.data_ptr() for t in tensors()]
    graph = Graph(8, rng)
    for i in range(60):
        n = 1 + i % 8
        fb = batch(rng.choice(N_SLOTS, n, replace=False), "decode" if i % 3 else "extend")
        (graph.run if i % 2 else eager_run)(fb, routed(rng, n))
    assert [t.data_ptr() for t in tensors()] == before
    assert state.decode.steps == sum(1 for i in range(60) if i % 3)


def test_chunked_prefill_over_two_chunks_and_a_prefix_hit_equals_eager(monkeypatch):
    """Request A: 10 prompt tokens in chunks of 6 and 4 (graph replays); request B:
    A's first 6 tokens from the prefix cache + 3 new ones. Both signatures count
    exactly each token's ids as first computed."""
    rng = np.random.default_rng(4)
    state = make_state(monkeypatch, decode_stats=False)
    graph = Graph(8, rng)
    a_slots, b_new = list(range(30, 40)), [50, 51, 52]
    a_ids = routed(rng, 10)
    b_ids = routed(rng, 3)
    graph.run(batch(a_slots[:6]), {l: a_ids[l][:6] for l in a_ids})
    graph.run(batch(a_slots[6:]), {l: a_ids[l][6:] for l in a_ids})
    graph.run(batch(b_new), b_ids)
    pool = SimpleNamespace(req_to_token=torch.zeros((2, 16), dtype=torch.int64))
    pool.req_to_token[0, :10] = torch.tensor(a_slots)
    pool.req_to_token[1, :9] = torch.tensor(a_slots[:6] + b_new)
    req = lambda row, n: SimpleNamespace(kv=SimpleNamespace(req_pool_idx=row), origin_input_ids=[0] * n)  # noqa: E731
    for row, n, tokens in ((0, 10, a_ids), (1, 9, {l: torch.cat([a_ids[l][:6], b_ids[l]]) for l in a_ids})):
        got = request_counts(pool, req(row, n), state.table).numpy()
        for col, layer in enumerate(state.table.layers):
            np.testing.assert_array_equal(got[col], np.bincount(tokens[layer].flatten().numpy(), minlength=N_EXP))


def test_draft_workers_write_nothing(monkeypatch):
    state = make_state(monkeypatch)
    state.ready = False
    draft = SimpleNamespace(is_draft_worker=True)
    capture.init_cuda_graphs_before(draft)
    assert not state.ready and "initialisation" not in state.failed  # the draft never builds the state
    state.ready = True
    before_stage, before_table = state.stage.buf.clone(), state.table.ids.clone()
    ids = routed(np.random.default_rng(5), 4)

    def draft_forward(runner, fb):
        model_forward(ids, config=DRAFT)  # the draft model's TopK layers opt out of capture
        return SimpleNamespace(can_run_graph=False)

    capture.forward_around(draft_forward, draft, batch([1, 2, 3, 4], "decode"))
    assert torch.equal(state.stage.buf, before_stage) and torch.equal(state.table.ids, before_table)
    assert state.decode.steps == 0


def test_rows_beyond_the_staging_capacity_are_skipped_with_one_log_line(monkeypatch, caplog):
    rng = np.random.default_rng(6)
    state = make_state(monkeypatch, stage_rows=4)
    slots = [10, 11, 12, 13, 14, 15]
    ids = routed(rng, 6)
    with caplog.at_level(logging.WARNING, logger="eldr_sglang.capture"):
        eager_run(batch(slots), ids)
        eager_run(batch(slots), ids)
    assert len([r for r in caplog.records if "not captured" in r.message]) == 1
    assert torch.equal(state.table.ids[10:14], reference_table(state, slots[:4], ids)[10:14])
    assert (state.table.ids[14:16] == SENTINEL).all()


def test_two_batch_overlap_micro_batches_stage_one_after_another(monkeypatch):
    rng = np.random.default_rng(7)
    state = make_state(monkeypatch)
    state.cursor = {}
    ids = routed(rng, 5)

    def two_micro_batches(runner, fb):
        for part in (slice(0, 2), slice(2, 5)):  # layer by layer, each micro-batch its own rows
            model_forward({l: ids[l][part] for l in ids})
        return SimpleNamespace(can_run_graph=False)

    slots = [3, 4, 5, 6, 7]
    capture.forward_around(two_micro_batches, SimpleNamespace(is_draft_worker=False), batch(slots))
    assert torch.equal(state.table.ids, reference_table(state, slots, ids))


# ------------------------------------------------------------------ attention DP
def test_dp_blocks_of_the_eager_sum_and_max_length_layouts():
    fb = batch(list(range(3)), global_num_tokens_cpu=[5, 3, 0, 2], global_num_tokens_padded_cpu=[5, 3, 0, 2])
    assert rank_blocks(fb) == [RowBlock(0, 5), RowBlock(5, 3), RowBlock(8, 0), RowBlock(8, 2)]
    fb.global_num_tokens_padded_cpu = [5, 5, 5, 5]  # max-length layout: every block padded to 5
    assert rank_blocks(fb) == [RowBlock(0, 5), RowBlock(5, 3), RowBlock(10, 0), RowBlock(15, 2)]
    assert rank_blocks(fb, graph_batch=8) == [RowBlock(0, 5), RowBlock(8, 3), RowBlock(16, 0), RowBlock(24, 2)]
    assert local_block(rank_blocks(fb), 1, 3) == RowBlock(5, 3)
    assert rank_blocks(batch([1, 2])) == [RowBlock(0, 2)]  # no DP
    with pytest.raises(ValueError, match="live tokens in a block"):
        rank_blocks(batch([1], global_num_tokens_cpu=[4, 1], global_num_tokens_padded_cpu=[2, 2]))
    with pytest.raises(ValueError, match="DP rank 4"):
        local_block(rank_blocks(fb), 4, 1)


@pytest.mark.parametrize("layout", ["sum", "max", "decode-graph"])
def test_each_dp_leader_writes_exactly_its_own_rows(monkeypatch, layout):
    """Planted gathered rows: rank r's tokens carry ids naming r; the leader of rank 1
    must write its 3 tokens' ids to its slots and nothing of the other ranks."""
    state = make_state(monkeypatch)
    monkeypatch.setattr(af, "dp_rank", lambda: 1)
    live = [4, 3, 2]
    width = {"sum": live, "max": [4, 4, 4], "decode-graph": [8, 8, 8]}[layout]
    ids = torch.full((sum(width), TOP_K), 15, dtype=torch.int32)  # padding rows
    start = 0
    for rank, (n, w) in enumerate(zip(live, width)):
        ids[start:start + n] = torch.arange(TOP_K, dtype=torch.int32) + 4 * rank
        start += w
    slots = [20, 21, 22]
    fb = batch(slots, "decode", global_num_tokens_cpu=live,
               global_num_tokens_padded_cpu=None if layout == "decode-graph" else width)
    runner = SimpleNamespace(is_draft_worker=False, decode_cuda_graph_runner=SimpleNamespace(bs=8))

    def original(r, b):
        model_forward({l: ids for l in range(N_LAYERS)})
        return SimpleNamespace(can_run_graph=layout == "decode-graph")

    capture.forward_around(original, runner, fb)
    for col in range(len(state.table.layers)):
        assert state.table.ids[slots, col].tolist() == [[4, 5, 6, 7]] * 3
    assert (state.table.ids[[s for s in range(N_SLOTS) if s not in slots]] == SENTINEL).all()
    # decode statistics: the union over every rank's live rows (the MoE ran on all of them), no padding
    assert int(state.decode.unique_total) == N_LAYERS * 12 and state.decode.tokens == 9


# ------------------------------------------------------------------ decode statistics, EPLB, formats
def test_decode_statistics_equal_the_distinct_experts_of_each_step(monkeypatch):
    rng = np.random.default_rng(8)
    state = make_state(monkeypatch)
    graph = Graph(8, rng)
    total = 0
    for n in (1, 5, 8):
        ids = routed(rng, n)
        graph.run(batch(list(range(n)), "decode"), ids)
        step = [len({int(e) for e in ids[l].flatten()}) for l in range(N_LAYERS)]
        assert state.decode.active.sum(dim=1).tolist() == step
        total += sum(step)
    assert int(state.decode.unique_total) == total and state.decode.steps == 3 and state.decode.tokens == 14


def test_physical_expert_slots_are_mapped_to_logical_after_the_forward(monkeypatch):
    import sglang.srt.eplb.expert_location as el

    state = make_state(monkeypatch, decode_stats=False, layers=(0, 1))
    p2l = torch.tensor([[0, 1, 2, 3, 0, 2], [0, 1, 2, 3, 1, 3]])  # 4 experts + 2 redundant slots
    monkeypatch.setattr(el, "get_global_expert_location_metadata",
                        lambda: SimpleNamespace(physical_to_logical_map=p2l))
    phys = torch.tensor([[4, 5, 0, 1], [1, 2, 3, 4]], dtype=torch.int32)

    def original(runner, fb):
        for layer in (0, 1):
            capture.select_experts_after(SimpleNamespace(topk_ids=phys), layer_id=layer, topk_config=TARGET,
                                         expert_location_dispatch_info=object())
        return SimpleNamespace(can_run_graph=False)

    capture.forward_around(original, SimpleNamespace(is_draft_worker=False), batch([8, 9]))
    assert state.table.ids[8].tolist() == [[0, 2, 0, 1], [1, 3, 0, 1]]
    assert state.table.ids[9].tolist() == [[1, 2, 3, 0], [1, 2, 3, 1]]


def test_top_k_formats_that_skip_select_experts_are_staged_from_the_same_inputs(monkeypatch):
    state = make_state(monkeypatch, decode_stats=False)
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int32)
    bypassed = SimpleNamespace(format=SimpleNamespace(name="BYPASSED"),
                               to_standard=lambda: capture.select_experts_after(
                                   SimpleNamespace(topk_ids=ids), layer_id=3, topk_config=TARGET))
    topk = SimpleNamespace(layer_id=3, topk_config=TARGET)
    assert capture.topk_forward_after(bypassed, topk, None, None) is bypassed
    assert state.stage.buf[:2, state.stage.column(3)].tolist() == ids.tolist()
    standard = SimpleNamespace(format=SimpleNamespace(name="STANDARD"), to_standard=None)
    assert capture.topk_forward_after(standard, topk) is standard and state.failed == set()


# ------------------------------------------------------------------ allocation and hook targets
def _runner(**server_args):
    hf = SimpleNamespace(num_hidden_layers=N_LAYERS, num_experts=N_EXP, num_experts_per_tok=TOP_K)
    args = {"chunked_prefill_size": 64, "max_prefill_tokens": 1024, "enable_two_batch_overlap": False,
            **server_args}
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=hf, model_path="/m/tiny"), device="cpu",
                           token_to_kv_pool=SimpleNamespace(size=N_SLOTS - 1, page_size=1),
                           req_to_token_pool=SimpleNamespace(size=7), server_args=SimpleNamespace(**args),
                           max_running_requests=16, is_draft_worker=False)


def test_the_state_is_allocated_before_the_graphs_are_captured(monkeypatch):
    state = engine.CaptureState(EngineConfig(layers=(1, 3), metrics_port=9))
    monkeypatch.setattr(engine, "STATE", state)
    capture.init_cuda_graphs_before(_runner())
    assert state.ready and state.failed == set()
    assert state.stage.buf.shape == (64, N_LAYERS, TOP_K) and state.stage.buf.dtype == torch.uint8
    assert state.table.layers == [1, 3] and state.table_columns.tolist() == [1, 3]
    ptr = state.stage.buf.data_ptr()
    capture.init_cuda_graphs_before(_runner())  # a second call (another runner) reallocates nothing
    assert state.stage.buf.data_ptr() == ptr
    no_chunks = engine.CaptureState(EngineConfig(layers=(1,)))
    engine.initialise(no_chunks, _runner(chunked_prefill_size=-1))
    assert no_chunks.stage.rows == 1024 and no_chunks.decode.hits is None  # no metrics: no decode statistics
    tbo = engine.CaptureState(EngineConfig(layers=(1,)))
    engine.initialise(tbo, _runner(enable_two_batch_overlap=True))
    assert tbo.cursor == {}


def test_every_new_hook_target_resolves_in_the_installed_sglang():
    import inspect

    import eldr_sglang.patches as patches
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    for key in ("init_cuda_graphs", "forward", "select_experts", "topk_forward_cuda"):
        assert key in patches.TARGETS
    for key in ("dp_gather_slot", "dp_enabled", "out_cache_loc_virtual", "global_num_tokens_cpu",
                "global_num_tokens_padded_cpu", "can_run_graph"):
        assert key in patches.READS
    assert patches.missing_targets() == []
    assert "self.bs = bs" in inspect.getsource(DecodeCudaGraphRunner)  # read after a decode replay


# ------------------------------------------------------------------ which graphs stay on
BASE = ["--model-path", "m"]


def _flags(*argv):
    from eldr_sglang.patches.flags import parse_eldr_flags

    return parse_eldr_flags(list(argv))


def test_trace_mode_turns_only_the_prefill_graph_off(tmp_path, caplog):
    from eldr_sglang.patches.flags import graph_safe_argv

    trace = _flags("--eldr-trace-dir", str(tmp_path), "--eldr-metrics-port", "9100")
    with caplog.at_level(logging.INFO, logger="eldr_sglang"):
        assert graph_safe_argv(trace, BASE, gpu=True) == BASE + ["--disable-prefill-cuda-graph"]
    assert "prefill CUDA graph turned off" in caplog.text and "trace mode" in caplog.text
    assert "decode CUDA graph(s) stay on" in caplog.text


def test_two_batch_overlap_turns_both_graphs_off(caplog):
    from eldr_sglang.patches.flags import graph_safe_argv

    argv = BASE + ["--enable-two-batch-overlap"]
    with caplog.at_level(logging.WARNING, logger="eldr_sglang"):
        got = graph_safe_argv(_flags("--eldr-layers", "1", "--eldr-publish", "request"), argv, gpu=True)
    assert got == argv + ["--disable-prefill-cuda-graph", "--disable-decode-cuda-graph"]
    assert caplog.text.count("two-batch overlap") == 2
    assert graph_safe_argv(_flags("--eldr-layers", "1"), BASE + ["--enable-single-batch-overlap"], gpu=True) \
        == BASE + ["--enable-single-batch-overlap"]  # one batch: the staging rows are its own


def test_an_explicit_graph_backend_is_kept_with_a_warning(tmp_path, caplog):
    from eldr_sglang.patches.flags import graph_safe_argv

    trace = _flags("--eldr-trace-dir", str(tmp_path))
    kept = BASE + ["--cuda-graph-backend-prefill", "breakable"]
    with caplog.at_level(logging.WARNING, logger="eldr_sglang"):
        assert graph_safe_argv(trace, kept, gpu=True) == kept
    assert "set explicitly and stays on" in caplog.text
    off = BASE + ["--disable-prefill-cuda-graph"]
    assert graph_safe_argv(trace, off, gpu=True) == off  # already off: not added twice


def test_top_k_formats_that_bypass_select_experts_keep_the_graphs_on(caplog):
    from eldr_sglang.patches.flags import graph_safe_argv

    argv = BASE + ["--moe-runner-backend", "triton_kernel"]
    with caplog.at_level(logging.INFO, logger="eldr_sglang"):
        assert graph_safe_argv(_flags("--eldr-metrics-port", "9100"), argv, gpu=True) == argv
    assert "routes without select_experts" in caplog.text


def test_a_pd_decode_server_stages_its_running_requests_only():
    runner = _runner(disaggregation_mode="decode")
    assert engine.staging_rows(runner) == 16  # max_running_requests, not the 64-token prefill chunk
    assert engine.staging_rows(_runner()) == 64
