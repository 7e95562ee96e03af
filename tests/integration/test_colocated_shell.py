"""The co-located router is the PD router's server shell with another flow: the
calibration reload (admin POST and a followed file), the decision log, membership
changes and A/B slices work on it as on the PD router, with the same answers."""

import aiohttp
import numpy as np
import orjson

from eldr_sglang.core import CalibrationArtifact
from eldr_sglang.router.colocated import ColocatedRouter
from eldr_sglang.router.http.serve import start_router
from eldr_sglang.testing.stub_worker import StubWorker
from tests.helpers import until
from tests.integration.helpers import post
from tests.integration.test_colocated import TOPICS, colocated, make_artifact, topic_ids


def _rotated(art: CalibrationArtifact, shift: int) -> CalibrationArtifact:
    """The same artifact with its regions moved ``shift`` servers along."""
    return CalibrationArtifact(model=art.model, variant=art.variant, layers=art.layers, idf=art.idf,
                               centroids=np.roll(art.centroids, shift, axis=0), tau=art.tau,
                               predictor=art.predictor)


async def _server_for(http, url, k: int) -> str:
    status, raw = await post(http, f"{url}/generate", {"input_ids": topic_ids(k, seed=5)})
    assert status == 200, raw
    return orjson.loads(raw)["meta_info"]["server"]


async def test_calibration_reload_moves_regions_and_is_logged(tmp_path):
    art = make_artifact()
    async with colocated(artifact=art) as (router, url, workers, http):
        assert await _server_for(http, url, 1) == "w1"
        path = _rotated(art, 1).save(tmp_path / "rotated.json")
        status, raw = await post(http, f"{url}/eldr/calibration", {"path": str(path)})
        assert status == 200, raw
        assert orjson.loads(raw)["ok"] is True
        assert await _server_for(http, url, 1) == "w2"  # topic 1's region is server 2's now
        status, raw = await post(http, f"{url}/eldr/calibration", {"path": str(tmp_path / "none.json")})
        assert status == 400 and b"previous kept" in raw
        assert await _server_for(http, url, 1) == "w2"
        async with http.get(f"{url}/eldr/decisions?last=2") as r:
            assert r.status == 200
            records = await r.json()
        assert records[-1]["decode"] == router.pool.decodes[2].url
        assert records[-1]["policy"] == "eldr"


async def test_membership_change_and_readiness_by_role():
    async with colocated() as (router, url, workers, http):
        extra = StubWorker("decode", name="w4")
        try:
            new = await extra.start()
            status, raw = await post(http, f"{url}/eldr/servers", {"add": [new]})
            assert status == 200, raw
            assert len(router.pool.decodes) == TOPICS + 1
            status, raw = await post(http, f"{url}/eldr/servers", {"add_prefill": ["http://127.0.0.1:1 8998"]})
            assert status == 400 and b"no prefill servers" in raw
            async with http.get(f"{url}/ready") as r:
                ready = await r.json()
            assert r.status == 200 and ready["servers"] == {"worker": TOPICS + 1}
        finally:
            await extra.stop()


async def test_followed_calibration_file_is_picked_up(tmp_path):
    art = make_artifact()
    path = art.save(tmp_path / "live.json")
    workers = [StubWorker("decode", name=f"w{i}") for i in range(TOPICS)]
    urls = [await w.start() for w in workers]
    router = ColocatedRouter(urls, artifact=art, policy="eldr", health_interval=0, load_interval=0,
                             calibration=str(path), calibration_watch=0.05)
    runner, port = await start_router(router)
    try:
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{port}"
            assert await _server_for(http, url, 3) == "w3"
            _rotated(art, 1).save(path)
            await until(lambda: router.metrics.value("calibration_reloads", outcome="ok") >= 1)
            assert await _server_for(http, url, 3) == "w0"
    finally:
        await runner.cleanup()
        for w in workers:
            await w.stop()


async def test_ab_slices_run_on_the_colocated_flow():
    workers = [StubWorker("decode", name=f"w{i}") for i in range(TOPICS)]
    urls = [await w.start() for w in workers]
    router = ColocatedRouter(urls, artifact=make_artifact(), policy="eldr", ab_policies="eldr,round_robin",
                             ab_slice=3600, health_interval=0, load_interval=0)
    runner, port = await start_router(router)
    try:
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{port}"
            await until(lambda: router.state.arm is not None)
            names = {router.routing.name}
            await _server_for(http, url, 0)
            assert router.ab.current.requests == 1  # counted in its arm's slice
            router.state.use_arm(router.state.arm + 1)
            names.add(router.routing.name)
            await _server_for(http, url, 0)
            assert names == {"eldr", "round_robin"}
            async with http.get(f"{url}/eldr/status") as r:
                status = await r.json()
            assert status["mode"] == "colocated" and status["ab"]["arms"] == ["eldr", "round_robin"]
    finally:
        await runner.cleanup()
        for w in workers:
            await w.stop()
