"""benchmark/traces-12l-serve (the 12-layer headline's input) is complete and consistent:
four splits of 1000 requests recorded through SGLang, every token's top-k in the counts."""

import pytest

from eldr_sglang.core.traces import load_traces
from tests.helpers import ROOT

ROOT_12L = ROOT / "benchmark" / "traces-12l-serve"


@pytest.mark.parametrize("split", ["task/calib", "task/eval", "language/calib", "language/eval"])
def test_split_is_complete(split):
    tr = load_traces(ROOT_12L / split)
    m = tr.model
    assert (m.num_layers, m.num_experts, m.top_k) == (12, 128, 8) and len(tr) == 1000
    # every prompt token picks top_k experts in every layer; every decode step too
    assert (tr.prefill_counts.sum(axis=2) == m.top_k * tr.prompt_tokens[:, None]).all()
    steps = tr.decode_counts.sum(axis=2) // m.top_k
    assert (steps == steps[:, :1]).all() and (steps[:, 0] > 0).all()
    label = "domain" if split.startswith("task") else "language"
    assert len(set(tr.labels[label].tolist())) == 4
