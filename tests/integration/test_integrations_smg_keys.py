"""SMG routing keys under traffic, restarts and re-bindings: the pre-router in front of
the in-process SMG 0.3.2 model of :mod:`tests.integration.fake_smg` (sticky random
key assignment, per-worker completion counters and keys-in-flight gauge, new worker
ids after a restart; other traffic modelled as completions on the counters), loopback
only. Every pinned request's serving worker is checked against the ELDR decision."""

from __future__ import annotations

import asyncio
import contextlib
import random

import orjson
import pytest

from eldr_sglang.integrations import Choice, SmgPreRouter
from tests.helpers import until
from tests.integration.fake_smg import FakeSmg
from tests.integration.integrations_helpers import adapter


class ToScorer:
    """The ELDR decision stand-in: the prompt ``to:N`` names the worker (index in the list)."""

    async def choose(self, body, endpoint, workers, loads):
        return Choice(workers[int(body["text"].split(":")[1]) % len(workers)], 0)

    def release(self, choice):
        pass


@contextlib.asynccontextmanager
async def rig(n: int, **kw):
    smg = FakeSmg(n, **{k: v for k, v in kw.items() if k in ("serve_s", "background_rps", "count_delay_s",
                                                                 "control_token", "seed")})
    await smg.start()
    pre_kw = {k: v for k, v in kw.items() if k in ("control_token", "refresh_s")}
    pre = SmgPreRouter(smg.url, ToScorer(), metrics_url=smg.url + "/metrics", **{"refresh_s": 0.2, **pre_kw})
    pre.verify_s = kw.get("verify_s", 0.5)
    try:
        async with adapter(pre) as (aurl, http):
            yield smg, pre, aurl, http
    finally:
        await smg.stop()


async def send(http, aurl, to: int):
    async with http.post(aurl + "/generate", data=orjson.dumps({"text": f"to:{to}"}),
                         headers={"Content-Type": "application/json"}) as r:
        doc = orjson.loads(await r.read())
        assert r.status == 200, doc
        return doc["meta_info"]["server"], r.headers.get("X-ELDR-Worker"), r.headers.get("X-ELDR-Path")


def wrong_keys(smg: FakeSmg, pre: SmgPreRouter) -> dict[str, str]:
    return {w: k for w, k in pre.keys.items() if smg.bound(k) != w}


class Traffic:
    """``conc`` clients sending back to back to random workers; records every answer."""

    def __init__(self, http, aurl, smg: FakeSmg, conc: int = 4, seed: int = 1) -> None:
        self.http, self.aurl, self.smg, self.rng = http, aurl, smg, random.Random(seed)
        self.log: list[tuple[str, str, str]] = []  # (decided worker name, served, path)
        self.failed = 0
        self.tasks = [asyncio.get_running_loop().create_task(self._run()) for _ in range(conc)]

    async def _run(self) -> None:
        while True:
            to = self.rng.randrange(len(self.smg.urls))
            async with self.http.post(self.aurl + "/generate", data=orjson.dumps({"text": f"to:{to}"}),
                                      headers={"Content-Type": "application/json"}) as r:
                raw = await r.read()
                if r.status == 200:  # 502 while SMG is down
                    doc = orjson.loads(raw)
                    self.log.append((f"d{to}", doc["meta_info"]["server"], r.headers.get("X-ELDR-Path")))
                else:
                    self.failed += 1

    def pinned(self, start: int = 0) -> tuple[int, int]:
        """(pinned requests, of them served elsewhere) since log index ``start``."""
        p = [(want, got) for want, got, path in self.log[start:] if path == "pinned"]
        return len(p), sum(1 for want, got in p if want != got)

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def catch_moved_key(smg: FakeSmg, pre: SmgPreRouter, http, aurl) -> tuple[int, int]:
    """SMG moves d0's key to d1 behind our back (idle eviction, a flap): requests to d0
    until verification drops the key and d0 has a right key again; (pinned requests
    served elsewhere, requests sent)."""
    d0, d1 = smg.urls[0], smg.urls[1]
    moved = pre.keys[d0]
    smg.keys[moved] = d1
    start, elsewhere = len(pre.decisions), 0

    async def d0_traffic():
        nonlocal elsewhere
        while True:
            served, _, path = await send(http, aurl, 0)
            elsewhere += path == "pinned" and served != "d0"

    task = asyncio.get_running_loop().create_task(d0_traffic())
    try:
        await until(lambda: pre.counters["keys_contradicted"] >= 1, 60, "the moved key is contradicted")
        await until(lambda: pre.keys.get(d0) and smg.bound(pre.keys[d0]) == d0, 60, "d0 has a right key again")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert wrong_keys(smg, pre) == {}
    return elsewhere, len(pre.decisions) - start


async def test_keys_learned_and_verified_under_2000_req_s_of_other_traffic():
    n = 8
    async with rig(n, background_rps=2000, serve_s=0.05, verify_s=0.05) as (smg, pre, aurl, http):
        await until(lambda: len(pre.keys) == n, 60, "a key learned for each of 8 decode workers")
        assert wrong_keys(smg, pre) == {}
        cost = pre.counters["probe_requests"]
        assert cost <= n * pre.max_keys_per_worker * pre.probe_rounds
        assert pre.status()["learning"]["last_run"]["converged"] is True
        for i in range(2 * n):
            served, pinned, path = await send(http, aurl, i % n)
            assert path == "pinned" and served == f"d{i % n}"
        elsewhere, sent = await catch_moved_key(smg, pre, http, aurl)
        print(f"\nlearned {n} keys under 2000 req/s of other traffic with {cost} probe requests; "
              f"a moved key caught after {elsewhere} pinned requests served elsewhere ({sent} sent to d0)")


async def test_delayed_counting_binds_no_wrong_key():
    n = 8
    async with rig(n, background_rps=30, count_delay_s=0.3, serve_s=0.05) as (smg, pre, aurl, http):
        await until(lambda: len(pre.keys) == n, 60, "a key learned for each of 8 decode workers")
        assert wrong_keys(smg, pre) == {}, "a key bound to the wrong worker"


@pytest.mark.parametrize("down", [True, False], ids=["with-downtime", "instant"])
async def test_smg_restarts_are_detected_and_keys_relearned(down):
    """``down``: SMG stops answering until the pre-router has seen it fail (a process
    restart); instant: the new SMG answers at once (a switch to a ready replacement), so
    requests pinned with old keys until the next discovery (``refresh_s`` 0.2 s) land at
    random: a bound of 10% there."""
    async with rig(2, serve_s=0.03) as (smg, pre, aurl, http):
        await until(lambda: len(pre.keys) == 2, 30, "keys learned")
        traffic = Traffic(http, aurl, smg, conc=4)
        try:
            start = len(traffic.log)
            for r in range(4):
                mark = len(traffic.log)
                # 200 requests after each restart (the first round: before any), keys re-learned
                await until(lambda: len(traffic.log) >= mark + 200 and len(pre.keys) == 2, 60,
                            "200 requests and a key per worker")
                if r < 3:
                    if down:
                        smg.down = True
                        errors = pre.counters["discovery_errors"]
                        await until(lambda: pre.counters["discovery_errors"] > errors, 30,
                                    "the pre-router sees SMG down")
                    smg.restart()
        finally:
            await traffic.stop()
        pinned, elsewhere = traffic.pinned(start)
        total = len(traffic.log) - start
        assert pinned >= 0.5 * total, f"only {pinned} of {total} requests pinned: {dict(pre.counters)}"
        assert elsewhere <= (0.05 if down else 0.10) * pinned, f"{elsewhere} of {pinned} pinned served elsewhere"
        assert pre.counters["smg_restarts"] == 3 and wrong_keys(smg, pre) == {}
        print(f"\n3 restarts ({'with downtime' if down else 'instant'}): {elsewhere} of {pinned} pinned requests "
              f"served elsewhere ({total} answered, {total - pinned} unpinned, {traffic.failed} failed while down)")


async def test_replicas_are_detected_and_pinning_stops():
    async with rig(2, serve_s=0.02) as (smg, pre, aurl, http):
        await until(lambda: len(pre.keys) == 2, 30, "keys learned")
        first = dict(smg.ids)
        smg.restart()  # a second replica answers /workers ...
        await until(lambda: pre.counters["smg_restarts"] == 1, 30, "new ids seen")
        smg.ids = first  # ... then the first again
        await until(lambda: pre.replicas, 30, "replicas detected")
        _, pinned, path = await send(http, aurl, 0)
        assert pinned == "-" and path == "fallback_no_pin" and pre.counters["fallback_smg_replicas"] >= 1


async def test_control_plane_token():
    async with rig(2, serve_s=0.02, control_token="s3cret") as (smg, pre, aurl, http):
        await until(lambda: len(pre.keys) == 2, 30, "workers listed with the token and keys learned")
        served, pinned, path = await send(http, aurl, 1)
        assert path == "pinned" and served == "d1"


def test_cli_takes_tokens_from_the_environment(monkeypatch):
    from eldr_sglang.integrations.__main__ import build, parse_args

    monkeypatch.setenv("ELDR_HOST_CONTROL_TOKEN", "ctl")
    monkeypatch.setenv("ELDR_HOST_API_KEY", "data")
    monkeypatch.setenv("ELDR_SCORER_API_KEY", "score")
    pre = build(parse_args(["smg", "--host-url", "http://127.0.0.1:1", "--scorer-url", "http://127.0.0.1:2",
                            "--metrics-url", "http://127.0.0.1:3/metrics"]))
    assert pre.control_headers == {"Authorization": "Bearer ctl"} and pre.api_headers == {"Authorization": "Bearer data"}
    assert pre.scorer.headers["Authorization"] == "Bearer score"
