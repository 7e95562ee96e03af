"""Signature messages of SGLang requests (router, ``meta_info``, traces): the wire
contract (:mod:`eldr_sglang.core.wire`) read from and built for a ``Req``."""

from __future__ import annotations

import torch

from eldr_sglang.core import wire
from eldr_sglang.core.wire import META_KEY  # noqa: F401 (the engine hooks' key)


def signature_message(req, counts: torch.Tensor, layers: list[int], packed: bool = False,
                      model: dict | None = None) -> dict:
    """The router's message of ``req`` (:func:`eldr_sglang.core.wire.build_message`)."""
    return wire.build_message(req.bootstrap_room, req.rid, len(req.origin_input_ids),
                              int(getattr(req, "cached_tokens", 0) or 0), layers,
                              counts.cpu().numpy(), packed=packed, model=model)


def _custom_params(req):
    return getattr(getattr(req, "sampling_params", None), "custom_params", None)


def return_address(req) -> str | None:
    """Where the request's router wants its signature, else None (the ``--eldr-publish``
    address); malformed means None."""
    return wire.return_address(_custom_params(req))


def wants_signature(req) -> bool:
    return wire.wants_signature(_custom_params(req))
