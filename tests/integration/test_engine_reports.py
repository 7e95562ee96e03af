"""Engine-reported batches through the router's load poll (stub engines serving
/eldr/batch): the policy prices each decode server's true batch, the step law is fitted
per server from its samples and shown on /metrics and /eldr/status, and an engine
that stops answering leaves the router on its own state."""

import asyncio

import numpy as np
import pytest
from aiohttp import web

from eldr_sglang.testing.stub_worker import ToyArtifact
from tests.integration.helpers import cluster, until

pytestmark = pytest.mark.timeout(60)
LAW = (0.0154, 0.00246, 0.000732)  # base, per sequence, per distinct expert (the fat-expert CPU fit)


class StubEngine:
    """An engine plugin's /eldr/batch: planted usage, steps from a planted law."""

    def __init__(self, usage: np.ndarray, seed: int) -> None:
        self.usage, self.rng, self.steps, self.up = usage, np.random.default_rng(seed), 0, True
        self.made = 0  # samples made over the engine's life (a restart does not reset it)
        self.runner = None

    def samples(self, n: int) -> list[dict]:
        out = []
        for _ in range(n):
            b = int(self.rng.integers(1, 17))
            u = float(min(b * self.rng.uniform(8, 20), 300))
            t = (LAW[0] + LAW[1] * b + LAW[2] * u) * (1 + 0.02 * self.rng.standard_normal())
            self.made += 1
            out.append({"batch_size": b, "unique_experts": u, "kv_tokens": 100 * b, "seconds": t, "n": self.made})
        return out

    async def handle(self, request: web.Request) -> web.Response:
        if not self.up:
            return web.Response(status=503)
        self.steps += 8
        return web.json_response({"steps": self.steps, "idle_s": 0.0, "batch_size": 8,
                                  "usage": self.usage.tolist(), "samples": self.samples(8)})

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/eldr/batch", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/metrics"


async def test_engine_reports_feed_the_price_and_the_step_law():
    busy = np.zeros((4, 8))
    busy[[0, 1]] = 0.9  # server 0 runs a batch (another router's requests) using every expert of layers 0-1
    engines = [StubEngine(busy, 0), StubEngine(np.zeros((4, 8)), 1)]
    urls = [await e.start() for e in engines]
    try:
        async with cluster(n_decode=2, policy="eldr_balanced", artifact=ToyArtifact(num_clusters=2),
                           engine_metrics=",".join(urls), load_interval=0.05) as (
                router, url, prefill, decodes, http):
            policy = router.state.routing.policy
            await until(lambda: 0 in policy._reported and 1 in policy._reported, what="both reports in")
            unique = policy.expected_unique()
            assert unique[0] == pytest.approx(16 * 0.9, rel=1e-6) and unique[1] == 0.0
            reports = router.engine_reports.servers
            await until(lambda: all(r.law is not None for r in reports.values()), what="laws fitted")
            law = reports[router.pool.decodes[0].url].law
            assert law.per_expert_s == pytest.approx(LAW[2], rel=0.2) and law.r2 > 0.8
            assert all(x is not None for x in policy.laws)  # the policy prices with them
            async with http.get(f"{url}/metrics") as r:
                text = await r.text()
            assert "eldr_router_step_law_r2{server=" in text and 'term="per_expert_s"' in text
            status = router.status()["engine_reports"]
            assert set(status) == {d.url for d in router.pool.decodes}
            url0 = router.pool.decodes[0].url
            made = engines[0].made
            engines[0].steps = 0  # the engine restarted: its step count starts again
            await until(lambda: reports[url0].samples[-1]["n"] > made, what="samples after a restart")
            engines[0].up = False  # an engine that stops answering: its report is dropped
            await until(lambda: 0 not in policy._reported, what="report dropped")
            assert policy.expected_unique()[0] == 0.0
    finally:
        for e in engines:
            await e.runner.cleanup()
