"""``--routers R``: a router replica counts its own requests since the last load poll
``1 + 0.5 (R - 1)`` times, for the other replicas' traffic it cannot see until the next
poll (``reckoned_load``, the same function benchmark/bench_replicas.py simulates).

Two in-process replicas (JSQ) in front of three hanging decode stubs; polls are taken
by hand (``--load-interval 0``), so both views are stale by construction.
"""

import asyncio

import aiohttp
import numpy as np
import pytest

from eldr_sglang.core.policies import least_loaded
from eldr_sglang.router import Router, start_router
from eldr_sglang.router.config import RouterConfig
from eldr_sglang.router.pool.workers import (ROUTERS_MAX, ROUTERS_WEIGHT, estimate_routers, reckon_factor,
                                             reckoned_load)
from eldr_sglang.testing.stub_worker import StubWorker
from tests.integration.helpers import BOOT_PORT, post, until

pytestmark = pytest.mark.timeout(60)

HELD, BURST = 5, 9  # requests on d0 at the poll; each replica's burst after it


def jsq_on_the_view(reported, factor, n):
    """How many of ``n`` requests JSQ sends to each server when its view is
    ``reckoned_load(own, reported, 0, factor)`` (ties by index)."""
    own = [0] * len(reported)
    for _ in range(n):
        view = [reckoned_load(o, r, 0, factor) for o, r in zip(own, reported)]
        own[least_loaded(view, np.arange(len(own)))] += 1
    return own


def test_one_router_is_todays_view_exactly():
    assert reckon_factor(1) == 1 and isinstance(reckon_factor(1), int)
    assert reckoned_load(2, 7, 1, reckon_factor(1)) == 8 and isinstance(reckoned_load(2, 7, 1), int)
    assert reckoned_load(3, 0, 1, 2.5) == 5.0 and reckoned_load(3, 9, 8, 2.5) == 3  # never below own
    assert reckon_factor(2) == 1.5 and reckon_factor(4) == 2.5
    with pytest.raises(ValueError, match="routers"):
        RouterConfig(routers=-1)
    assert estimate_routers(12, 4, None) == 3.0 and estimate_routers(12, 3, 2.0) == 2.0  # too few own
    assert estimate_routers(2, 4, None) == 1.0 and estimate_routers(10_000, 4, None) == ROUTERS_MAX
    assert estimate_routers(16, 4, 2.0) == pytest.approx(2.0 + ROUTERS_WEIGHT * 2)


@pytest.mark.parametrize("routers", [1, 2])
async def test_replicas_count_each_others_burst_between_polls(routers):
    """d0 holds 5 requests at the poll; then replica A, then replica B send a burst of 9
    before the next poll. With --routers 1 each sees (5, own, own): both send all 18 to
    d1/d2 (true loads 5, 9, 9). With --routers 2 each counts its own 1.5 times, as if the
    other had sent half as many there: each sends one to d0 (true loads 7, 8, 8), and B's
    view of every server is the formula's."""
    decodes = [StubWorker("decode", name=f"d{i}", hang=True) for i in range(3)]
    prefill = StubWorker("prefill", name="p0")
    purl = await prefill.start()
    durls = [await d.start() for d in decodes]
    kw = dict(health_interval=0, load_interval=0, routers=routers)
    a, b = (Router([(purl, BOOT_PORT)], durls, "jsq", **kw) for _ in range(2))
    (ra, pa), (rb, pb) = await start_router(a), await start_router(b)
    http = aiohttp.ClientSession()
    held = []
    try:
        held += [asyncio.ensure_future(post(http, f"{durls[0]}/generate", {"text": f"other {i}"}))
                 for i in range(HELD)]
        await until(lambda: decodes[0].active == HELD)
        await asyncio.gather(a.pool.poll_loads(), b.pool.poll_loads())
        assert [d.reported for d in b.pool.decodes] == [HELD, 0, 0]

        async def burst(router, port):
            for i in range(BURST):  # one at a time: each decision sees the previous ones
                held.append(asyncio.ensure_future(post(http, f"http://127.0.0.1:{port}/generate",
                                                       {"text": f"x{i}"})))
                await until(lambda: sum(d.inflight for d in router.pool.decodes) == i + 1)
            return [d.inflight for d in router.pool.decodes]

        sent_a = await burst(a, pa)
        sent_b = await burst(b, pb)
        m = reckon_factor(routers)
        expected = jsq_on_the_view([HELD, 0, 0], m, BURST)
        assert sent_a[0] == sent_b[0] == expected[0] == (0 if routers == 1 else 1)
        assert sorted(sent_a) == sorted(sent_b) == sorted(expected)
        assert [d.load for d in b.pool.decodes] == [reckoned_load(o, r, 0, m)
                                                   for o, r in zip(sent_b, [HELD, 0, 0])]
        await until(lambda: sum(d.active for d in decodes) == HELD + 2 * BURST)
        true = [d.active for d in decodes]
        assert true[0] == HELD + sent_a[0] + sent_b[0]
        assert max(true) - min(true) == (1 if routers == 2 else max(true) - HELD)
        if routers == 1:
            assert max(true) - min(true) >= 4
    finally:
        for h in held:
            h.cancel()
        await http.close()
        await ra.cleanup()
        await rb.cleanup()
        for w in [prefill] + decodes:
            await w.stop()


async def test_routers_0_estimates_the_routers_from_each_poll():
    """--routers 0: 4 own requests in flight and 8 from others on the servers at a poll
    give R = 12 / 4 = 3 (own change counted 2 times); with 4 more from others, the next
    poll's 16 / 4 = 4 moves the estimate by ROUTERS_WEIGHT of the difference."""
    decodes = [StubWorker("decode", name=f"d{i}", hang=True) for i in range(2)]
    prefill = StubWorker("prefill", name="p0")
    purl = await prefill.start()
    durls = [await d.start() for d in decodes]
    r = Router([(purl, BOOT_PORT)], durls, "jsq", health_interval=0, load_interval=0, routers=0)
    runner, port = await start_router(r)
    http = aiohttp.ClientSession()
    held = []

    async def others(n):
        held.extend(asyncio.ensure_future(post(http, f"{durls[i % 2]}/generate", {"text": f"o{i}"}))
                    for i in range(n))
    try:
        await r.pool.poll_loads()
        assert r.pool.routers_seen is None and [d.reckon for d in r.pool.decodes] == [1, 1]
        held += [asyncio.ensure_future(post(http, f"http://127.0.0.1:{port}/generate", {"text": f"x{i}"}))
                 for i in range(4)]
        await others(8)
        await until(lambda: sum(d.active for d in decodes) == 12)
        await r.pool.poll_loads()
        assert r.pool.routers_seen == 3.0 and [d.reckon for d in r.pool.decodes] == [reckon_factor(3)] * 2
        assert r.pool.decodes[0].describe()["reckon"] == 2.0  # what /eldr/workers shows
        await others(4)
        await until(lambda: sum(d.active for d in decodes) == 16)
        await r.pool.poll_loads()
        assert r.pool.routers_seen == pytest.approx(3.0 + ROUTERS_WEIGHT)
        assert r.pool.decodes[0].reckon == pytest.approx(reckon_factor(3.0 + ROUTERS_WEIGHT))
    finally:
        for h in held:
            h.cancel()
        await http.close()
        await runner.cleanup()
        for w in [prefill] + decodes:
            await w.stop()
