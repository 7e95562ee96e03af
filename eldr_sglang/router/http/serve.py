"""Serving a router on a port: one aiohttp runner and site for the PD router and the
co-located one alike."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from eldr_sglang.router.http.client_guard import GuardedSite
from eldr_sglang.router.http.malformed import server_logger

CLIENT_KEEPALIVE_S = 75.0  # idle keep-alive client connections (aiohttp's default: an hour)


async def start_router(router: Any, host: str = "127.0.0.1", port: int = 0,
                       reuse_port: bool = False) -> tuple[web.AppRunner, int]:
    """Start ``router`` on host:port (0 = any free port); returns (runner, port).

    ``router``: any object with ``build_app`` and ``start_background``/``stop_background``
    (:class:`~eldr_sglang.router.app.Router`, the co-located router); connections go
    through its ``guards`` (header time limit) when it has them."""
    app = router.build_app()

    async def on_startup(_: web.Application) -> None:
        await router.start_background(host)

    async def on_cleanup(_: web.Application) -> None:
        await router.stop_background()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0,
                           keepalive_timeout=CLIENT_KEEPALIVE_S, logger=server_logger())
    await runner.setup()
    guards = getattr(router, "guards", None)
    site = (GuardedSite(runner, guards, host, port, reuse_port=reuse_port) if guards is not None
            else web.TCPSite(runner, host, port, reuse_port=reuse_port or None))
    try:
        await site.start()
    except OSError:
        await runner.cleanup()  # close the worker session and the signature stream
        raise
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
