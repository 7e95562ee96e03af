"""What the PD router writes into a client's body before it goes upstream: request
ids, the signature return address, and the label it routes by (taken out)."""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from eldr_sglang.core.wire import RETURN_ADDRESS_KEY
from eldr_sglang.router.http.bodies import BadRequest


def set_rid(body: dict, n: Optional[int]) -> list[str]:
    """The request's rid(s), set when the client gave none; BadRequest when malformed."""
    rid = body.get("rid")
    if rid is None:
        rids = [os.urandom(16).hex() for _ in range(n or 1)]  # uuid4().hex's form, cheaper
        body["rid"] = rids if n else rids[0]
        return rids
    if isinstance(rid, str):
        return [rid]  # SGLang expands a batch's str rid to f"{rid}_{i}"; abort matches prefixes
    if isinstance(rid, list) and all(isinstance(r, str) for r in rid) and len(rid) == (n or 1):
        return list(rid)
    raise BadRequest("'rid' must be a string or a list of strings (one per batch item)")


def rids_of(body: dict) -> list[str]:
    rid = body.get("rid")
    return rid if isinstance(rid, list) else [rid]


def _with_address(cp: Any, address: Optional[str]) -> Optional[dict]:
    cp = {k: v for k, v in cp.items() if k != RETURN_ADDRESS_KEY} if isinstance(cp, dict) else {}
    if address:
        cp[RETURN_ADDRESS_KEY] = address
    return cp or None


def set_return_address(body: dict, endpoint: str, address: Optional[str]) -> None:
    """Where the prefill engine sends this request's signature. A client's own value is
    always removed: only the router names where prefill servers connect to."""
    if endpoint != "generate":  # OpenAI routes: SGLang copies custom_params into sampling params
        if address or "custom_params" in body:
            body["custom_params"] = _with_address(body.get("custom_params"), address)
        return
    sp = body.get("sampling_params")
    if sp is None:
        if not address:
            return
        sp = body["sampling_params"] = {}
    for params in (sp if isinstance(sp, list) else [sp]):
        if isinstance(params, dict) and (address or "custom_params" in params):
            params["custom_params"] = _with_address(params.get("custom_params"), address)


def label_of(headers: Mapping[str, str], body: dict, header: Optional[str],
             field: Optional[str]) -> Optional[str]:
    """The request's label: the ``header`` if sent, else the body ``field`` (removed)."""
    if header and header in headers:
        return headers[header]
    if field and field in body:
        return str(body.pop(field))
    return None
