"""Signature messages: what the engine sends (router, ``meta_info``, traces).

``{"bootstrap_room", "rid", "prompt_tokens", "cached_tokens", "layers", "counts"}``
(+ ``"model"`` when published), and where a request wants its own sent.
"""

from __future__ import annotations

import torch

from eldr_sglang.core.counts_codec import pack_counts
from eldr_sglang.patches.publish import RETURN_ADDRESS_KEY

META_KEY = "eldr_signature"


def signature_message(req, counts: torch.Tensor, layers: list[int], packed: bool = False,
                      model: dict | None = None) -> dict:
    """The router's message; ``packed`` sends counts as a base64 array (publishing),
    else as lists of rows (traces, ``meta_info``). ``model`` lets a router without an
    artifact (``--online``) name the model of the artifact it fits."""
    msg = {
        "bootstrap_room": req.bootstrap_room,
        "rid": req.rid,
        "prompt_tokens": len(req.origin_input_ids),
        "cached_tokens": int(getattr(req, "cached_tokens", 0) or 0),
        "layers": layers,
        "counts": pack_counts(counts.cpu().numpy()) if packed else counts.cpu().tolist(),
    }
    if model is not None:
        msg["model"] = model
    return msg


def return_address(req) -> str | None:
    """Where the request's router wants its signature (``custom_params[RETURN_ADDRESS_KEY]``,
    set by the router), else None (the ``--eldr-publish`` address); malformed means None."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    dest = params.get(RETURN_ADDRESS_KEY) if isinstance(params, dict) else None
    return dest if isinstance(dest, str) and dest else None


def wants_signature(req) -> bool:
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return isinstance(params, dict) and bool(params.get(META_KEY))
