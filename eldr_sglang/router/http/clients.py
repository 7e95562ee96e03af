"""What clients meet at the door, as sglang-router does it: API keys, request ids,
OpenAI-shaped error objects on the OpenAI routes."""

from __future__ import annotations

import hmac
import os
import re
from typing import Optional

import orjson
from aiohttp import web

from eldr_sglang.router.http.responses import json_response

REQUEST_ID_KEY = web.RequestKey("eldr_request_id", tuple)  # (header name, value)
REQUEST_ID_MAX = 256
_REQUEST_ID_OK = re.compile(r"[\x21-\x7e]+")  # visible ASCII: safe to forward and echo
OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                413: "invalid_request_error", 422: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable"}


def _header_bytes(value: str) -> bytes:
    """A header value as the bytes that came (aiohttp decodes non-UTF-8 bytes to
    surrogates, which a plain ``encode()`` refuses with UnicodeEncodeError)."""
    return value.encode("utf-8", "surrogateescape")


def bearer_equals(header: Optional[str], secret: str) -> bool:
    """Whether an ``Authorization`` value is exactly ``Bearer <secret>`` (constant time;
    any bytes, non-ASCII included, are just a mismatch)."""
    try:
        got = _header_bytes(header or "")
    except UnicodeEncodeError:  # a lone surrogate that was not a decoded byte
        return False
    return hmac.compare_digest(got, f"Bearer {secret}".encode())


def bearer_matches(request: web.Request, key: str) -> bool:
    """``Authorization: Bearer <key>`` exactly (constant-time comparison)."""
    return bearer_equals(request.headers.get("Authorization"), key)


def unauthorized() -> web.Response:
    return json_response({"error": "missing or wrong API key: send 'Authorization: Bearer "
                                   "<key>'"}, 401, {"WWW-Authenticate": "Bearer"})


class RequestIds:
    """The request id of a client request: the first configured header the client sent
    (a value of visible ASCII, at most 256 characters), else a new one under the
    first configured name."""

    def __init__(self, names: str) -> None:
        self.names = [n.strip().lower() for n in names.split(",") if n.strip()] or ["x-request-id"]

    def of(self, request: web.Request) -> tuple[str, str]:
        for name in self.names:
            value = request.headers.get(name)
            if value and len(value) <= REQUEST_ID_MAX and _REQUEST_ID_OK.fullmatch(value):
                return name, value
        return self.names[0], os.urandom(16).hex()


def request_id_header(request: web.Request) -> Optional[tuple[str, str]]:
    return request.get(REQUEST_ID_KEY)


def openai_error_type(status: int) -> str:
    return OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def as_openai_error(resp: web.Response) -> web.Response:
    """A JSON error answer reshaped to ``{"error": {"message", "type", "code"}}``
    (other fields kept); answers that are not JSON objects are left alone."""
    try:
        body = orjson.loads(resp.body) if isinstance(resp.body, (bytes, bytearray)) else None
    except orjson.JSONDecodeError:
        return resp
    if not isinstance(body, dict):
        return resp
    err = body.get("error")
    status = resp.status
    if isinstance(err, dict) and "message" in err:
        err = {"type": openai_error_type(status), "code": status, **err}
    else:
        message = err if isinstance(err, str) else body.get("message") or body.get("detail")
        kind = body.get("type") if isinstance(body.get("type"), str) else openai_error_type(status)
        err = {"message": str(message or f"HTTP {status}"), "type": kind, "code": status}
    body["error"] = err
    resp.body = orjson.dumps(body)
    return resp


async def with_client_conventions(request: web.Request, guarded, *, keyed_paths, guards,
                                  request_ids: "RequestIds", api_key: Optional[str],
                                  unauthorized_counter) -> web.StreamResponse:
    """The client conventions around ``guarded(request)``: API key, request id (echoed),
    OpenAI-shaped errors on ``/v1/*``; the header time limit stops once a request starts."""
    guards.started(request)
    try:
        path = request.path
        if path not in keyed_paths and not path.startswith("/v1/"):
            return await guarded(request)
        rid = request[REQUEST_ID_KEY] = request_ids.of(request)
        if api_key and not bearer_matches(request, api_key):
            unauthorized_counter.inc()
            resp = unauthorized()
        else:
            resp = await guarded(request)
        if not resp.prepared:  # a stream sets the header itself before its first byte
            resp.headers[rid[0]] = rid[1]
            if path.startswith("/v1/") and resp.status >= 400 and isinstance(resp, web.Response):
                resp = as_openai_error(resp)
        return resp
    finally:
        guards.ended(request)
