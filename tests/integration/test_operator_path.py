"""The operator path with the default policy: decisions without a similarity (no
artifact, a layer mismatch) never break the router's ``/metrics``; a router started
for a policy that reads an artifact, without one, says so."""

import logging

import pytest

from eldr_sglang.router.app import Router
from eldr_sglang.testing.stub_worker import ToyArtifact
from tests.integration.helpers import BOOT_PORT, cluster, post

pytestmark = pytest.mark.timeout(60)


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.parametrize("artifact", [None, "other_layers"])
async def test_metrics_answer_after_decisions_without_a_similarity(artifact):
    kw = {}
    if artifact == "other_layers":  # the artifact's layers differ from the signatures' (a fallback)
        kw["artifact"] = ToyArtifact(num_clusters=2, layers=(3, 10))
    async with cluster(n_decode=2, policy="eldr_balanced", **kw) as (router, url, prefill, decodes, http):
        for i in range(6):
            status, _ = await post(http, f"{url}/generate", {"text": f"hello {i}"})
            assert status == 200
        async with http.get(f"{url}/metrics") as r:
            body = await r.text()
            assert r.status == 200, body[:300]
        assert _sample(body, "eldr_router_band_size_count") == 6  # every decision observed
        # a second scrape still answers (nothing pending was lost or left poisoned)
        async with http.get(f"{url}/metrics") as r:
            assert r.status == 200


async def test_policy_that_reads_an_artifact_warns_when_started_without_one(caplog):
    caplog.set_level(logging.WARNING, logger="eldr_sglang.router")
    Router([("http://127.0.0.1:1", BOOT_PORT)], ["http://127.0.0.1:2", "http://127.0.0.1:3"],
           "eldr_balanced")
    assert any("--calibration" in r.getMessage() and "eldr_balanced" in r.getMessage()
               for r in caplog.records if r.levelno >= logging.WARNING)
    caplog.clear()
    Router([("http://127.0.0.1:1", BOOT_PORT)], ["http://127.0.0.1:2", "http://127.0.0.1:3"], "round_robin")
    assert not any("--calibration" in r.getMessage() for r in caplog.records)


def test_a_centroid_count_other_than_the_decode_count_is_said_at_start(caplog):
    caplog.set_level(logging.WARNING, logger="eldr_sglang.router")
    Router([("http://127.0.0.1:1", BOOT_PORT)], ["http://127.0.0.1:2", "http://127.0.0.1:3"],
           "eldr_balanced", artifact=ToyArtifact(num_clusters=3))
    assert any("3 centroids for 2 decode servers" in r.getMessage() for r in caplog.records)


async def test_selfcheck_pointed_at_the_router_says_it_is_a_router(capsys):
    import asyncio

    from eldr_sglang import selfcheck

    async with cluster(n_decode=2, policy="eldr_balanced") as (router, url, prefill, decodes, http):
        rc = await asyncio.to_thread(selfcheck.main, [url, "--prompts", "1", "--timeout", "10"])
    out = capsys.readouterr().out
    assert rc == 1 and "this is a router, not an engine" in out and "1 prefill and 2 decode" in out, out
