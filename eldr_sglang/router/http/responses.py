"""JSON answers of the router: every error is ``{"error": ...}`` with a 4xx/5xx status."""

from __future__ import annotations

from typing import Any, Optional

import orjson
from aiohttp import web

JSON = "application/json"


def json_response(obj: Any, status: int = 200, headers: Optional[dict] = None) -> web.Response:
    return web.Response(body=orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY),
                        status=status, content_type=JSON, headers=headers)


def error_response(status: int, message: str, retry_after: Optional[float] = None) -> web.Response:
    headers = {"Retry-After": f"{max(1, round(retry_after))}"} if retry_after is not None else None
    return json_response({"error": message}, status, headers)


def worker_error_response(status: int, body: bytes, role: str) -> web.Response:
    """A worker's error answer with its status code, always carrying an ``error`` key.

    SGLang answers an aborted request with FastAPI's ``{"detail": ...}`` and its
    OpenAI routes with ``{"object": "error", "message": ...}``; clients of the router
    get those fields unchanged plus ``error`` naming the worker's role (never its
    address)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        obj = None
    if isinstance(obj, dict) and "error" in obj:
        return json_response(obj, status)
    if isinstance(obj, dict):
        message = obj.get("message") or obj.get("detail") or f"HTTP {status}"
        return json_response({**obj, "error": f"{role} server: {message}"}, status)
    text = body.decode("utf-8", "replace")[:2000].strip() or f"HTTP {status}"
    return error_response(status, f"{role} server: {text}")


def error_in_body(body: bytes) -> Optional[str]:
    """The error a 200 answer carries inside (SGLang reports a failure that happens
    after a stream started as a ``data: {"error": ...}`` event), else None."""
    if b'"error"' not in body:
        return None
    lines = [ln[5:].strip() for ln in body.split(b"\n") if ln.startswith(b"data:")] or [body]
    for ln in lines:
        try:
            obj = orjson.loads(ln)
        except orjson.JSONDecodeError:
            continue
        if isinstance(obj, dict) and obj.get("error"):
            err = obj["error"]
            return str(err.get("message", err) if isinstance(err, dict) else err)
    return None
