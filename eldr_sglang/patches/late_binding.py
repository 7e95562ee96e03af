"""Let PD late binding (``prefill_complete``) accept DP attention.

SGLang 0.5.23 refuses ``--disaggregation-decode-allocation-policy
prefill_complete`` on every server with ``tp_size > 1``, including servers
whose attention TP size is 1 through DP attention. The check in
``sglang/srt/arg_groups/pd_disaggregation_hook.py::_validate_prefill_complete``
reads the legacy fields::

    attn_dp_size = cfg.dp_size if cfg.enable_dp_attention else 1
    if cfg.tp_size != attn_dp_size:
        unsupported.append("attention tensor parallelism greater than one")

but ``handle_deprecated_dp_attention`` (``arg_groups/parallel_hook.py``), the
first step of the resolution pipeline (``arg_groups/pipeline.py``), has
already turned ``--dp-size N --enable-dp-attention`` into ``attn_dp_size=N,
dp_size=1, enable_dp_attention=False``, and ``--attn-dp-size N`` never sets
``enable_dp_attention``. So ``attn_dp_size`` above is always 1.

The AROUND hook runs SGLang's check and drops only that item when the
resolved attention TP size, ``tp_size / (attn_dp_size * attn_cp_size)`` (as in
``runtime_context.derive_attn_tp_size``), is 1. Every other refusal stays
SGLang's, with SGLang's wording. At run time SGLang reads the widths from
``attn_dp_size`` (``get_parallel().attn_tp_size``); the receiver's peer check
in ``disaggregation/common/conn.py`` (``prefill_complete requires peer
attention TP1/CP1/PP1``) then passes for such servers.
"""

from __future__ import annotations

from typing import Any, Callable

_PREFIX = "--disaggregation-decode-allocation-policy prefill_complete does not yet support "
_ATTN_TP_ITEM = "attention tensor parallelism greater than one"


def attention_tp_is_one(server_args: Any) -> bool:
    """Whether the resolved layout gives every attention group one TP rank."""
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    return cfg.tp_size == cfg.attn_dp_size * cfg.attn_cp_size


def validate_prefill_complete_around(original: Callable[[Any], None], server_args: Any) -> None:
    """AROUND hook: SGLang's check, without its false attention-TP refusal."""
    try:
        original(server_args)
    except ValueError as exc:
        message = str(exc)
        if not message.startswith(_PREFIX) or not attention_tp_is_one(server_args):
            raise
        items = message[len(_PREFIX):].split(", ")
        if _ATTN_TP_ITEM not in items:
            raise
        items.remove(_ATTN_TP_ITEM)
        if items:
            raise ValueError(_PREFIX + ", ".join(items)) from exc
