"""ELDR pinned in NVIDIA Dynamo (ai-dynamo 1.6.1, its own virtualenv) by the pre-router of
eldr_sglang.integrations: a loopback-only Dynamo (frontend with the KV router, file
discovery, TCP request plane, ZMQ event plane through a loopback broker) in front of
``python -m dynamo.mocker`` prefill + 2 decode workers. Requests land on the decode
instance the ELDR decision names (Dynamo reports it per request in
``nvext.worker_id``), a decode worker that stops leaves the mapping, and the adapter's
own failure leaves the choice to Dynamo's router without failing a request.

Dynamo is installed by scripts/install_dynamo.sh (skipped with the reason when it
cannot be installed or imported; ELDR_SKIP_DYNAMO=1 skips without trying)."""

from __future__ import annotations

import contextlib
import os
import subprocess

import orjson
import pytest

from eldr_sglang.integrations import DynamoPreRouter, LocalScorer, RemoteScorer
from eldr_sglang.integrations.dynamo_local import ROOT, LocalDynamo, dynamo_importable, free_port
from tests.helpers import LOG_DIR, until
from tests.integration.integrations_helpers import FailingScorer, adapter, tokenizer, topic_artifact, topic_prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dynamo_ready():
    if os.environ.get("ELDR_SKIP_DYNAMO"):
        pytest.skip("ELDR_SKIP_DYNAMO is set")
    ok, why = dynamo_importable()
    if not ok and not os.environ.get("ELDR_DYNAMO_PYTHON"):
        r = subprocess.run(["bash", str(ROOT / "scripts" / "install_dynamo.sh")], capture_output=True,
                           text=True, timeout=900)
        ok, why = dynamo_importable()
        if not ok:
            why += f"; install_dynamo.sh exited {r.returncode}: {r.stderr.strip()[-300:]}"
    if not ok:
        pytest.skip(f"ai-dynamo not available: {why}")
    return why


@pytest.fixture
def dynamo(dynamo_ready):
    log_dir = LOG_DIR / "dynamo"
    log_dir.mkdir(parents=True, exist_ok=True)
    d = LocalDynamo(log_dir=log_dir, speedup=10.0).start()
    try:
        yield d
    finally:
        d.stop()


async def send(http, url, model, k: int, seed: int, rid: str, stream: bool = False):
    """One completion; (decode instance that served it, adapter's pin, adapter's path)."""
    body = {"model": model, "prompt": topic_prompt(k, seed), "max_tokens": 2, "stream": stream,
            "nvext": {"extra_fields": ["worker_id"]}}
    async with http.post(url + "/v1/completions", data=orjson.dumps(body),
                         headers={"X-Request-Id": rid, "Content-Type": "application/json"}) as r:
        raw = await r.read()
        assert r.status == 200, raw
        docs = ([orjson.loads(ln[6:]) for ln in raw.decode().split("\n") if ln.startswith("data: {")]
                if stream else [orjson.loads(raw)])
        ids = [d["nvext"]["worker_id"] for d in docs if (d.get("nvext") or {}).get("worker_id")]
        assert ids, raw[:300]
        return str(ids[-1]["decode_worker_id"]), r.headers.get("X-ELDR-Worker"), r.headers.get("X-ELDR-Path")


async def test_dynamo_requests_land_on_the_eldr_decision_and_a_stopped_worker_leaves(dynamo):
    pre = DynamoPreRouter(dynamo.url, LocalScorer(topic_artifact(), tokenizer()), refresh_s=0.2)
    async with adapter(pre) as (aurl, http):
        await until(lambda: len(pre.workers) == 2 and pre.prefills, 30, "decode and prefill instances mapped")
        assert pre.workers == dynamo.instances("backend")  # discovered from the frontend, not typed
        transports = [i["transport"]["tcp"] for i in dynamo.health()["instances"]]
        assert transports and all(t.startswith("127.0.0.1:") for t in transports)  # advertised on loopback
        dynamo.check_loopback()
        landed = {}
        for i in range(10):
            k = i % 2
            served, pinned, path = await send(http, aurl, dynamo.model_name, k, seed=i, rid=f"r{i}",
                                              stream=(i % 3 == 0))
            assert path == "pinned", path
            assert served == pinned, (i, served, pinned)  # landed on the ELDR decision
            landed.setdefault(k, set()).add(served)
        assert len(landed[0]) == 1 and len(landed[1]) == 1 and landed[0] != landed[1]
        assert [d["path"] for d in pre.decisions] == ["pinned"] * 10

        # one decode worker stops (SIGTERM): it leaves Dynamo's discovery, then the mapping
        before = set(dynamo.instances("backend"))
        dynamo.stop_process("decode1")
        await until(lambda: len(dynamo.instances("backend")) == 1, 30, "the instance leaves discovery")
        left = set(dynamo.instances("backend"))
        lost = before - left
        await until(lambda: pre.workers == sorted(left), 30, "the stopped worker leaves the mapping")
        assert not lost & set(pre.workers)
        for i in range(6):
            served, pinned, path = await send(http, aurl, dynamo.model_name, i % 2, seed=50 + i, rid=f"g{i}")
            assert path == "pinned" and served == pinned and served in left


class GhostScorer:
    """Always picks a decode instance id that Dynamo does not know."""

    async def choose(self, body, endpoint, workers, loads):
        from eldr_sglang.integrations import Choice
        return Choice("4242424242" if "4242424242" in workers else workers[0], 0)

    def release(self, choice):
        pass


async def test_dynamo_adapter_failure_falls_back_to_dynamo_choice(dynamo):
    for scorer in (FailingScorer(), RemoteScorer(f"http://127.0.0.1:{free_port()}", timeout_s=0.2)):
        pre = DynamoPreRouter(dynamo.url, scorer, refresh_s=0.2)
        async with adapter(pre) as (aurl, http):
            await until(lambda: len(pre.workers) == 2, 30, "decode instances mapped")
            for i in range(4):
                served, pinned, path = await send(http, aurl, dynamo.model_name, i % 2, seed=i, rid=f"f{i}")
                assert pinned == "-" and path.startswith("fallback_scorer"), path
                assert served in pre.workers

    # a pinned instance the frontend refuses (unknown id: 400; crashed but listed: 503):
    # the request is sent again unpinned (Dynamo's choice) and the instance quarantined
    pre = DynamoPreRouter(dynamo.url, GhostScorer(), refresh_s=0.2, quarantine_s=60)
    pre.set_workers = lambda ws, _s=pre.set_workers: _s([*ws, "4242424242"])  # a stale mapping entry
    async with adapter(pre) as (aurl, http):
        await until(lambda: len(pre.workers) == 3, 30, "decode instances mapped")
        served, pinned, path = await send(http, aurl, dynamo.model_name, 0, seed=7, rid="q0")
        assert path == "retried_unpinned" and pinned == "-" and served in dynamo.instances("backend")
        assert "4242424242" in pre.quarantined and pre.counters["retried_unpinned"] == 1
        served, pinned, path = await send(http, aurl, dynamo.model_name, 1, seed=8, rid="q1")
        assert path == "pinned" and served == pinned  # the quarantined id is no longer chosen
        # a request the host refuses anyway (bad body) is not the pin's fault: no quarantine
        pre.quarantined.clear()
        async with http.post(aurl + "/v1/completions", data=b'{"model": "nope", "prompt": 5}',
                             headers={"Content-Type": "application/json"}) as r:
            assert r.status >= 400
        assert not pre.quarantined


class Pick:
    """Always the decode instance ``worker`` (set once the instances are known)."""

    def __init__(self) -> None:
        self.worker = ""

    async def choose(self, body, endpoint, workers, loads):
        from eldr_sglang.integrations import Choice
        return Choice(self.worker, 0)

    def release(self, choice):
        pass


async def test_real_frontend_busy_answer_and_decode_only_pin(dynamo_ready):
    """Dynamo 1.6.1's own admission control: a pinned decode worker over its busy threshold
    is answered 529 "Service temporarily overloaded"; the pre-router retries unpinned
    (Dynamo picks the free worker) and quarantines nothing. A decode-only pin is answered
    400 in disaggregated mode: retried, then both headers from the next request on."""
    import asyncio

    import aiohttp

    log_dir = LOG_DIR / "dynamo_busy"
    log_dir.mkdir(parents=True, exist_ok=True)
    d = LocalDynamo(log_dir=log_dir, speedup=1.0, frontend_args=["--active-decode-blocks-threshold", "0.0001"])
    d.start()
    try:
        busy, free = d.instances("backend")
        pick = Pick()
        pre = DynamoPreRouter(d.url, pick, refresh_s=0.2, quarantine_s=60, pin_prefill=False)
        async with adapter(pre) as (aurl, http):
            await until(lambda: len(pre.workers) == 2 and pre.prefills, 30, "instances mapped")
            pick.worker = free
            served, pinned, path = await send(http, aurl, d.model_name, 0, seed=1, rid="d0")
            assert path == "retried_decode_only" and not pre.quarantined and pre.pin_prefill
            served, pinned, path = await send(http, aurl, d.model_name, 0, seed=2, rid="d1")
            assert path == "pinned" and served == pinned == free
            # a long request keeps `busy` over its threshold (pinned straight at the frontend)
            async def long_request():
                async with http.post(d.url + "/v1/completions", headers={
                        "x-dynamo-worker-instance-id": busy, "x-dynamo-prefill-instance-id": pre.prefills[0]},
                        json={"model": d.model_name, "prompt": "long " * 500, "max_tokens": 4000}) as r:
                    await r.read()

            hold = asyncio.create_task(long_request())
            await asyncio.sleep(1.5)
            body = {"model": d.model_name, "prompt": "short", "max_tokens": 2}
            async with http.post(d.url + "/v1/completions", json=body, headers={
                    "x-dynamo-worker-instance-id": busy, "x-dynamo-prefill-instance-id": pre.prefills[0]}) as r:
                raw = await r.read()
                assert r.status == 529 and b"Service temporarily overloaded" in raw, (r.status, raw)
            pick.worker = busy
            served, pinned, path = await send(http, aurl, d.model_name, 0, seed=3, rid="b0")
            assert path == "retried_busy" and served == free and pinned == "-"
            assert not pre.quarantined and pre.counters["pinned_busy"] == 1
            hold.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                await hold
    finally:
        d.stop()
