"""The ``http``/``https`` signature transport: one ``POST`` (a JSON list, ``X-Eldr-Hmac``
when signed) per batch on a kept-alive connection; an answer of 400 or more is a failure.
Its listener is the intake's ``POST /eldr/signature`` on a port of its own (a router
serves the same handler on its client port)."""

from __future__ import annotations

import http.client
import urllib.parse
from typing import Any, Optional

from eldr_sglang.core import wire
from eldr_sglang.transports.registry import Destination, register_transport

PATH = "/eldr/signature"


def parse(url: str, parts: urllib.parse.SplitResult) -> Destination:
    if not parts.hostname:
        raise ValueError("no host")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return Destination(url, parts.scheme, parts.hostname, port,
                       (parts.path or "/") + (f"?{parts.query}" if parts.query else ""))


class HttpSender:
    def __init__(self, dest: Destination, timeout: float, key: Optional[bytes]) -> None:
        self.dest, self.timeout, self.key = dest, timeout, key
        self.conn: Optional[http.client.HTTPConnection] = None
        self.connects = 0

    def send(self, batch: list[dict]) -> None:
        if self.conn is None:
            cls = http.client.HTTPSConnection if self.dest.scheme == "https" else http.client.HTTPConnection
            self.conn = cls(self.dest.host, self.dest.port, timeout=self.timeout)
            self.connects += 1
        body, headers = wire.http_body(batch, self.key)
        self.conn.request("POST", self.dest.path, body=body, headers=headers)
        resp = self.conn.getresponse()
        resp.read()
        if resp.status >= 400:
            raise RuntimeError(f"router answered HTTP {resp.status}")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class HttpListener:
    """``POST /eldr/signature`` into ``intake.h_signature`` on a port of its own."""

    def __init__(self, intake: Any) -> None:
        self.intake = intake
        self.port: Optional[int] = None
        self._runner = None

    async def start(self, host: str, port: int) -> int:
        from aiohttp import web

        app = web.Application(client_max_size=max(1 << 20, getattr(self.intake, "max_bytes", 0)))
        app.router.add_post(PATH, self.intake.h_signature)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self.port

    def address(self, host: str) -> str:
        return f"http://{host}:{self.port}{PATH}"

    def close(self) -> None:
        pass  # wait_closed stops the site

    async def wait_closed(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()


for _scheme in ("http", "https"):
    register_transport(_scheme, HttpSender, HttpListener, parse=parse, example="http(s)://host[:port]/path")
