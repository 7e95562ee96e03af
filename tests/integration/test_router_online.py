"""``--online``: a router without an artifact learns one from live signatures, refits on
membership changes and on request, persists it, and replicas follow the file."""

from __future__ import annotations

import contextlib
import json

import pytest

from eldr_sglang.core.artifact import load_artifact
from eldr_sglang.router import Router, start_router
from eldr_sglang.testing.stub_worker import StubWorker
from tests.integration.helpers import BOOT_PORT, cluster, post, until

pytestmark = pytest.mark.timeout(60)
TOPICS = 4


@contextlib.asynccontextmanager
async def online_cluster(n_decode=4, **router_kw):
    """Stubs and a router with ``--online`` and no artifact; signatures come to each
    request's return address."""
    router_kw.setdefault("online_min_signatures", 40)
    router_kw.setdefault("online_fit_in", "thread")
    router_kw.setdefault("signature_port", 0)
    async with cluster(n_decode, "eldr", artifact=None, online=True, health_interval=0, load_interval=0,
                       push_url=False, **router_kw) as parts:
        assert parts[2].signature_url is None
        yield parts


async def send(http, url, n, start=0):
    for i in range(start, start + n):
        status, body = await post(http, f"{url}/generate", {"text": f"topic:{i % TOPICS} item {i}"})
        assert status == 200, body


def decode_of(router, last):
    return [rec.decode for rec in list(router.decisions)[-last:]]


async def test_starts_without_artifact_routes_by_load_then_by_signature(tmp_path):
    out = tmp_path / "live.json"

    async with online_cluster(calibration_out=str(out)) as (router, url, prefill, decodes, http):
        assert router.routing.name == "jsq" and router.calibration_info()["online"]["state"] == "warming"
        await send(http, url, 39)
        assert router.online.calibrator.generation == 0  # 39 < 40: still by load
        assert router.metrics.value("calibration_online") == 1
        await send(http, url, 1, start=39)
        await until(lambda: router.online.calibrator.generation == 1, what="first fit")
        assert router.routing.name == "eldr"
        assert router.metrics.value("calibration_refits", reason="initial") == 1
        assert router.metrics.value("calibration_online") == 2
        # now each topic has one home server
        await send(http, url, 4 * TOPICS, start=100)
        picks = decode_of(router, 4 * TOPICS)
        homes = {}
        for i, d in enumerate(picks):
            homes.setdefault(i % TOPICS, set()).add(d)
        assert all(len(v) == 1 for v in homes.values()), homes
        assert len(set().union(*homes.values())) == TOPICS
        info = router.calibration_info()
        assert info["provenance"]["mode"] == "online" and info["provenance"]["n_requests"] == 40
        # persisted: same artifact, loadable by the offline loader
        saved = load_artifact(out)
        assert saved.checksum() == info["checksum"]
        async with http.get(f"{url}/eldr/calibration") as r:
            got = await r.json()
        assert got["online"]["generation"] == 1 and got["path"] == str(out)
        async with http.get(f"{url}/metrics") as r:
            text = await r.text()
        assert "eldr_router_calibration_age_seconds" in text
        assert 'eldr_router_calibration_refits_total{reason="initial"} 1.0' in text

    # a restart continues from the written artifact (no warm-up)
    async with online_cluster(calibration=str(out)) as (router, url, prefill, decodes, http):
        assert router.routing.name == "eldr"
        assert router.calibration_info()["provenance"]["mode"] == "online"
        assert router.online.calibrator.state == "fitted"


async def test_decode_server_join_refits_with_one_more_region_and_admin_refit():
    async with online_cluster(n_decode=3, online_min_signatures=30) as (router, url, prefill, decodes, http):
        await send(http, url, 30)
        await until(lambda: router.online.calibrator.generation == 1, what="first fit")
        new = StubWorker("decode", name="d3")
        durl = await new.start()
        try:
            status, _ = await post(http, f"{url}/eldr/servers", {"add": [durl]})
            assert status == 200
            await until(lambda: router.online.calibrator.generation == 2, what="membership refit")
            assert router.routing.encoder.centroids.shape[0] == 4
            assert router.metrics.value("calibration_refits", reason="membership") == 1
            churn = router.online.calibrator.history[-1].churn
            assert churn is not None and churn <= 1 / 4 + 0.10 + 1e-9
            status, body = await post(http, f"{url}/eldr/calibration", {"refit": True})
            assert status == 202, body
            await until(lambda: router.online.calibrator.generation == 3, what="manual refit")
            assert router.metrics.value("calibration_refits", reason="manual") == 1
        finally:
            await new.stop()


async def test_refit_without_online_is_a_clear_400():


    async with cluster(n_decode=2) as (router, url, *_rest, http):
        status, body = await post(http, f"{url}/eldr/calibration", {"refit": True})
        assert status == 400 and b"--online" in body


async def test_replica_follows_the_written_artifact(tmp_path):
    """A replica with --calibration-watch starts by load before the file exists and
    switches when the --online router writes it."""
    out = tmp_path / "live.json"

    async with online_cluster(calibration_out=str(out)) as (leader, url, prefill, decodes, http):
        follower = Router([(prefill.url if hasattr(prefill, "url") else leader.prefills[0].url, BOOT_PORT)],
                          [d.url for d in leader.decodes], "eldr", calibration=str(out),
                          calibration_watch=0.05, health_interval=0, load_interval=0)
        runner, _ = await start_router(follower)
        try:
            assert follower.routing.name == "jsq"
            await send(http, url, 40)
            await until(lambda: follower.routing.name == "eldr", what="follower reload")
            assert follower.routing.encoder.artifact.checksum() == load_artifact(out).checksum()
            out.write_text("{half written")  # a bad file keeps the live artifact
            await until(lambda: follower.watcher.errors == 1, what="refused reload")
            assert follower.routing.name == "eldr"
        finally:
            await runner.cleanup()


def test_online_flags_are_validated():
    from eldr_sglang.router.config import RouterConfig

    with pytest.raises(ValueError, match="online_window"):
        RouterConfig(online=True, online_min_signatures=100, online_window=10)
    with pytest.raises(ValueError, match="calibration_out"):
        RouterConfig(online=True, workers=2, port=8000)
    with pytest.raises(ValueError, match="calibration_watch"):
        RouterConfig(calibration_watch=1.0)
    json.dumps(RouterConfig(online=True).online_settings().__dict__)
