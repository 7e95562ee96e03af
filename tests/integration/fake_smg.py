"""An in-process model of SMG 0.3.2 in PD mode with ``--decode-policy manual``, for
the pre-router's key tests (loopback only).

What it models, each checked on the real 0.3.2 with stub workers:

* ``X-SMG-Routing-Key``: a new key is bound to a random healthy decode worker and
  keeps it; no key: a random decode worker (``--assignment-mode random``);
* ``GET /workers``: decode workers and one prefill, each with an ``id`` (a UUID drawn
  when SMG registers the worker, so new after every restart);
* ``GET /metrics``: ``smg_worker_cb_outcomes_total{worker,outcome}`` (completions per
  worker) and ``smg_worker_routing_keys_active{worker}`` (distinct routing keys with a
  request in flight there; unkeyed requests do not move it; a worker's line appears once
  a keyed request reached it), and ``smg_worker_pool_size``;
* :meth:`restart`: keys forgotten, counters back to 0, new worker ids; ``down`` before
  it models the time a restarting SMG does not answer (connections closed unanswered).

Model knobs: ``serve_s`` (how long a request stays at its decode worker),
``background_rps`` (other traffic, unkeyed: completions added to random workers'
counters at that rate, never through HTTP, so a 2-core machine can model 1,000 req/s
and more), ``count_delay_s`` (an outcome counted that long after the answer),
``control_token`` (``GET /workers`` needs ``Authorization: Bearer``, as with SMG's
control-plane API keys). A request answers ``meta_info.server`` = the decode worker's
name, so a test knows where each pinned request was served.
"""

from __future__ import annotations

import asyncio
import collections
import random
import uuid
from typing import Optional

import orjson
from aiohttp import web

KEY = "x-smg-routing-key"


class FakeSmg:
    def __init__(self, n_decode: int = 2, *, serve_s: float = 0.05, background_rps: float = 0.0,
                 count_delay_s: float = 0.0, control_token: Optional[str] = None, seed: int = 0) -> None:
        self.urls = [f"http://127.0.0.1:{41000 + i}" for i in range(n_decode)]  # labels, never contacted
        self.names = {u: f"d{i}" for i, u in enumerate(self.urls)}
        self.prefill = "http://127.0.0.1:40999"
        self.serve_s, self.background_rps, self.count_delay_s = serve_s, background_rps, count_delay_s
        self.control_token = control_token
        self.rng = random.Random(seed)
        self.healthy = set(self.urls)
        self.served: collections.Counter = collections.Counter()  # requests per worker name (all)
        self.restarts = 0
        self.down = False  # between a stop and a restart: every connection is closed unanswered
        self._reset()
        self._runner: Optional[web.AppRunner] = None
        self._bg: Optional[asyncio.Task] = None
        self.url = ""

    def _reset(self) -> None:
        self.ids = {u: str(uuid.UUID(int=self.rng.getrandbits(128))) for u in [*self.urls, self.prefill]}
        self.keys: dict[str, str] = {}
        self.outcomes: collections.Counter = collections.Counter()
        self.active: dict[str, collections.Counter] = {u: collections.Counter() for u in self.urls}
        self.keyed: set[str] = set()

    def restart(self) -> None:
        """SMG restarted: keys, counters and worker ids are new (in-flight requests finish)."""
        self.restarts += 1
        self._reset()
        self.down = False

    def bound(self, key: str) -> Optional[str]:
        return self.keys.get(key)

    # ------------------------------------------------------------------ HTTP
    async def workers(self, request: web.Request) -> web.Response:
        if self.down:
            return self._drop(request)
        if self.control_token and request.headers.get("Authorization") != f"Bearer {self.control_token}":
            return web.json_response({"error": "unauthorized"}, status=401)
        ws = [{"id": self.ids[u], "url": u, "worker_type": "decode", "is_healthy": u in self.healthy}
              for u in self.urls]
        ws.append({"id": self.ids[self.prefill], "url": self.prefill, "worker_type": "prefill", "is_healthy": True})
        return web.json_response({"workers": ws, "total": len(ws)})

    @staticmethod
    def _drop(request: web.Request) -> web.Response:
        """Down: the connection is closed without an answer (as a stopped process's)."""
        request.transport.close()
        return web.Response(status=503)

    async def metrics(self, request: web.Request) -> web.Response:
        if self.down:
            return self._drop(request)
        lines = [f'smg_worker_cb_outcomes_total{{worker="{u}",outcome="success"}} {n}'
                 for u, n in self.outcomes.items()]
        lines += [f'smg_worker_routing_keys_active{{worker="{u}"}} {sum(1 for c in a.values() if c > 0)}'
                  for u, a in self.active.items() if u in self.keyed]  # exported once a key was there
        lines.append(f'smg_worker_pool_size{{worker_type="decode",connection_mode="http",model="default"}} '
                     f'{len(self.urls)}')
        return web.Response(text="\n".join(lines) + "\n")

    async def generate(self, request: web.Request) -> web.Response:
        await request.read()
        live = [u for u in self.urls if u in self.healthy]
        if self.down:
            return self._drop(request)
        if not live:
            return web.json_response({"error": "no workers"}, status=503)
        key = request.headers.get(KEY)
        if key:
            w = self.keys.get(key)
            if w not in self.healthy:
                w = self.keys[key] = self.rng.choice(live)
        else:
            w = self.rng.choice(live)
        active = self.active[w]
        if key:
            active[key] += 1
            self.keyed.add(w)
        try:
            await asyncio.sleep(self.serve_s)  # the decode worker's time (model)
        finally:
            if key:
                active[key] -= 1
                if active[key] <= 0:
                    del active[key]
        self.served[self.names[w]] += 1
        outcomes = self.outcomes
        if self.count_delay_s > 0:
            asyncio.get_running_loop().call_later(self.count_delay_s, outcomes.update, [w])
        else:
            outcomes[w] += 1
        return web.Response(body=orjson.dumps({"text": "ok", "meta_info": {"server": self.names[w]}}),
                            content_type="application/json")

    async def _background(self) -> None:
        carry, tick = 0.0, 0.01
        while True:
            await asyncio.sleep(tick)
            carry += self.background_rps * tick
            n, carry = int(carry), carry - int(carry)
            live = [u for u in self.urls if u in self.healthy]
            for _ in range(n if live else 0):
                self.outcomes[self.rng.choice(live)] += 1

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/workers", self.workers)
        app.router.add_get("/metrics", self.metrics)
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, self.generate)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        if self.background_rps > 0:
            self._bg = asyncio.get_running_loop().create_task(self._background())
        return self.url

    async def stop(self) -> None:
        if self._bg is not None:
            self._bg.cancel()
            await asyncio.gather(self._bg, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
