"""Admin API: server membership, calibration reload, decision log, cache flush.

Admin endpoints answer loopback clients only, or, when the router runs with
``--admin-token``, exactly ``Authorization: Bearer <token>`` from anywhere.
``GET /eldr/decisions`` and ``GET /eldr/status`` are admin too: they show other
clients' request ids, labels and the worker addresses. Admin bodies are small (at
most ``ADMIN_BODY_BYTES``).
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Any, Awaitable, Callable, Optional

import orjson
from aiohttp import web

from eldr_sglang.router.http.bodies import ADMIN_BODY_BYTES, ADMIN_BODY_KEY, BodyError, read_body
from eldr_sglang.router.http.clients import bearer_equals
from eldr_sglang.router.config import RouterConfig
from eldr_sglang.router.state.decision_log import DecisionLog
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.router.state.online import OnlineController
from eldr_sglang.router.http.responses import error_response, json_response

logger = logging.getLogger("eldr_sglang.router")


def _prefill_entry(v: Any) -> tuple[str, Any]:
    """``"URL [PORT]"`` or ``[URL, PORT]`` -> (url, port or None)."""
    parts = v.split() if isinstance(v, str) else list(v) if isinstance(v, list) else None
    if not parts or len(parts) > 2 or not isinstance(parts[0], str):
        raise ValueError(f"prefill entry {v!r}: expected \"URL [BOOTSTRAP_PORT]\" or [URL, PORT]")
    port = parts[1] if len(parts) == 2 else None
    if port is not None and str(port).lower() != "none":
        try:
            port = int(port)
        except ValueError:
            raise ValueError(f"prefill entry {v!r}: bootstrap port must be an integer") from None
        if not 0 < port < 65536:
            raise ValueError(f"prefill entry {v!r}: bootstrap port out of range")
    else:
        port = None
    return parts[0], port


class AdminGate:
    """Who may call admin endpoints (:meth:`only` wraps a handler)."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics) -> None:
        self.config, self.metrics = config, metrics

    def allowed(self, request: web.Request) -> bool:
        token = self.config.admin_token
        if token:
            return bearer_equals(request.headers.get("Authorization"), token)
        try:
            return ipaddress.ip_address((request.remote or "").split("%")[0]).is_loopback
        except ValueError:
            return False

    def forbidden(self) -> web.Response:
        self.metrics.errors.labels("admin_forbidden").inc()
        return error_response(403, "admin endpoint: loopback only, or 'Authorization: Bearer "
                                   "<token>' when the router runs with --admin-token")

    def only(self, handler):
        """``handler`` behind the admin check; a body over ``ADMIN_BODY_BYTES`` is 413."""
        async def guarded(request: web.Request) -> web.StreamResponse:
            if not self.allowed(request):
                return self.forbidden()
            try:
                request[ADMIN_BODY_KEY] = await read_body(request, ADMIN_BODY_BYTES,
                                                       self.config.client_body_timeout or None)
            except BodyError as e:
                self.metrics.errors.labels("too_large" if e.status == 413 else "body_timeout").inc()
                return error_response(e.status, str(e))
            return await handler(request)
        return guarded


class AdminApi(AdminGate):
    """The PD router's admin handlers over the parts they change: ``status()`` answers
    a membership change, ``change_servers``/``reload`` apply one, ``fan_out(path,
    method)`` asks every worker."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, decisions: DecisionLog, *,
                 status: Callable[[], dict], change_servers: Callable[..., None],
                 reload: Callable[[str], dict],
                 fan_out: Callable[[str, str], Awaitable[list[tuple[Any, int, Any]]]],
                 online: Optional[OnlineController] = None) -> None:
        super().__init__(config, metrics)
        self.decisions = decisions
        self.status, self.change_servers, self.reload = status, change_servers, reload
        self.fan_out, self.online = fan_out, online

    def _bad(self, message: str) -> web.Response:
        self.metrics.errors.labels("bad_request").inc()
        return error_response(400, message)

    @staticmethod
    async def _body(request: web.Request) -> dict:
        data = orjson.loads(request.get(ADMIN_BODY_KEY) or b"{}")
        if not isinstance(data, dict):
            raise ValueError("body must be a JSON object")
        return data

    async def h_servers(self, request: web.Request) -> web.Response:
        """``{"add": [url], "remove": [url], "add_prefill": ["URL [PORT]"],
        "remove_prefill": [url]}``; all checked before any is applied."""
        try:
            data = await self._body(request)
            for key in ("add", "remove", "add_prefill", "remove_prefill"):
                v = data.get(key, [])
                if not isinstance(v, list):
                    raise ValueError(f"'{key}' must be a list")
            unknown = sorted(set(data) - {"add", "remove", "add_prefill", "remove_prefill"})
            if unknown:
                raise ValueError(f"unknown key(s): {', '.join(unknown)}")
            prefills = [_prefill_entry(v) for v in data.get("add_prefill", [])]
            self.change_servers(add=data.get("add", []), remove=data.get("remove", []),
                                add_prefill=prefills, remove_prefill=data.get("remove_prefill", []))
        except (orjson.JSONDecodeError, ValueError, TypeError) as e:
            return self._bad(str(e))
        return json_response(self.status())

    async def h_calibration(self, request: web.Request) -> web.Response:
        """``POST {"path": "artifact.json"}`` reloads the calibration; ``{"refit": true}``
        asks an ``--online`` router for a refit now (answered at once, 202)."""
        try:
            data = await self._body(request)
            if data.get("refit") is True:
                if self.online is None:
                    raise ValueError("'refit' needs a router started with --online")
                self.online.request_refit()
                return json_response({"refit": "requested", "online": self.online.describe()}, 202)
            path = data.get("path")
            if not isinstance(path, str) or not path:
                raise ValueError("'path' (string) is required")
            out = self.reload(path)
        except (orjson.JSONDecodeError, ValueError, TypeError) as e:
            self.metrics.reloads.labels("refused").inc()
            logger.warning("calibration reload refused: %s", e)
            return self._bad(f"calibration refused, previous kept: {e}")
        return json_response(out)

    async def h_decisions(self, request: web.Request) -> web.Response:
        """The last ``?last=N`` routing decisions (default 20, at most the log's size)."""
        kept = self.decisions.maxlen
        try:
            last = int(request.query.get("last", "20"))
            if not 0 <= last:
                raise ValueError
        except ValueError:
            return self._bad(f"'last' must be an integer 0-{kept}")
        return json_response(self.decisions.recent(last))

    async def h_flush_cache(self, request: web.Request) -> web.Response:
        res = await self.fan_out("flush_cache", "POST")
        bad = {s.url: st for s, st, _ in res if st != 200}
        return json_response({"failed": bad}, 500) if bad else web.Response(status=200)

