"""Everything after a worker is chosen, for both request flows: its answer relayed to
the client (in PD, once the prefill is known to have succeeded), worker failures
turned into the client's answer, and aborts of a request on the workers it was
written to. A co-located flight has no prefill (``prefill_task`` None)."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import orjson
from aiohttp import web

from eldr_sglang.router.pool import upstream
from eldr_sglang.router.config import RouterConfig
from eldr_sglang.router.flow.dispatch_parts import Flight, PrefillResult
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.router.http.responses import JSON, error_response, worker_error_response
from eldr_sglang.router.runtime import Runtime
from eldr_sglang.router.pool.workers import Worker, WorkerPool

logger = logging.getLogger("eldr_sglang.router")
ABORT_TIMEOUT = 5.0
DONE = b"data: [DONE]"  # a stream's last event: a client may close as soon as it has read it


class Relay:
    def __init__(self, config: RouterConfig, metrics: RouterMetrics, pool: WorkerPool,
                 runtime: Runtime) -> None:
        self.config, self.metrics, self.pool, self.runtime = config, metrics, pool, runtime

    # ------------------------------------------------------------ answers
    def prefill_error(self, res: PrefillResult) -> web.Response:
        """A failed prefill as the client's answer (503 when it may be retried)."""
        self.metrics.event("prefill_errors_returned")
        if res.status == 0:
            unavailable = res.local or "unreachable" in res.error
            return error_response(503 if unavailable else 502, res.error,
                                  self.config.retry_after if unavailable else None)
        if res.status == 200:  # an error inside a 200 stream
            return error_response(502, f"prefill server failed: {res.error}")
        return worker_error_response(res.status, res.body, "prefill")

    def decode_failed(self, d: Worker, ticket, e: upstream.UpstreamError, fl: Flight) -> web.Response:
        self.abort_sent(fl, [fl.prefill] + ([] if isinstance(e, upstream.ConnectError) else [d]))
        if isinstance(e, upstream.LocalResourceError):
            self.metrics.errors.labels("saturated" if isinstance(e, upstream.Saturated)
                                    else "local_resources").inc()
            logger.warning("%s %s: %s", d.role, d.url, e)
            return error_response(503, f"router out of resources: {e.public}", self.config.retry_after)
        if isinstance(e, upstream.ConnectError):
            self.pool.failure(d, ticket, repr(e), "connect", hard=True)
            return error_response(503, f"{d.role} server unavailable: {e.public}", self.config.retry_after)
        timeout = isinstance(e, upstream.Timeout)
        self.pool.failure(d, ticket, repr(e), "timeout" if timeout else "disconnect", hard=True)
        return error_response(504 if timeout else 502, f"{d.role} server failed: {e.public}")

    # ------------------------------------------------------------ relay
    async def relay(self, request: web.Request, resp: upstream.UpstreamResponse, d: Worker,
                    ticket, fl: Flight) -> web.StreamResponse:
        """The decode answer, once the prefill is known to have succeeded.

        Worker error statuses pass through (JSON bodies as they are); a decode server
        that fails mid-answer gives 502/504 JSON (non-stream) or a final SSE error event."""
        pool, prefill_task = self.pool, fl.prefill_task
        if resp.status != 200:
            try:
                data = await resp.read()
            except upstream.UpstreamError as e:
                data = e.public.encode()
            if resp.status >= 500:
                pool.failure(d, ticket, f"HTTP {resp.status}: {data[:200]!r}", "http_5xx")
            else:
                pool.success(d, ticket)
                self.metrics.worker_errors.labels(d.role, d.url, "http_4xx").inc()
            self.abort_sent(fl, [fl.prefill])
            return worker_error_response(resp.status, data, d.role)
        if prefill_task is None:  # co-located: no prefill to wait for
            if not fl.stream:
                try:
                    data = await resp.read()
                except upstream.UpstreamError as e:
                    return self.decode_failed(d, ticket, e, fl)
                pool.success(d, ticket)
                return web.Response(body=data, status=200, content_type=JSON)
            return await self._stream(request, resp, d, ticket, fl)
        if not fl.stream:
            read = asyncio.ensure_future(resp.read())
            try:
                if not prefill_task.done():  # a prefill failing meanwhile stops the decode
                    await asyncio.wait({read, prefill_task}, return_when=asyncio.FIRST_COMPLETED)
                if prefill_task.done() and not read.done() and not prefill_task.result().ok:
                    self.abort_sent(fl, [d])
                    return self.prefill_error(prefill_task.result())
                data = await read
            except upstream.UpstreamError as e:
                return self.decode_failed(d, ticket, e, fl)
            finally:
                read.cancel()
            pool.success(d, ticket)
            res = await asyncio.shield(prefill_task)  # it ends on its own: worker timeouts bound it
            if not res.ok:
                return self.prefill_error(res)
            return web.Response(body=data, status=200, content_type=JSON)
        res = await asyncio.shield(prefill_task)  # before the first byte goes out
        if not res.ok:
            self.abort_sent(fl, [d])
            return self.prefill_error(res)
        return await self._stream(request, resp, d, ticket, fl)

    async def _stream(self, request: web.Request, resp: upstream.UpstreamResponse, d: Worker,
                      ticket, fl: Flight) -> web.StreamResponse:
        pool = self.pool
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        if fl.headers:
            headers.update(fl.headers)  # the request id, echoed
        out = web.StreamResponse(status=200, headers=headers)
        await out.prepare(request)
        tail = b""
        try:
            async for chunk in resp.iter_chunks():
                await out.write(chunk)
                tail = (tail + chunk)[-len(DONE) - 8:]
                fl.finished = fl.finished or DONE in tail
            fl.finished = True
            await out.write_eof()
            pool.success(d, ticket)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            if fl.finished:  # the client read the last event and closed: a finished request
                pool.success(d, ticket)
                return out
            self.metrics.event("client_disconnects")
            self.abort_sent(fl, [fl.prefill, d])
        except asyncio.CancelledError:  # the client closed (handler cancellation)
            if fl.finished:
                pool.success(d, ticket)
            raise
        except upstream.UpstreamError as e:
            timeout = isinstance(e, upstream.Timeout)
            pool.failure(d, ticket, f"stream broken: {e!r}", "timeout" if timeout else "stream",
                         hard=timeout)
            self.abort_sent(fl, [d])
            err = {"error": {"message": f"{d.role} server failed mid-stream: {e.public}",
                             "type": "upstream_error", "code": 504 if timeout else 502}}
            try:
                await out.write(b"data: " + orjson.dumps(err) + b"\n\n")
                await out.write_eof()
            except (ConnectionResetError, aiohttp.ClientConnectionResetError, RuntimeError):
                pass
        return out

    # ------------------------------------------------------------ aborts
    def abort_sent(self, fl: Flight, servers: list[Worker]) -> None:
        """Abort the flight's rids on those of ``servers`` the request was written to."""
        sent = [s for s in servers if s is not None and id(s) in fl.sent]
        if sent and fl.rids:
            self.runtime.spawn(self.abort(fl.rids, sent))

    async def abort(self, rids: list[str], servers: list[Worker]) -> None:
        """Best-effort ``/abort_request`` for every rid on every server."""
        self.metrics.event("aborts")
        timeout = aiohttp.ClientTimeout(total=ABORT_TIMEOUT)

        async def one(s: Worker, rid: str) -> None:
            try:
                async with self.runtime.session.post(s.endpoint("abort_request"), json={"rid": rid},
                                                  timeout=timeout) as resp:
                    await resp.read()
            except Exception as e:  # noqa: BLE001 - best effort
                logger.info("abort %s on %s failed: %r", rid, s.url, e)

        await asyncio.gather(*(one(s, rid) for s in servers for rid in rids))
