"""Operator conventions beside sglang-router's: CORS for browser clients
(``--cors-origins``), an access log (``--access-log``) and JSON log lines
(``--log-format json``).

:func:`install` adds them to a router's ``web.Application``: an outermost middleware
(access log; CORS preflights answered before the API-key check, as a preflight carries
no credentials) and a response-prepare hook that sets the CORS headers on every
answer, streams included (their headers leave before the handler returns).
"""

from __future__ import annotations

import logging
import sys
import time
import urllib.parse
from typing import Any, Optional

from aiohttp import web

from eldr_sglang.router.http.clients import REQUEST_ID_KEY

ACCESS_LOGGER = "eldr_sglang.router.access"
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
JSON_FIELDS = "%(asctime)s %(levelname)s %(name)s %(process)d %(message)s"
PREFLIGHT_MAX_AGE_S = 600
CORS_METHODS = "GET, POST, OPTIONS"
CORS_EXPOSED = "Retry-After, X-Request-Id"  # with the configured request-id headers


def cors_origins_of(value: Optional[str]) -> frozenset[str]:
    """``--cors-origins``: comma-separated ``scheme://host[:port]`` origins or ``*``;
    ValueError naming ``cors_origins`` for anything else."""
    if value is None:
        return frozenset()
    origins = [o.strip().rstrip("/") for o in value.split(",") if o.strip()]
    if not origins:
        raise ValueError("cors_origins: give at least one origin (https://app.example) or '*'")
    for origin in origins:
        if origin == "*":
            continue
        u = urllib.parse.urlsplit(origin)
        try:
            u.port
        except ValueError:
            raise ValueError(f"cors_origins: {origin!r} has a bad port") from None
        if u.scheme not in ("http", "https") or not u.hostname or u.path or u.query or u.username:
            raise ValueError(f"cors_origins: {origin!r} is not an origin (scheme://host[:port], or '*')")
    return frozenset(origins)


def install(app: web.Application, config: Any, request_id_headers: str = "") -> None:
    """Add CORS (``config.cors_origins``) and the access log (``config.access_log``) to ``app``."""
    origins = cors_origins_of(getattr(config, "cors_origins", None))
    exposed = ", ".join(dict.fromkeys([*CORS_EXPOSED.split(", "),
                                       *(h.strip() for h in request_id_headers.split(",") if h.strip())]))
    if origins:
        app.middlewares.insert(0, _preflight(origins))

        async def cors_headers(request: web.Request, response: web.StreamResponse) -> None:
            origin = _allowed(request, origins)
            if origin is not None and "Access-Control-Allow-Origin" not in response.headers:
                response.headers["Access-Control-Allow-Origin"] = origin
                response.headers["Access-Control-Expose-Headers"] = exposed
                if origin != "*":
                    response.headers.add("Vary", "Origin")  # beside any Vary of the handler's

        app.on_response_prepare.append(cors_headers)
    if getattr(config, "access_log", False):  # outermost: preflights are logged too
        app.middlewares.insert(0, _access_log(logging.getLogger(ACCESS_LOGGER)))


def _allowed(request: web.Request, origins: frozenset[str]) -> Optional[str]:
    """The Allow-Origin value for this request, None when its origin is not allowed."""
    origin = request.headers.get("Origin")
    if origin is None:
        return None
    if origin.rstrip("/") in origins:
        return origin
    return "*" if "*" in origins else None


def _preflight(origins: frozenset[str]):
    @web.middleware
    async def preflight(request: web.Request, handler) -> web.StreamResponse:
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        if _allowed(request, origins) is None:
            return web.json_response({"error": "origin not allowed (--cors-origins)"}, status=403)
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": CORS_METHODS,
            "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", ""),
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S)})
    return preflight


def _access_log(log: logging.Logger):
    @web.middleware
    async def access_log(request: web.Request, handler) -> web.StreamResponse:
        start = time.perf_counter()
        status = 500
        response: Optional[web.StreamResponse] = None
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        finally:
            rid = request.get(REQUEST_ID_KEY)
            body = getattr(response, "body", None)
            sent = response.body_length if response is not None and response.prepared else (
                len(body) if isinstance(body, (bytes, bytearray)) else 0)
            fields = {"remote": request.remote, "method": request.method, "path": request.path,
                      "status": status, "duration_ms": round((time.perf_counter() - start) * 1000, 3),
                      "bytes": sent, "request_id": rid[1] if rid else None}
            log.info("%s %s %s %d %.3f ms %d B%s", fields["remote"], fields["method"], fields["path"], status,
                     fields["duration_ms"], sent, f" id={fields['request_id']}" if rid else "", extra=fields)
    return access_log


def setup_logging(level: str, fmt: str = "text") -> None:
    """Root logging to stderr: ``text`` lines or one JSON object per line (``json``:
    time, level, logger, process, message, and an access line's fields)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log_format: {fmt!r} is not one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(JsonFormatter(JSON_FIELDS, rename_fields={
            "asctime": "time", "levelname": "level", "name": "logger"}))
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
