"""tools/make_fat_expert_model.py: zero-padded experts leave the model's function unchanged.

Both checkpoints run in transformers on CPU in float32. The padded units add exact
zeros, so the only differences come from float32 summation order over a longer
inner dimension (relative ~1e-6); logits of this model are O(10), so an absolute
tolerance of 1e-3 leaves a wide margin for that while any real change to an
expert's output (a wrong row/column placement) moves logits by O(0.1-1).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools import make_fat_expert_model as fat

ROOT = Path(__file__).resolve().parents[2]

MODEL = ROOT / "models" / "eldr-tiny-moe"
WORKLOAD = ROOT / "benchmark" / "workloads" / "demo.jsonl"
WIDTH = 320  # 5x the model's 64: exercises the padding; the code path is the same at any width
LOGIT_ATOL = 1e-3


def _prompts(n: int = 6) -> list[str]:
    rows = [json.loads(line) for line in WORKLOAD.open()]
    seen, out = set(), []
    for r in rows:  # one prompt per (domain, language) label first
        key = (r["labels"]["domain"], r["labels"]["language"])
        if key not in seen:
            seen.add(key)
            out.append(r["prompt"][:400])
    return out[:n]


def _run(model_dir: Path, token_ids: list[list[int]]) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    routed: list[torch.Tensor] = []
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    assert len(routers) == model.config.num_hidden_layers
    hooks = [m.register_forward_hook(lambda _m, _i, out: routed.append(out[2].clone())) for m in routers]
    logits, ids = [], []
    with torch.no_grad():
        for seq in token_ids:
            routed.clear()
            logits.append(model(input_ids=torch.tensor([seq])).logits[0])
            ids.append(list(routed))
    for h in hooks:
        h.remove()
    return logits, ids


@pytest.fixture(scope="module")
def fat_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fat") / "model"
    fat.build(MODEL, out, WIDTH)
    return out


def test_config_and_shapes(fat_model: Path):
    config = json.loads((fat_model / "config.json").read_text())
    assert config["moe_intermediate_size"] == WIDTH
    from safetensors import safe_open

    with safe_open(str(fat_model / "model.safetensors"), "pt") as f:
        gate = f.get_tensor("model.layers.0.mlp.experts.5.gate_proj.weight")
        down = f.get_tensor("model.layers.0.mlp.experts.5.down_proj.weight")
    assert tuple(gate.shape) == (WIDTH, config["hidden_size"])
    assert tuple(down.shape) == (config["hidden_size"], WIDTH)
    assert not gate[64:].any() and not down[:, 64:].any()
    assert gate[:64].any() and down[:, :64].any()


def test_same_logits_and_routed_experts(fat_model: Path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    seqs = [tok.encode(p).ids[:96] for p in _prompts()]
    assert len(seqs) >= 5 and all(len(s) >= 8 for s in seqs)
    base_logits, base_ids = _run(MODEL, seqs)
    fat_logits, fat_ids = _run(fat_model, seqs)
    for bl, fl, bi, fi in zip(base_logits, fat_logits, base_ids, fat_ids):
        assert torch.allclose(bl, fl, atol=LOGIT_ATOL, rtol=0), float((bl - fl).abs().max())
        for layer_b, layer_f in zip(bi, fi):
            assert torch.equal(layer_b.sort(dim=-1).values, layer_f.sort(dim=-1).values)


def test_widen_refuses_a_model_without_experts():
    with pytest.raises(ValueError, match="no per-expert"):
        fat.widen_experts({"lm_head.weight": torch.zeros(4, 4)}, 8)


def test_cli_rejects_a_narrower_width(tmp_path: Path):
    proc = subprocess.run([sys.executable, "-m", "tools.make_fat_expert_model", "--model", str(MODEL),
                           "--width", "16", "--out", str(tmp_path / "x")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert "--width" in proc.stderr and "Traceback" not in proc.stderr


def test_real_cpu_cost_set_is_the_committed_measurement():
    """The simulator's "real-cpu-server" law is the fit bench_fat_expert.py recorded."""
    from eldr_sglang.sim.cost_model import REAL_CPU_FIT, get_params, step_time

    fit = json.loads((ROOT / "benchmark" / "results" / "fat_expert.json").read_text())["step_time_fit"]
    assert REAL_CPU_FIT["fixed_s"] == pytest.approx(fit["intercept_ms"] / 1e3, rel=1e-3)
    assert REAL_CPU_FIT["per_sequence_s"] == pytest.approx(fit["ms_per_sequence"] / 1e3, rel=1e-3)
    assert REAL_CPU_FIT["per_distinct_expert_s"] == pytest.approx(fit["ms_per_distinct_expert"] / 1e3, rel=1e-3)
    p = get_params("real-cpu-server")
    u = [30.0, 40.0, 50.0, 60.0]  # distinct experts per layer
    want = fit["intercept_ms"] + 8 * fit["ms_per_sequence"] + sum(u) * fit["ms_per_distinct_expert"]
    assert 1e3 * step_time(p, 8, 4000, u) == pytest.approx(want, rel=1e-3)
