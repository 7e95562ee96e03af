"""PD late binding (``prefill_complete``) with DP attention: the plugin hook
lifts SGLang 0.5.23's false attention-TP refusal and keeps every other one.

Runs SGLang's own CLI parser and resolution steps on a ``ServerArgs``; no server."""

from __future__ import annotations

import pkgutil
from collections import defaultdict

import pytest
from sglang.srt.arg_groups import pd_disaggregation_hook as pdh
from sglang.srt.arg_groups.parallel_hook import handle_deprecated_dp_attention
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.server_args import ServerArgs, prepare_server_args

from eldr_sglang import patches
from eldr_sglang.patches.late_binding import validate_prefill_complete_around

LATE = ["--model-path", "dummy", "--disaggregation-mode", "decode",
        "--disaggregation-transfer-backend", "mooncake",
        "--disaggregation-decode-allocation-policy", "prefill_complete"]
ATTN_TP = "attention tensor parallelism greater than one"
DP4 = ["--tp-size", "4", "--attn-dp-size", "4"]
LEGACY_DP4 = ["--tp-size", "4", "--dp-size", "4", "--enable-dp-attention"]


def _args(extra: list[str]) -> ServerArgs:
    """SGLang's parser, then the resolution step that runs before PD validation."""
    server_args = prepare_server_args(LATE + extra)
    handle_deprecated_dp_attention(server_args)
    return server_args


def _hooked(server_args: ServerArgs) -> None:
    validate_prefill_complete_around(pdh._validate_prefill_complete, server_args)


@pytest.mark.parametrize("extra", [DP4, LEGACY_DP4], ids=["attn-dp-size", "legacy-dp-attention"])
def test_stock_sglang_refuses_tp4_with_dp_attention(extra):
    with pytest.raises(ValueError, match=ATTN_TP):
        pdh._validate_prefill_complete(_args(extra))


@pytest.mark.parametrize("extra", [DP4, LEGACY_DP4], ids=["attn-dp-size", "legacy-dp-attention"])
def test_hook_accepts_tp4_with_dp_attention(extra):
    _hooked(_args(extra))


@pytest.mark.parametrize("extra", [["--tp-size", "4"], ["--tp-size", "4", "--attn-dp-size", "2"]],
                         ids=["no-dp-attention", "attention-tp2"])
def test_hook_still_refuses_attention_tp_above_one(extra):
    with pytest.raises(ValueError, match="^--disaggregation-decode-allocation-policy prefill_complete "
                                         f"does not yet support {ATTN_TP}$"):
        _hooked(_args(extra))


def test_hook_accepts_tp1():
    _hooked(_args(["--tp-size", "1"]))


def test_hook_keeps_other_refusals_without_the_false_one():
    server_args = prepare_server_args([a if a != "mooncake" else "nixl" for a in LATE] + DP4)
    handle_deprecated_dp_attention(server_args)
    with pytest.raises(ValueError, match="transfer backends other than Mooncake") as info:
        _hooked(server_args)
    assert ATTN_TP not in str(info.value)


def test_register_applies_the_hook_where_sglang_calls_it(monkeypatch):
    """``register()`` → ``HookRegistry`` patch → ``handle_pd_disaggregation`` accepts."""
    target = patches.TARGETS["validate_prefill_complete"]
    assert pkgutil.resolve_name(target) is pdh._validate_prefill_complete
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(pdh, "_validate_prefill_complete", pdh._validate_prefill_complete)  # restored after
    patches.register()
    hooks = HookRegistry._hooks[target]
    assert (HookType.AROUND, validate_prefill_complete_around) in [(t, h) for t, h, _ in hooks]
    HookRegistry._apply_target(target, hooks)
    pdh.handle_pd_disaggregation(_args(DP4))
    with pytest.raises(ValueError, match=ATTN_TP):
        pdh.handle_pd_disaggregation(_args(["--tp-size", "4"]))
