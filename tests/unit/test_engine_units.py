"""Engine plugin pieces that need no server: flags and the KV-slot expert table."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from eldr_sglang.patches.flags import EngineConfig, FlagError, parse_eldr_flags, split_argv
from eldr_sglang.radix_signature import ExpertSlotTable, kv_cache_fraction


def test_split_argv_takes_only_eldr_flags():
    ours, theirs = split_argv(["--model-path", "m", "--eldr-layers", "1,2", "--port", "1",
                               "--eldr-publish=http://r:1/eldr/signature"])
    assert ours == ["--eldr-layers", "1,2", "--eldr-publish=http://r:1/eldr/signature"]
    assert theirs == ["--model-path", "m", "--port", "1"]


@pytest.mark.parametrize("argv, fragment", [
    (["--eldr-layrs", "1"], "unknown flag --eldr-layrs"),
    (["--eldr-layers", "a,b"], "--eldr-layers"),
    (["--eldr-layers", "1,1"], "distinct"),
    (["--eldr-layers", "1", "--eldr-publish", "router:8000"], "--eldr-publish"),
    (["--eldr-layers", "1", "--eldr-publish", "tcp://router"], "--eldr-publish"),
    (["--eldr-calibration", "/no/such/file.json"], "no such file"),
    (["--eldr-metrics-port", "http"], "--eldr-metrics-port"),
    (["--eldr-layers"], "--eldr-layers: expected one argument"),
    (["--eldr-layers", "1", "--eldr-publish-timeout", "-5"], "--eldr-publish-timeout"),
    (["--eldr-layers", "1", "--eldr-publish-timeout", "0"], "--eldr-publish-timeout"),
    (["--eldr-layers", "1", "--eldr-publish", "requests"], "--eldr-publish"),
])
def test_bad_flags_are_refused_with_the_flag_named(argv, fragment):
    with pytest.raises(FlagError, match=fragment):
        parse_eldr_flags(argv)


def test_corrupt_artifact_is_refused(tmp_path):
    bad = tmp_path / "a.json"
    bad.write_text('{"format": "eldr-calibration"}')
    with pytest.raises(FlagError, match="--eldr-calibration"):
        parse_eldr_flags(["--eldr-calibration", str(bad)])


def test_config_round_trips_through_the_environment(tmp_path):
    cfg = parse_eldr_flags(["--eldr-layers", "0,3", "--eldr-publish", "http://r:9/eldr/signature",
                            "--eldr-metrics-port", "9100"])
    assert cfg.active and cfg.layers == (0, 3)
    assert EngineConfig.from_env({"ELDR_ENGINE_CONFIG": cfg.to_env()}) == cfg
    assert not EngineConfig.from_env({}).active
    # 'request': publish only to the return address each routed request carries
    assert parse_eldr_flags(["--eldr-layers", "1", "--eldr-publish", "request"]).publish == "request"
    assert parse_eldr_flags(["--eldr-trace-dir", str(tmp_path / "t")]).layers == "all"


def test_launcher_stops_at_start_up_on_a_bad_eldr_flag(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", str(tmp_path),
                           "--eldr-layers", "x"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "eldr-sglang: --eldr-layers" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_slot_table_counts_cached_plus_new_tokens_exactly():
    rng = np.random.default_rng(0)
    layers, n_exp, k = [1, 3], 16, 4
    table = ExpertSlotTable(64, layers, n_exp, k)
    ids = {l: torch.tensor(np.stack([rng.permutation(n_exp)[:k] for _ in range(10)])) for l in (0, 1, 2, 3)}
    # first request: tokens 0..5 in slots 10..15; second: prefix (slots 10..15) + 4 new in 40..43
    first, new = torch.arange(10, 16), torch.tensor([40, 41, 42, 43])
    for l in (0, 1, 2, 3):
        written = table.write(first, l, ids[l][:6])
        assert written == (l in layers)
        table.write(new, l, ids[l][6:])
    got = table.counts(torch.cat([first, new])).numpy()
    for col, l in enumerate(layers):
        np.testing.assert_array_equal(got[col], np.bincount(ids[l].flatten().numpy(), minlength=n_exp))
    assert got.sum() == 10 * k * len(layers)


def test_slot_table_reused_slot_is_overwritten_and_shape_mismatch_is_ignored():
    table = ExpertSlotTable(8, [0], 300, 2)  # > 256 experts: int16 ids
    assert table.ids.dtype == torch.int16 and table.bytes_per_token == 4
    table.write(torch.tensor([3]), 0, torch.tensor([[299, 5]]))
    table.write(torch.tensor([3]), 0, torch.tensor([[7, 8]]))
    assert table.counts(torch.tensor([3]))[0, [7, 8, 299]].tolist() == [1, 1, 0]
    assert not table.write(torch.tensor([1, 2]), 0, torch.tensor([[1, 2]]))


def test_kv_fraction_arithmetic():
    # Qwen3-30B-A3B: 48 layers, 4 KV heads x 128, bf16 -> 98,304 B of KV per token
    assert kv_cache_fraction(4 * 8, 48, 4, 128) == pytest.approx(32 / 98304)


def test_artifact_for_another_model_is_refused_at_start_up(tmp_path, fixture_model):
    from eldr_sglang.core import CalibrationArtifact, ModelSpec
    from eldr_sglang.patches.flags import check_model

    unit = np.ones((2, 32), np.float32) / np.sqrt(32)
    path = tmp_path / "other.json"
    CalibrationArtifact(ModelSpec("other", 4, 32, 4), "idf", [1], np.ones((1, 32), np.float32), unit).save(path)
    with pytest.raises(FlagError, match="num_experts is 32, expected 16"):
        check_model(parse_eldr_flags(["--eldr-calibration", str(path)]), str(fixture_model))


def test_every_hook_target_exists_in_the_installed_sglang(monkeypatch):
    import eldr_sglang.patches as patches

    assert patches.missing_targets() == []
    patches.check_sglang()  # the supported version, every target present
    monkeypatch.setitem(patches.TARGETS, "renamed", "sglang.srt.managers.scheduler.Scheduler.no_such_method")
    monkeypatch.setitem(patches.TARGETS, "moved", "sglang.srt.no_such_module.f")
    assert sorted(patches.missing_targets()) == ["sglang.srt.managers.scheduler.Scheduler.no_such_method",
                                                 "sglang.srt.no_such_module.f"]
    with pytest.raises(RuntimeError, match="no_such_method"):
        patches.check_sglang()


def test_other_sglang_version_is_refused(monkeypatch):
    import sglang

    import eldr_sglang.patches as patches

    monkeypatch.setattr(sglang, "__version__", "0.6.0", raising=False)
    with pytest.raises(RuntimeError, match="supports sglang 0.5.23; sglang 0.6.0"):
        patches.check_sglang()


def launch_refused(model, *args: str) -> str:
    """stderr of a CPU ``sglang.launch_server`` with ``args`` that must stop at start (status 2)."""
    import os

    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
                           "--device", "cpu", "--attention-backend", "torch_native", *args],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    return proc.stderr


def test_publish_on_a_server_that_is_not_a_pd_prefill_stops_the_launcher(fixture_model):
    err = launch_refused(fixture_model, "--eldr-layers", "1", "--eldr-publish", "tcp://127.0.0.1:9")
    assert "--eldr-publish: only a PD prefill server" in err


def test_publish_without_late_binding_stops_the_launcher(fixture_model):
    """A prefill server that publishes without prefill_complete would make every request
    wait the router's whole signature timeout: refused at start, naming the flag."""
    err = launch_refused(fixture_model, "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend",
                         "mooncake_tcp", "--eldr-layers", "1", "--eldr-publish", "tcp://127.0.0.1:9")
    assert "--disaggregation-decode-allocation-policy prefill_complete" in err


def test_launch_server_help_lists_the_eldr_flags():
    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for flag in ("--eldr-calibration", "--eldr-layers", "--eldr-publish", "--eldr-metrics-port",
                 "--eldr-trace-dir", "--eldr-publish-timeout"):
        assert flag in proc.stdout, flag
    assert "--model-path" in proc.stdout  # SGLang's own help follows


def test_publish_without_an_artifact_sends_spread_layers_and_the_model():
    """An engine in front of an --online router needs no artifact: it publishes evenly
    spread layers and names its model in each message."""
    from types import SimpleNamespace

    import torch

    from eldr_sglang.core.layer_selection import spread_layers
    from eldr_sglang.patches.messages import signature_message
    from eldr_sglang.patches.state import selected_layers
    from eldr_sglang.patches.flags import SPREAD

    config = parse_eldr_flags(["--eldr-publish", "request"])
    assert config.layers == SPREAD
    assert selected_layers(config, 48) == spread_layers(48) == [9, 19, 28, 38]
    assert spread_layers(4) == [0, 1, 2, 3] and spread_layers(6) == [1, 2, 3, 4]
    req = SimpleNamespace(bootstrap_room=7, rid="r", origin_input_ids=[1, 2, 3], cached_tokens=0)
    model = {"name": "m", "num_layers": 48, "num_experts": 128, "top_k": 8}
    msg = signature_message(req, torch.zeros((4, 128), dtype=torch.int32), [9, 19, 28, 38],
                            packed=True, model=model)
    assert msg["model"] == model and msg["layers"] == [9, 19, 28, 38]
    assert "model" not in signature_message(req, torch.zeros((4, 128)), [9, 19, 28, 38])


def _decode_batch(slots):
    from types import SimpleNamespace

    mode = SimpleNamespace(is_extend=lambda: False, is_decode=lambda: True)
    return SimpleNamespace(forward_mode=mode, batch_size=len(slots), out_cache_loc=torch.tensor(slots),
                           req_pool_indices=torch.arange(len(slots)), global_num_tokens_cpu=None)


def test_decode_steps_write_their_tokens_into_the_slot_table(monkeypatch):
    """Staged inside the forward (the graph's padded rows too), scattered after it
    to the live batch's slots only."""
    from types import SimpleNamespace

    from eldr_sglang.patches import after_forward, capture, state as engine
    from eldr_sglang.radix_signature.staging import ExpertStage

    state = engine.CaptureState(EngineConfig(layers=(0, 1)), table=ExpertSlotTable(16, [0, 1], 8, 2),
                                stage=ExpertStage(8, [0, 1], 8, 2), ready=True)
    state.decode.unique_total = torch.zeros((), dtype=torch.int64)
    state.decode.hits = torch.zeros((2, 9), dtype=torch.bool)
    state.decode.active = state.decode.hits[:, :8]
    monkeypatch.setattr(engine, "STATE", state)
    monkeypatch.setattr(after_forward, "dp_rank", lambda: 0)

    def forward(runner, fb):  # three rows: the third is graph padding
        for layer in (0, 1):
            capture.select_experts_after(SimpleNamespace(topk_ids=torch.tensor([[1, 2], [3, 4], [7, 6]])),
                                         layer_id=layer)
        return SimpleNamespace(can_run_graph=True)

    capture.forward_around(forward, SimpleNamespace(is_draft_worker=False), _decode_batch([5, 9]))
    ids = state.table.ids
    assert ids[5, 1].tolist() == [1, 2] and ids[9, 1].tolist() == [3, 4]
    assert ids[0].sum() == 0  # padding not written
    assert state.decode.active[1].nonzero().flatten().tolist() == [1, 2, 3, 4]
    assert int(state.decode.unique_total) == 8 and state.decode.steps == 1


def test_physical_expert_slots_map_to_logical_experts(monkeypatch):
    from types import SimpleNamespace

    import sglang.srt.eplb.expert_location as el

    from eldr_sglang.patches.after_forward import physical_to_logical

    p2l = torch.tensor([[0, 1, 2, 3, 0, 2], [0, 1, 2, 3, 1, 3]])  # 4 experts, 2 redundant slots
    monkeypatch.setattr(el, "get_global_expert_location_metadata",
                        lambda: SimpleNamespace(physical_to_logical_map=p2l))
    phys = torch.tensor([[[4, 5], [4, 5]], [[1, -1], [1, -1]]])  # [tokens, layers 0 and 1, k]
    assert physical_to_logical(phys, [0, 1], 6).tolist() == [[[0, 2], [1, 3]], [[1, -1], [1, -1]]]
    assert physical_to_logical(phys[:, 1:], [1], 6).tolist() == [[[1, 3]], [[1, -1]]]


def test_cuda_graphs_stay_on_unless_the_capture_cannot_run_in_them(caplog):
    import logging

    from eldr_sglang.patches.flags import graph_safe_argv

    prefill = parse_eldr_flags(["--eldr-layers", "1", "--eldr-publish", "request"])
    decode = parse_eldr_flags(["--eldr-metrics-port", "9000"])
    base = ["--model-path", "m"]
    with caplog.at_level(logging.INFO, logger="eldr_sglang"):
        assert graph_safe_argv(prefill, base, gpu=True) == base  # signatures: graph-safe
        assert graph_safe_argv(decode, base, gpu=True) == base  # decode statistics: graph-safe
    assert "stay on" in caplog.text
    assert graph_safe_argv(prefill, base, gpu=False) == base
    assert graph_safe_argv(EngineConfig(), base, gpu=True) == base  # no ELDR capture: stock SGLang
    assert graph_safe_argv(prefill, base + ["--device", "cpu"]) == base + ["--device", "cpu"]


def test_every_attention_dp_group_leader_publishes(monkeypatch):
    from types import SimpleNamespace

    import sglang.srt.runtime_context as rc

    from eldr_sglang.patches.state import leads_its_requests

    for ranks, leads in (((0, 0, 0), True), ((1, 0, 1), False), ((4, 0, 0), True), ((5, 0, 1), False)):
        tp, cp, attn_tp = ranks
        monkeypatch.setattr(rc, "get_parallel",
                            lambda tp=tp, cp=cp, a=attn_tp: SimpleNamespace(tp_rank=tp, attn_cp_rank=cp,
                                                                            attn_tp_rank=a))
        assert leads_its_requests() is leads, ranks
