"""The router under hostile load: mismatched signatures, memory the byte cap must
count, big bodies, bursts, slow clients, foreign signature shapes (stub workers)."""

import asyncio
import socket
import threading

import aiohttp
import orjson
import pytest

from eldr_sglang.router.app import Router, start_router
from eldr_sglang.router.signatures import SignatureBoard, parse_message
from eldr_sglang.testing.stub_worker import StubWorker, ToyArtifact, topic_counts
from tests.integration.helpers import BOOT_PORT, cluster, post, run, until

pytestmark = pytest.mark.timeout(60)


def three_layer_counts(text):
    return topic_counts(text, layers=(0, 1, 2))


# ------------------------------------------------------------------ 1. mismatched signatures
def test_signature_that_does_not_fit_the_policy_is_a_counted_fallback_never_a_500():
    async def main():
        async with cluster(n_decode=2, policy="state_aware") as (router, url, prefill, decodes, http):
            st, raw = await post(http, f"{url}/generate", {"text": "topic:0"})
            assert st == 200, raw
            # the plugin restarts with another layer set: 3 layers instead of 2
            prefill.layers, prefill.counts_fn = [0, 1, 2], three_layer_counts
            for i in range(5):
                st, raw = await post(http, f"{url}/generate", {"text": f"topic:{i % 2} {i}"})
                assert st == 200, raw
            assert all(d.inflight == 0 for d in router.pool.decodes)
            assert router.policy.describe()["live"] == [0, 0]
            assert router.metrics.value("fallbacks", reason="policy_mismatch") == 5
            assert all(d.breaker.state == "closed" for d in router.pool.decodes)
    run(main())


def test_a_failing_admit_releases_the_decode_and_aborts_the_prefill():
    async def main():
        async with cluster(n_decode=2, policy="state_aware") as (router, url, prefill, decodes, http):
            def broken_admit(index, request):
                raise RuntimeError("policy bug")
            router.routing.policy.admit = broken_admit
            st, raw = await post(http, f"{url}/generate", {"text": "topic:0", "rid": "bad-admit"})
            assert st == 500 and "error" in orjson.loads(raw)
            assert all(d.inflight == 0 for d in router.pool.decodes)
            assert all(d.breaker.state == "closed" and not d.breaker.trial_out
                       for d in router.pool.decodes)
            await until(lambda: "bad-admit" in prefill.aborts, what="abort to the prefill")
    run(main())


# ------------------------------------------------------------------ 2. byte cap
def test_signature_fields_are_bounded_and_the_whole_message_is_counted():
    async def main():
        async with cluster(n_decode=2, signature_buffer=1000) as (router, url, prefill, decodes, http):
            counts = topic_counts("topic:0")
            long_rid = {"bootstrap_room": 7, "rid": "r" * 100_000, "layers": [0, 1], "counts": counts}
            st, raw = await post(http, f"{url}/eldr/signature", long_rid)
            assert st == 400 and "rid" in orjson.loads(raw)["error"]
            many_layers = {"bootstrap_room": 8, "layers": list(range(5000)), "counts": [[1]] * 5000}
            st, raw = await post(http, f"{url}/eldr/signature", many_layers)
            assert st == 400 and "layers" in orjson.loads(raw)["error"]
            padded = [{"bootstrap_room": 100 + i, "rid": f"r{i}", "layers": [0, 1], "counts": counts,
                       "pad": "x" * 50_000} for i in range(20)]
            st, raw = await post(http, f"{url}/eldr/signature", padded)
            assert st == 200 and orjson.loads(raw)["buffered"] == 20
            for _, msg, size in router.board.buffer.values():
                assert "pad" not in msg  # only the contract's fields are kept
                assert size >= SignatureBoard.size_of(msg) >= len(msg["rid"]) + msg["counts"].nbytes
            assert router.board.buffered_bytes == sum(s for _, _, s in router.board.buffer.values())
    run(main())


def test_size_of_counts_rid_and_layers():
    base = parse_message({"bootstrap_room": 1, "layers": [0, 1], "counts": [[1] * 8] * 2})
    with_rid = parse_message({"bootstrap_room": 1, "layers": [0, 1], "counts": [[1] * 8] * 2,
                              "rid": "x" * 200})
    assert SignatureBoard.size_of(with_rid) - SignatureBoard.size_of(base) >= 200


# ------------------------------------------------------------------ 6. online window
def test_foreign_signature_shape_never_resets_the_online_window():
    async def main():
        async with cluster(n_decode=2, policy="eldr", artifact=None, online=True,
                           online_min_signatures=10_000, online_fit_in="thread") as (
                router, url, prefill, decodes, http):
            for i in range(12):
                st, raw = await post(http, f"{url}/generate", {"text": f"topic:{i % 2} {i}"})
                assert st == 200, raw
            window = router.online.calibrator.window
            await until(lambda: len(window) == 12, what="12 signatures in the window")
            foreign = {"bootstrap_room": 5, "layers": [3, 4, 5], "counts": [[1] * 16] * 3}
            st, raw = await post(http, f"{url}/eldr/signature", foreign)
            assert len(window) == 12 and window.resets == 0
            assert router.metrics.value("errors", kind="signature_online_mismatch") == 1
            huge = {"bootstrap_room": 6, "layers": [0, 1], "counts": [[1] * 8] * 2}
            for _ in range(3):
                await post(http, f"{url}/eldr/signature", huge)
            assert len(window) == 15  # same shape: taken
    run(main())
