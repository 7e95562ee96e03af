"""ELDR pinned in SMG (sglang-router 0.3.2, PD mode, ``--decode-policy manual``) by the
pre-router of eldr_sglang.integrations, on stub workers (loopback only): requests land
on the decode worker the ELDR decision names (recorded per request), a decode worker
that disappears leaves the mapping, and the adapter's own failure leaves the choice
to SMG without failing a request."""

from __future__ import annotations

import contextlib
import subprocess

import aiohttp
import orjson
import pytest

from eldr_sglang.integrations import LocalScorer, RemoteScorer, SmgPreRouter
from eldr_sglang.router.http.serve import start_router
from eldr_sglang.router.colocated import ColocatedRouter
from eldr_sglang.testing.local_cluster import free_port, sglang_router_argv
from eldr_sglang.testing.stub_worker import StubWorker
from tests.helpers import LOG_DIR, until
from tests.integration.integrations_helpers import (FailingScorer, adapter, non_loopback_listeners, tokenizer,
                                                    topic_artifact, topic_prompt)

pytest.importorskip("sglang_router", reason="sglang-router (SMG) is not installed")
pytestmark = pytest.mark.slow  # ~1 min each on a loaded 2-core machine (SMG takes 10-40 s to start)


class Smg:
    """One SMG process over fixed argv: start (waits until it answers), stop, restart."""

    def __init__(self, argv: list[str], url: str) -> None:
        self.argv, self.url, self.proc, self.log = argv, url, None, None

    async def start(self) -> None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log = open(LOG_DIR / "smg-integration.log", "ab")
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT)
        async with aiohttp.ClientSession() as http:
            async def ready():
                try:
                    async with http.post(self.url + "/generate", json={"text": "x", "sampling_params":
                                                                       {"max_new_tokens": 1}}) as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False
            await until(ready, 90, "SMG answers a request")
        assert non_loopback_listeners([self.proc.pid]) == [], "SMG listens outside loopback"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
            self.log.close()
            self.proc = None

    async def restart(self) -> None:
        self.stop()
        await self.start()


@contextlib.asynccontextmanager
async def smg_cluster(n_decode: int = 2):
    """1 prefill + n decode stubs, SMG in PD mode with the manual decode policy; yields
    (smg_url, metrics_url, prefill, decodes, smg)."""
    prefill = StubWorker("prefill", name="p0", send_signature=False)
    # decode takes 50 ms (a real one takes longer): long enough for a key probe to be seen in flight
    decodes = [StubWorker("decode", name=f"d{i}", latency=0.05) for i in range(n_decode)]
    purl = await prefill.start()
    durls = [await d.start() for d in decodes]
    port = free_port()
    argv = sglang_router_argv(port, "--pd-disaggregation", "--prefill", purl, "8998",
                              *sum((["--decode", u] for u in durls), []),
                              "--prefill-policy", "round_robin", "--decode-policy", "manual",
                              "--assignment-mode", "random", "--health-check-interval-secs", "1",
                              "--health-failure-threshold", "1")
    mport = argv[argv.index("--prometheus-port") + 1]
    smg = Smg(argv, f"http://127.0.0.1:{port}")
    try:
        await smg.start()
        yield smg.url, f"http://127.0.0.1:{mport}/metrics", prefill, decodes, smg
    finally:
        smg.stop()
        for w in [prefill, *decodes]:
            await w.stop()


async def send(http, url, k: int, seed: int, rid: str, stream: bool = False):
    body = {"text": topic_prompt(k, seed), "sampling_params": {"max_new_tokens": 2}, "stream": stream}
    async with http.post(url + "/generate", data=orjson.dumps(body), headers={"X-Request-Id": rid, "Content-Type": "application/json"}) as r:
        raw = await r.read()
        assert r.status == 200, raw
        if stream:
            first = [ln for ln in raw.decode().split("\n") if ln.startswith("data: {")][0]
            doc = orjson.loads(first[6:])
        else:
            doc = orjson.loads(raw)
        return doc["meta_info"]["server"], r.headers.get("X-ELDR-Worker"), r.headers.get("X-ELDR-Path")


async def test_smg_requests_land_on_the_eldr_decision_and_a_lost_worker_leaves():
    async with smg_cluster() as (url, metrics, prefill, decodes, proc):
        name = {d.url.rstrip("/"): d.name for d in decodes}
        pre = SmgPreRouter(url, LocalScorer(topic_artifact(), tokenizer()), metrics_url=metrics, refresh_s=0.2)
        async with adapter(pre) as (aurl, http):
            await until(lambda: len(pre.keys) == 2, 60, "a routing key learned for each decode worker")
            assert set(pre.keys) == set(name)
            landed = {}
            for i in range(12):
                k = i % 2
                served, pinned, path = await send(http, aurl, k, seed=i, rid=f"r{i}", stream=(i % 3 == 0))
                assert path == "pinned", path
                assert served == name[pinned], (i, served, pinned)  # landed where ELDR decided
                landed.setdefault(k, set()).add(served)
            # the decision follows the predicted region: each topic on its own worker
            assert len(landed[0]) == 1 and len(landed[1]) == 1 and landed[0] != landed[1]
            recorded = {d["rid"]: d for d in pre.decisions}
            assert all(recorded[f"r{i}"]["path"] == "pinned" for i in range(12))

            # a decode worker disappears: SMG marks it unhealthy, the adapter drops it
            gone = decodes[1]
            await gone.stop()
            await until(lambda: gone.url.rstrip("/") not in pre.workers, 30, "the lost worker leaves the mapping")
            assert gone.url.rstrip("/") not in pre.keys
            for i in range(6):
                served, pinned, path = await send(http, aurl, i % 2, seed=100 + i, rid=f"g{i}")
                assert served == decodes[0].name
                assert path == "pinned" and pinned == decodes[0].url.rstrip("/")


async def test_smg_adapter_failure_falls_back_to_smg_choice():
    async with smg_cluster() as (url, metrics, prefill, decodes, proc):
        # the scorer fails on every request: SMG chooses, nothing fails
        pre = SmgPreRouter(url, FailingScorer(), metrics_url=metrics, refresh_s=0.2)
        async with adapter(pre) as (aurl, http):
            await until(lambda: len(pre.workers) == 2, 30, "decode workers discovered")
            for i in range(6):
                served, pinned, path = await send(http, aurl, i % 2, seed=i, rid=f"f{i}")
                assert pinned == "-" and path == "fallback_scorer_error"
            assert pre.counters["fallback_scorer_error"] == 6
        # a remote scorer that is not running: same
        pre = SmgPreRouter(url, RemoteScorer(f"http://127.0.0.1:{free_port()}", timeout_s=0.2),
                           metrics_url=metrics, refresh_s=0.2)
        async with adapter(pre) as (aurl, http):
            await until(lambda: len(pre.workers) == 2, 30, "decode workers discovered")
            for i in range(4):
                served, pinned, path = await send(http, aurl, i % 2, seed=i, rid=f"x{i}")
                assert pinned == "-" and path.startswith("fallback_scorer")
        # the remote scorer up (a co-located ELDR router over the decode URLs): pinned by URL
        scoring = ColocatedRouter([d.url for d in decodes], artifact=topic_artifact(), tokenizer=tokenizer(),
                                  policy="eldr_balanced", health_interval=0, load_interval=0)
        runner, sport = await start_router(scoring)
        try:
            pre = SmgPreRouter(url, RemoteScorer(f"http://127.0.0.1:{sport}"), metrics_url=metrics,
                               refresh_s=0.2)
            async with adapter(pre) as (aurl, http):
                await until(lambda: len(pre.keys) == 2, 60, "keys learned")
                name = {d.url.rstrip("/"): d.name for d in decodes}
                seen = set()
                for i in range(6):
                    served, pinned, path = await send(http, aurl, i % 2, seed=i, rid=f"s{i}")
                    assert path == "pinned" and served == name[pinned]
                    seen.add(served)
                assert len(seen) == 2
        finally:
            await runner.cleanup()
        # region keys: no probes, each predicted region sticks to one worker of SMG's choosing
        pre = SmgPreRouter(url, LocalScorer(topic_artifact(), tokenizer()), key_mode="region", refresh_s=0.2)
        async with adapter(pre) as (aurl, http):
            await until(lambda: len(pre.workers) == 2, 30, "decode workers discovered")
            by_region = {}
            for i in range(8):
                served, _, path = await send(http, aurl, i % 2, seed=i, rid=f"k{i}")
                assert path == "pinned"
                by_region.setdefault(i % 2, set()).add(served)
            assert all(len(v) == 1 for v in by_region.values())


async def test_smg_restart_is_detected_and_keys_relearned():
    """A real SMG 0.3.2 restart (same flags): its new worker ids suspend every key until a
    probe re-learns it; afterwards every pinned request lands where ELDR decided."""
    async with smg_cluster() as (url, metrics, prefill, decodes, smg):
        name = {d.url.rstrip("/"): d.name for d in decodes}
        pre = SmgPreRouter(url, LocalScorer(topic_artifact(), tokenizer()), metrics_url=metrics, refresh_s=0.2)
        async with adapter(pre) as (aurl, http):
            await until(lambda: len(pre.keys) == 2, 60, "a routing key learned for each decode worker")
            for i in range(6):
                served, pinned, path = await send(http, aurl, i % 2, seed=i, rid=f"a{i}")
                assert path == "pinned" and served == name[pinned]
            await smg.restart()
            await until(lambda: pre.counters["smg_restarts"] == 1, 30, "the restart is detected")
            await until(lambda: len(pre.keys) == 2, 60, "keys re-learned after the restart")
            for i in range(12):
                served, pinned, path = await send(http, aurl, i % 2, seed=200 + i, rid=f"b{i}")
                assert path == "pinned" and served == name[pinned], (i, served, pinned)
