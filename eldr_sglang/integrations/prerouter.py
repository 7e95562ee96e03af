"""The thin HTTP pre-router both integrations share.

It sits in front of the host router (Dynamo's frontend, SMG) and, per request:

1. reads the body, asks the scorer for the ELDR decision (predicted signature ->
   policy over the host's decode workers, :mod:`.scorer`);
2. forwards the unchanged body to the host router with the headers that pin that
   decode worker there (:meth:`PreRouter.pin_headers`, the integration's part);
3. relays the answer (streamed or not).

Failure never fails a request: a scorer that raises, times out or has no answer, a
worker the integration cannot pin yet, and a pinned request that the host refuses
because the pinned worker is gone (``repin_statuses``, before any byte reached the
client) all go to the host router unpinned: its own choice. Each request's decision
is recorded (``decisions``, ``GET /eldr/adapter/status``) and returned in the
response headers ``X-ELDR-Worker`` (the pinned worker, ``-`` when the host chose)
and ``X-ELDR-Path`` (pinned | fallback reason). Every other path (``/v1/models``,
``/health``, ...) is proxied unchanged.

The worker list is the integration's (:meth:`PreRouter.discover`, polled every
``refresh_s``); a worker the host no longer lists leaves the policy's server list.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any, Optional

import aiohttp
import orjson
from aiohttp import web

from eldr_sglang.router.http.bodies import BodyError, BodyParser
from eldr_sglang.router.http.prompt_view import prompt_view
from eldr_sglang.integrations.scorer import Choice, ScorerAnswerError, header_safe

logger = logging.getLogger("eldr_sglang.integrations")
WORK = {"/generate": "generate", "/v1/completions": "v1/completions",
        "/v1/chat/completions": "v1/chat/completions"}
HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade",
       "proxy-connection", "te", "trailer"}
JSON = "application/json"


class PreRouter:
    """Base class: subclasses implement :meth:`discover` and :meth:`pin_headers`."""

    kind = "base"
    repin_statuses: frozenset[int] = frozenset()

    def __init__(self, host_url: str, scorer: Any, *, refresh_s: float = 2.0, request_timeout: float = 600.0,
                 scorer_timeout: float = 0.25, quarantine_s: float = 30.0, record: int = 10000,
                 control_token: Optional[str] = None, api_key: Optional[str] = None,
                 max_batch: int = 256) -> None:
        self.host_url = host_url.rstrip("/")
        # bearer tokens for the pre-router's own calls: control plane (worker listing), data plane (probes)
        self.control_headers = {"Authorization": f"Bearer {control_token}"} if control_token else {}
        self.api_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.scorer = scorer
        self.refresh_s, self.scorer_timeout, self.quarantine_s = refresh_s, scorer_timeout, quarantine_s
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=request_timeout)
        self.workers: list[str] = []  # decode workers the host lists now (adapter keys)
        self.inflight: dict[str, int] = collections.defaultdict(int)
        self.quarantined: dict[str, float] = {}  # worker -> until (monotonic)
        self.counters: collections.Counter = collections.Counter()
        self.decisions: collections.deque = collections.deque(maxlen=record)
        self.added_s: collections.deque = collections.deque(maxlen=record)  # decision time per request
        self.session: Optional[aiohttp.ClientSession] = None
        self.discovered = asyncio.Event()
        self.parser, self.max_batch = BodyParser(), max_batch
        self._task: Optional[asyncio.Task] = None
        self._seq = 0

    # ------------------------------------------------------------------ integration hooks
    async def discover(self) -> None:
        """Refresh :attr:`workers` (and whatever the pin needs) from the host router."""
        raise NotImplementedError

    def pin_headers(self, choice: Choice) -> Optional[dict[str, str]]:
        """Headers that pin ``choice.worker`` in the host router; None: cannot pin it now."""
        raise NotImplementedError

    def describe(self) -> dict:
        return {}

    def refusal(self, status: int, detail: bytes, pin: dict[str, str]) -> str:
        """Why the host refused a pinned request (status in ``repin_statuses``): 'refused'
        (the pinned worker: quarantined if the unpinned retry succeeds) or another word
        ('busy': load, not the worker) for a retry unpinned that quarantines nothing."""
        return "refused"

    def pin_started(self, pin: dict[str, str]) -> None:
        """A request pinned with ``pin`` goes to the host (integrations that track pins)."""

    def pin_ended(self, pin: dict[str, str]) -> None:
        """The host answered the request pinned with ``pin`` (or it failed)."""

    # ------------------------------------------------------------------ worker list
    def set_workers(self, workers: list[str]) -> None:
        now = time.monotonic()
        self.quarantined = {w: t for w, t in self.quarantined.items() if t > now and w in workers}
        if workers != self.workers:
            logger.info("%s decode workers: %s", self.kind, workers)
        self.workers = list(workers)
        self.discovered.set()

    def pinnable(self) -> list[str]:
        now = time.monotonic()
        return [w for w in self.workers if self.quarantined.get(w, 0.0) <= now]

    async def _refresh_loop(self) -> None:
        while True:
            try:
                await self.discover()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 -- keep the last list, say why
                self.counters["discovery_errors"] += 1
                logger.warning("%s discovery failed: %r", self.kind, e)
            await asyncio.sleep(self.refresh_s)

    # ------------------------------------------------------------------ the decision
    async def decide(self, body: Any, endpoint: str) -> tuple[Optional[Choice], str]:
        """(choice, path): path is 'pinned' or why the host chooses (a fallback)."""
        if not isinstance(body, dict):
            return None, "fallback_body"
        workers = self.pinnable()
        if not workers:
            return None, "fallback_no_workers"
        try:
            call = self.scorer.choose(body, endpoint, workers, dict(self.inflight))
            # a remote scorer gets a time limit; the local one does no I/O (no task needed)
            choice = await (asyncio.wait_for(call, self.scorer_timeout) if getattr(self.scorer, "remote", False)
                            else call)
        except asyncio.TimeoutError:
            return None, "fallback_scorer_timeout"
        except ScorerAnswerError as e:
            logger.debug("scorer answer refused: %s", e)
            return None, "fallback_scorer_invalid"
        except Exception as e:  # noqa: BLE001 -- the adapter's own failure: the host chooses
            logger.debug("scorer failed: %r", e)
            return None, "fallback_scorer_error"
        if choice is None:
            return None, "fallback_no_prediction"
        return choice, "pinned"

    # ------------------------------------------------------------------ request path
    async def handle(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        raw = await request.read()
        endpoint = WORK[request.path]
        try:  # the routers' bounded view, off the loop when big; a body it refuses goes unpinned
            out = await self.parser.run(prompt_view, raw, endpoint, self.max_batch)
        except BodyError:  # the parser queue is full: the host chooses
            out = ("error",)
        body = out[1] if out[0] == "ok" else None
        choice, path = await self.decide(body, endpoint)
        headers = self._forward_headers(request)
        if raw.lstrip()[:1] == b"{" and not any(k.lower() == "content-type" for k in headers):
            headers["Content-Type"] = JSON  # a JSON body without its type: hosts (SMG) want it
        pin = None
        if choice is not None:
            try:
                pin = self.pin_headers(choice)
            except Exception as e:  # noqa: BLE001
                logger.debug("pin failed: %r", e)
            if pin is not None and not all(header_safe(k, 256) and header_safe(v) for k, v in pin.items()):
                self.counters["pin_unsafe"] += 1  # never let a pin break the request (header injection)
                pin = None
            if pin is None:
                self.scorer.release(choice)
                choice, path = None, "fallback_no_pin"
        self.added_s.append(time.perf_counter() - t0)
        self.counters[path] += 1
        rid = request.headers.get("X-Request-Id") or f"eldr-adapter-{self._next()}"
        record = {"rid": rid, "worker": choice.worker if choice else None, "path": path,
                  "region": choice.region if choice else None, "status": None, "retried": False}
        self.decisions.append(record)
        counted = choice is not None
        if counted:
            self.inflight[choice.worker] += 1
        if pin:
            self.pin_started(pin)
        why = "refused"
        try:
            try:
                resp = await self._send(request.method, request.path_qs, raw, {**headers, **(pin or {})})
            finally:
                if pin:
                    self.pin_ended(pin)
            if choice is not None and resp is not None and resp.status in self.repin_statuses:
                try:
                    detail = await resp.content.read(4096)
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    detail = b""
                resp.release()
                pinned_status = resp.status
                why = self.refusal(pinned_status, detail, pin or {})
                self.counters["retried_unpinned" if why == "refused" else f"pinned_{why}"] += 1
                record["retried"] = True
                self.inflight[choice.worker] -= 1  # the retry is the host's, not this worker's
                counted = False
                resp = await self._send(request.method, request.path_qs, raw, headers)
                if why == "refused" and resp is not None and resp.status < 400:  # the pin was refused
                    logger.warning("%s refused pinned worker %s (%s %r): quarantined, host's choice",
                                   self.kind, choice.worker, pinned_status, detail[:200])
                    self._quarantine(choice.worker)
            if resp is None:
                record["status"] = 502
                return _error(502, f"host router {self.host_url} unreachable")
            record["status"] = resp.status
            shown = str(record["worker"]) if not record["retried"] and choice else "-"
            out_headers = {"X-ELDR-Worker": shown if header_safe(shown) else "?",
                           "X-ELDR-Path": (("retried_unpinned" if why == "refused" else f"retried_{why}")
                                           if record["retried"] else path)}
            return await self._relay(request, resp, out_headers)
        finally:
            if counted:
                self.inflight[choice.worker] -= 1
            if choice is not None:
                self.scorer.release(choice)

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _quarantine(self, worker: str) -> None:
        self.quarantined[worker] = time.monotonic() + self.quarantine_s

    @staticmethod
    def _forward_headers(request: web.Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() not in HOP}

    async def _send(self, method: str, path: str, raw: bytes, headers: dict) -> Optional[aiohttp.ClientResponse]:
        try:
            return await self.session.request(method, self.host_url + path, data=raw, headers=headers,
                                              allow_redirects=False)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            logger.warning("host router %s: %r", self.host_url, e)
            return None

    async def _relay(self, request: web.Request, resp: aiohttp.ClientResponse,
                     extra: dict[str, str]) -> web.StreamResponse:
        try:
            ctype = resp.headers.get("Content-Type", JSON)
            if not ctype.startswith("text/event-stream"):
                data = await resp.read()
                return web.Response(body=data, status=resp.status, headers={"Content-Type": ctype, **extra})
            out = web.StreamResponse(status=resp.status, headers={"Content-Type": ctype,
                                                                  "Cache-Control": "no-cache", **extra})
            await out.prepare(request)
            try:
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
            except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                self.counters["client_disconnects"] += 1
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self.counters["stream_errors"] += 1
                logger.warning("stream from host broken: %r", e)
            return out
        finally:
            resp.release()

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        """Any other path: passed to the host router unchanged."""
        raw = await request.read()
        resp = await self._send(request.method, request.path_qs, raw, self._forward_headers(request))
        if resp is None:
            return _error(502, f"host router {self.host_url} unreachable")
        return await self._relay(request, resp, {})

    async def h_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status())

    def status(self) -> dict:
        added = sorted(self.added_s)
        pct = (lambda q: round(1e3 * added[min(len(added) - 1, int(q * len(added)))], 4)) if added else None
        return {"kind": self.kind, "host": self.host_url, "workers": self.workers,
                "quarantined": sorted(self.quarantined), "inflight": dict(self.inflight),
                "counters": dict(self.counters),
                # time from the request's body read to the forward (decision + pin), this process
                "decision_ms": {"n": len(added), "p50": pct(0.5) if pct else None,
                                "p99": pct(0.99) if pct else None},
                **self.describe()}

    # ------------------------------------------------------------------ lifecycle
    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        for path in WORK:
            app.router.add_post(path, self.handle)
        app.router.add_get("/eldr/adapter/status", self.h_status)
        app.router.add_route("*", "/{tail:.*}", self.proxy)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        await self.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        await self.stop()

    async def start(self) -> None:
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=self.timeout,
                                                 connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30))
        if hasattr(self.scorer, "start"):
            await self.scorer.start()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._refresh_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if hasattr(self.scorer, "close"):
            await self.scorer.close()
        if self.session is not None:
            await self.session.close()
            self.session = None
        self.parser.close()


def _error(status: int, message: str) -> web.Response:
    return web.Response(body=orjson.dumps({"error": {"message": message, "type": "adapter_error"}}),
                        status=status, content_type=JSON)


async def serve(prerouter: PreRouter, host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, int]:
    """Start ``prerouter`` on host:port (0: a free port); returns (runner, port)."""
    runner = web.AppRunner(prerouter.build_app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]
