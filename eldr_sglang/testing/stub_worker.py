"""A fake SGLang PD worker (prefill or decode) for router tests and benchmarks.

In-process::

    w = StubWorker("prefill", signature_url="http://127.0.0.1:8000/eldr/signature")
    url = await w.start()          # picks a free port
    ...; await w.stop()

As a script::

    python -m eldr_sglang.testing.stub_worker --role decode --port 30001 --latency 0.05 --stream-delay 0.01

Failure knobs (constructor args and CLI flags, in the spirit of vLLM's mock worker):
``latency`` (s before answering), ``fail_first`` (the first N requests answer HTTP
``fail_status``), ``fail_rate`` (share of requests answered ``fail_status``),
``fail_body`` (what a failure answers: "error" ``{"error": {...}}``, "detail"
SGLang's abort answer ``{"detail": ...}``, "text" plain text), ``crash_on`` (the Nth request crashes the worker: ``crash_mode`` "drop" closes
that connection without an answer, "stop" stops the whole server, "exit" ends the
process -- the CLI default), ``hang`` (never answer until aborted),
``send_signature=False`` / ``--no-signature`` (prefill never posts a signature),
``signature_url`` (``http://.../eldr/signature``, ``tcp://host:port`` or any registered transport's URL),
``signature_delay`` (slow publish), ``signature_key`` (signs messages as the engine's
``--eldr-signature-key-file`` does), ``signature_on_failure=False`` (a failing prefill
fails before publishing; by default it publishes first, as a prefill whose KV
transfer fails later does), ``fail_after_kv`` (share of prefill requests that fail
after a decode took the room: the prefill's answer is 500 while the decode
succeeds), ``freeze()`` / ``thaw()`` (like SIGSTOP: every endpoint, health
included, stops answering), ``packed_counts=False`` / ``--list-counts``
(counts as JSON rows instead of the engine's packed base64 form), ``health_status`` (what ``/health`` answers),
``stream_chunks`` / ``stream_delay`` (slow SSE stream), ``kv`` (a :class:`KvHandoff`
shared by in-process prefill and decode stubs: SGLang's PD dependency, see there),
``api_key`` (like SGLang's ``--api-key``: 401 without ``Authorization: Bearer KEY``,
``/health`` excepted), ``backlog`` (listen queue, 2048 as SGLang's uvicorn). It records every request body
(``requests``) and its headers (``headers``), the most requests answered at once
(``max_active``), every aborted rid (``aborts``) and signature post (``signatures``).

It also answers sglang-router (0.3.2, PD mode): ``/health``, ``/get_server_info``,
``/get_model_info``, ``/v1/models``, and takes prefill/decode posts in any order.

Prefill signatures: ``counts_fn(text) -> [n_sel][E]`` (default :func:`topic_counts`:
a prompt containing ``topic:K`` activates experts of topic K on every layer), or
counts already packed (:func:`~eldr_sglang.core.counts_codec.pack_counts`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
import urllib.parse
import zlib
from typing import Any, Callable, Optional, Sequence

import aiohttp
import numpy as np
import orjson
from aiohttp import web

from eldr_sglang import transports
from eldr_sglang.cliparse import OneLineParser
from eldr_sglang.core import wire
from eldr_sglang.router.cli import run_loop


def topic_counts(text: str, layers: Sequence[int] = (0, 1), num_experts: int = 8,
                 per_topic: int = 2) -> list[list[int]]:
    """Counts [len(layers), E]: experts of the prompt's topic hot, all others cold."""
    m = re.search(r"topic:(\d+)", text or "")
    n_topics = max(1, num_experts // per_topic)
    t = int(m.group(1)) % n_topics if m else zlib.crc32((text or "").encode()) % n_topics
    row = [1] * num_experts
    for j in range(per_topic):
        row[t * per_topic + j] = 20
    return [list(row) for _ in layers]


class ToyArtifact:
    """Stand-in for ``CalibrationArtifact``: IDF-weighted, flattened, L2-normalised counts."""

    def __init__(self, layers: Sequence[int] = (0, 1), num_experts: int = 8,
                 num_clusters: int = 4, per_topic: int = 2, tau: float = 0.1) -> None:
        self.layers = list(layers)
        self.model = "toy-moe"
        self.tau = tau
        self.idf = np.ones((len(self.layers), num_experts), dtype=np.float32)
        self.centroids = np.stack([
            self.signature(np.asarray(topic_counts(f"topic:{k}", layers, num_experts, per_topic)))
            for k in range(num_clusters)])
        self.num_clusters = num_clusters

    def signature(self, counts: np.ndarray) -> np.ndarray:
        v = (np.asarray(counts, dtype=np.float32) * self.idf).reshape(-1)
        return v / max(float(np.linalg.norm(v)), 1e-12)


class KvHandoff:
    """SGLang's PD dependency between in-process stubs, per ``bootstrap_room``.

    As in SGLang, a decode server answers only after the prefill server finished the
    room and sent its KV cache, and the prefill server answers only once a decode
    server took the KV cache (late binding: after the router chose it). A side that
    waits longer than ``timeout`` s answers HTTP 500, as SGLang aborts a transfer.
    Entries are removed once both sides met (memory stays flat)."""

    def __init__(self, timeout: float = 10.0) -> None:
        self.timeout = timeout
        self._rooms: dict[Any, tuple[asyncio.Event, asyncio.Event]] = {}  # (prefilled, taken)

    def _entry(self, room: Any) -> tuple[asyncio.Event, asyncio.Event]:
        e = self._rooms.get(room)
        if e is None:
            e = self._rooms[room] = (asyncio.Event(), asyncio.Event())
        return e

    async def meet(self, role: str, rooms: Sequence[Any]) -> bool:
        """Prefill: mark the rooms prefilled, wait until taken. Decode: the reverse."""
        entries = [self._entry(r) for r in rooms]
        mine, theirs = (0, 1) if role == "prefill" else (1, 0)
        for e in entries:
            e[mine].set()
        try:
            for e in entries:
                await asyncio.wait_for(e[theirs].wait(), self.timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            for r, e in zip(rooms, entries):
                if e[0].is_set() and e[1].is_set() or not e[theirs].is_set():
                    self._rooms.pop(r, None)

    def __len__(self) -> int:
        return len(self._rooms)


def _items(body: dict) -> tuple[list[str], bool]:
    """Prompt text per item (for signatures) and whether the request is a batch."""
    text = body.get("text", body.get("prompt"))
    if text is None and "messages" in body:
        text = " ".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
    if text is None and "input_ids" in body:
        ids = body["input_ids"]
        if ids and isinstance(ids[0], list):
            return [" ".join(map(str, x)) for x in ids], True
        return [" ".join(map(str, ids))], False
    if isinstance(text, list) and ("text" in body or (text and isinstance(text[0], (str, list)))):
        return [str(t) for t in text], True  # a /generate batch, or a /v1/completions prompt list
    return [str(text)], False


def _as_list(v: Any, n: int, room: bool = False) -> list:
    """Per item; an int room of a batch is ``room + i``, as SGLang normalises it."""
    if isinstance(v, list):
        return list(v)
    return [v + i for i in range(n)] if room and isinstance(v, int) else [v] * n


class StubWorker:
    def __init__(
        self,
        role: str = "decode",
        *,
        name: Optional[str] = None,
        latency: float = 0.0,
        fail_rate: float = 0.0,
        fail_status: int = 500,
        fail_first: int = 0,
        fail_body: str = "error",
        crash_on: Optional[int] = None,
        crash_mode: str = "drop",
        health_status: int = 200,
        hang: bool = False,
        send_signature: bool = True,
        signature_url: Optional[str] = None,
        signature_delay: float = 0.0,
        signature_key: Optional[bytes] = None,
        layers: Sequence[int] = (0, 1),
        num_experts: int = 8,
        counts_fn: Optional[Callable[[str], list]] = None,
        packed_counts: bool = True,
        stream_chunks: int = 3,
        stream_delay: float = 0.0,
        seed: int = 0,
        model: str = "stub-model",
        kv: Optional[KvHandoff] = None,
        signature_on_failure: bool = True,
        fail_after_kv: float = 0.0,
        api_key: Optional[str] = None,
        backlog: int = 2048,
        eof_gate: Optional[asyncio.Event] = None,
    ) -> None:
        assert role in ("prefill", "decode")
        self.role, self.name = role, name or role
        self.latency, self.fail_rate, self.fail_status, self.hang = latency, fail_rate, fail_status, hang
        assert crash_mode in ("drop", "stop", "exit")
        self.fail_first, self.crash_on, self.crash_mode = fail_first, crash_on, crash_mode
        assert fail_body in ("error", "detail", "text")
        self.fail_body = fail_body
        self.health_status = health_status
        self.served = 0  # generate requests received
        self.health_checks = 0
        self.send_signature, self.signature_url = send_signature, signature_url
        self.signature_delay = signature_delay
        self.signature_key = signature_key  # signs each message as the engine does (HMAC)
        self.layers, self.num_experts = list(layers), num_experts
        self.counts_fn = counts_fn or (lambda t: topic_counts(t, self.layers, self.num_experts))
        self.packed_counts = packed_counts
        self.stream_chunks, self.stream_delay = stream_chunks, stream_delay
        self.rng = random.Random(seed)
        self.model = model
        self.kv = kv
        self.signature_on_failure, self.fail_after_kv = signature_on_failure, fail_after_kv
        self.active = 0  # generate requests being answered (reported on /v1/loads)
        self.max_active = 0  # the most answered at once
        self.api_key = api_key  # like SGLang's --api-key: Bearer needed except on /health
        self.backlog = backlog  # listen backlog: SGLang's uvicorn default (aiohttp's is 128)
        self.eof_gate = eof_gate  # a stream's end waits for it after [DONE] (a slow last chunk)
        self.headers: list[dict] = []  # headers of every generate request (names lower-case)
        self._thawed = asyncio.Event()
        self._thawed.set()
        self.requests: list[dict] = []
        self.failed: list[str] = []  # rids this worker answered with an error
        self.aborts: list[str] = []
        self.signatures: list[Any] = []
        self._abort_events: dict[str, asyncio.Event] = {}
        self._runner: Optional[web.AppRunner] = None
        self._session: Optional[aiohttp.ClientSession] = None
        self._tasks: set[asyncio.Task] = set()
        self._outbox: dict[str, list[dict]] = {}  # per destination: messages not sent yet
        self._senders: dict[str, asyncio.Task] = {}
        self._writers: dict[str, asyncio.StreamWriter] = {}
        self._transport_senders: dict[str, Any] = {}  # other transports' senders, per destination
        self.url = ""

    # ------------------------------------------------------------------ app
    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024**2, middlewares=[self._check_key])
        for ep in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.router.add_post(ep, self.h_generate)
        app.router.add_post("/abort_request", self.h_abort)
        app.router.add_get("/health", self.h_health)
        app.router.add_get("/health_generate", self.h_ok)
        app.router.add_post("/flush_cache", self.h_ok)
        for p in ("/get_server_info", "/server_info"):
            app.router.add_get(p, self.h_info)
        for p in ("/model_info", "/get_model_info"):
            app.router.add_get(p, self.h_model_info)
        app.router.add_get("/v1/models", self.h_models)
        app.router.add_get("/v1/loads", self.h_loads)
        return app

    @web.middleware
    async def _check_key(self, request: web.Request, handler) -> web.StreamResponse:
        if (self.api_key and not request.path.startswith("/health")
                and request.headers.get("Authorization") != f"Bearer {self.api_key}"):
            return web.json_response({"error": {"message": "Unauthorized"}}, status=401)
        return await handler(request)

    def freeze(self) -> None:
        """Stop answering anything (health included), like a SIGSTOPped process."""
        self._thawed.clear()

    def thaw(self) -> None:
        self._thawed.set()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._session = aiohttp.ClientSession()
        self._runner = web.AppRunner(self.build_app(), handler_cancellation=True, access_log=None,
                                     shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, backlog=self.backlog)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{host}:{self.port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is None:
            return
        for t in list(self._tasks):
            t.cancel()
        runner, self._runner = self._runner, None
        for w in self._writers.values():
            w.close()
        for sender in self._transport_senders.values():
            sender.close()
        self._thawed.set()
        await runner.cleanup()
        if self._session:
            await self._session.close()

    # ------------------------------------------------------------------ handlers
    async def h_ok(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def h_health(self, request: web.Request) -> web.Response:
        await self._thawed.wait()
        self.health_checks += 1
        return web.Response(status=self.health_status)

    async def h_loads(self, request: web.Request) -> web.Response:
        """SGLang's ``GET /v1/loads`` (core section): requests being answered here."""
        await self._thawed.wait()
        return web.json_response({"loads": [{"dp_rank": 0, "num_running_reqs": self.active,
                                             "num_waiting_reqs": 0}]})

    async def h_info(self, request: web.Request) -> web.Response:
        return web.json_response({"role": self.role, "name": self.name,
                                  "internal_states": [{"last_gen_throughput": 1.0}]})

    async def h_model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model, "is_generation": True})

    async def h_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def h_abort(self, request: web.Request) -> web.Response:
        rid = (await request.json()).get("rid", "")
        self.aborts.append(rid)
        for r, ev in self._abort_events.items():
            if rid and r.startswith(rid):
                ev.set()
        return web.Response(status=200)

    def _message(self, room: Any, rid: str, text: str) -> dict:
        return wire.build_message(room, rid, len(text.split()), 0, self.layers, self.counts_fn(text),
                                  packed=self.packed_counts)

    def _track(self, coro) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def _publish(self, msgs: list[dict], dest: str, delay: Optional[float] = None) -> None:
        """Queue signature messages for ``dest``. On an open TCP stream with nothing in
        flight they are written at once, as the engine's publisher thread does at
        prefill completion; otherwise a sender task sends them (``signature_delay`` first)."""
        delay = self.signature_delay if delay is None else delay
        if delay:
            async def later() -> None:
                await asyncio.sleep(delay)
                self._publish(msgs, dest, delay=0)
            self._track(later())
            return
        self.signatures.append(msgs)
        self._outbox.setdefault(dest, []).extend(msgs)
        sender = self._senders.get(dest)
        if sender is not None and not sender.done():
            return  # the running sender takes them
        w = self._writers.get(dest)
        if w is not None and not w.is_closing():
            batch, self._outbox[dest] = self._outbox[dest], []
            w.write(wire.stream_lines(batch, self.signature_key))
        else:
            self._senders[dest] = self._track(self._send_outbox(dest))

    async def _send_outbox(self, dest: str) -> None:
        """Like the engine's publisher: one send carries every message queued meanwhile,
        as one HTTP POST (a JSON list) or JSON lines on a kept-open TCP connection, both
        on this loop; any other registered transport (:mod:`eldr_sglang.transports`) with
        its sender, on a thread. An address no transport takes drops its messages."""
        try:
            send = self._native.get(transports.scheme_of(dest), StubWorker._send_with_transport)
        except ValueError:
            self._outbox.pop(dest, None)
            return
        while self._outbox.get(dest):
            batch, self._outbox[dest] = self._outbox[dest], []
            try:
                await send(self, dest, batch)
            except (aiohttp.ClientError, OSError):
                w = self._writers.pop(dest, None)
                if w is not None:
                    w.close()

    async def _send_stream(self, dest: str, batch: list[dict]) -> None:
        w = self._writers.get(dest)
        if w is None or w.is_closing():
            u = urllib.parse.urlsplit(dest)
            _, w = await asyncio.open_connection(u.hostname, u.port)
            self._writers[dest] = w
        w.write(wire.stream_lines(batch, self.signature_key))
        await w.drain()

    async def _send_post(self, dest: str, batch: list[dict]) -> None:
        body, headers = wire.http_body(batch if len(batch) > 1 else batch[0], self.signature_key)
        async with self._session.post(dest, data=body, headers=headers) as r:
            await r.read()

    async def _send_with_transport(self, dest: str, batch: list[dict]) -> None:
        sender = self._transport_senders.get(dest)
        if sender is None:
            sender = self._transport_senders[dest] = transports.sender_for(dest, 5.0, self.signature_key)
        try:
            await asyncio.to_thread(transports.deliver, sender, batch)
        except Exception:
            sender.close()  # dropped, as the engine's publisher drops them

    # the built-in transports on this loop (the engine's own senders block a thread)
    _native = {"tcp": _send_stream, "http": _send_post, "https": _send_post}

    def _failure(self, rids: list[str]) -> web.Response:
        self.failed.extend(rids)
        message = f"stub {self.name} failure"
        if self.fail_body == "text":
            return web.Response(text=message, status=self.fail_status)
        body = {"detail": message} if self.fail_body == "detail" else {"error": {"message": message}}
        return web.json_response(body, status=self.fail_status)

    async def _crash(self, request: web.Request) -> web.StreamResponse:
        if self.crash_mode == "exit":
            os._exit(17)
        if request.transport is not None:
            request.transport.abort()  # connection dropped, no answer
        if self.crash_mode == "stop" and self._runner is not None:
            # like a killed process: every open connection drops, the port closes
            server = self._runner.server
            for conn in list(server.connections if server is not None else []):
                if conn.transport is not None:
                    conn.transport.abort()
            self._stopper = asyncio.get_running_loop().create_task(self.stop())
        raise asyncio.CancelledError()

    async def h_generate(self, request: web.Request) -> web.StreamResponse:
        await self._thawed.wait()
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        try:
            return await self._generate(request)
        finally:
            self.active -= 1

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json(loads=orjson.loads)
        endpoint = request.path.lstrip("/")
        self.served += 1
        if self.crash_on is not None and self.served >= self.crash_on:
            return await self._crash(request)
        self.requests.append({"endpoint": endpoint, **body})
        texts, is_batch = _items(body)
        n = len(texts)
        rids = [str(r) for r in _as_list(body.get("rid", ""), n)]
        rooms = _as_list(body.get("bootstrap_room"), n, room=True)
        fail = self.served <= self.fail_first or (self.fail_rate and self.rng.random() < self.fail_rate)
        dest = _return_address(body) or self.signature_url
        if (self.role == "prefill" and self.send_signature and dest
                and (self.signature_on_failure or not fail)):
            msgs = [self._message(rooms[i], rids[i], texts[i]) for i in range(n)]
            self._publish(msgs, dest)
        if fail:
            return self._failure(rids)
        if self.kv is not None and not await self.kv.meet(self.role, rooms):
            self.failed.extend(rids)
            return web.json_response({"error": {"message": f"stub {self.name}: KV transfer timed out"}},
                                     status=500)
        ev = asyncio.Event()
        for r in rids:
            self._abort_events[r] = ev
        try:
            if self.hang:
                await ev.wait()
            elif self.latency:
                try:
                    await asyncio.wait_for(ev.wait(), self.latency)
                except asyncio.TimeoutError:
                    pass
            if ev.is_set():
                return web.json_response({"error": {"message": "aborted"}}, status=499)
            if self.fail_after_kv and self.rng.random() < self.fail_after_kv:
                return self._failure(rids)  # after the KV handoff and ``latency``
            items = [{"text": f"{self.name}:{texts[i][:20]}",
                      "meta_info": {"id": rids[i], "server": self.name, "role": self.role,
                                    "bootstrap_room": rooms[i],
                                    "completion_tokens": 1,
                                    "finish_reason": {"type": "length", "length": 1}}}
                     for i in range(n)]
            if not body.get("stream"):
                return web.Response(body=orjson.dumps(items if is_batch else items[0]),
                                    content_type="application/json")
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for k in range(self.stream_chunks):
                for it in items:
                    meta = {**it["meta_info"], "completion_tokens": k + 1}  # bench_serving reads it
                    await out.write(b"data: " + orjson.dumps({**it, "meta_info": meta, "chunk": k}) + b"\n\n")
                if self.stream_delay:
                    try:
                        await asyncio.wait_for(ev.wait(), self.stream_delay)
                        break
                    except asyncio.TimeoutError:
                        pass
            await out.write(b"data: [DONE]\n\n")
            if self.eof_gate is not None:
                await self.eof_gate.wait()
            await out.write_eof()
            return out
        finally:
            for r in rids:
                self._abort_events.pop(r, None)


def _return_address(body: dict) -> Optional[str]:
    """The signature return address a router put in the request, as the engine reads it."""
    sp = body.get("sampling_params")
    for cp in ((sp[0] if isinstance(sp, list) and sp else sp or {}).get("custom_params"),
               body.get("custom_params")):
        dest = wire.return_address(cp)
        if dest is not None:
            return dest
    return None


def main(argv: Optional[list[str]] = None) -> None:
    p = OneLineParser(description="Fake SGLang PD worker")
    p.add_argument("--role", choices=("prefill", "decode"), default="decode")
    p.add_argument("--name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--latency", type=float, default=0.0)
    p.add_argument("--fail-rate", type=float, default=0.0)
    p.add_argument("--fail-status", type=int, default=500)
    p.add_argument("--fail-first", type=int, default=0, help="first N requests fail")
    p.add_argument("--fail-body", choices=("error", "detail", "text"), default="error")
    p.add_argument("--crash-on", type=int, help="the Nth request crashes the worker")
    p.add_argument("--crash-mode", choices=("exit", "drop", "stop"), default="exit")
    p.add_argument("--health-status", type=int, default=200)
    p.add_argument("--hang", action="store_true")
    p.add_argument("--no-signature", action="store_true", help="prefill never posts a signature")
    p.add_argument("--signature-url", help="router callback, e.g. http://127.0.0.1:8000/eldr/signature")
    p.add_argument("--signature-delay", type=float, default=0.0)
    p.add_argument("--signature-key-file", help="sign signature messages with this key (HMAC-SHA256)")
    p.add_argument("--list-counts", action="store_true", help="counts as JSON rows, not packed")
    p.add_argument("--layers", default="0,1")
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--stream-chunks", type=int, default=3)
    p.add_argument("--stream-delay", type=float, default=0.0)
    p.add_argument("--backlog", type=int, default=2048,
                   help="listen backlog (default: SGLang's uvicorn's; aiohttp's own is 128)")
    a = p.parse_args(argv)
    try:
        key = wire.load_key(a.signature_key_file, "--signature-key-file")
    except ValueError as e:
        p.error(str(e))
    w = StubWorker(a.role, name=a.name, latency=a.latency, fail_rate=a.fail_rate,
                   fail_status=a.fail_status, fail_first=a.fail_first,
                   fail_body=a.fail_body, crash_on=a.crash_on,
                   crash_mode=a.crash_mode, health_status=a.health_status, hang=a.hang, send_signature=not a.no_signature,
                   signature_url=a.signature_url, signature_delay=a.signature_delay, signature_key=key,
                   packed_counts=not a.list_counts,
                   layers=[int(x) for x in a.layers.split(",")], num_experts=a.num_experts,
                   stream_chunks=a.stream_chunks, stream_delay=a.stream_delay,
                   backlog=a.backlog)

    async def run() -> None:
        print(f"stub {w.role} on {await w.start(a.host, a.port)}", flush=True)
        await asyncio.Event().wait()

    # sglang-router probes workers with gRPC first (HTTP/2 preface): aiohttp logs a
    # harmless 400 per probe
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    try:
        run_loop(run())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
