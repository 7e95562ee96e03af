"""A/B on live traffic: time-sliced alternation, slice records, shadow decisions, verdict CLI."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from aiohttp import web

from eldr_sglang import ab
from eldr_sglang.router.state.ab import parse_prometheus
from eldr_sglang.testing.stub_worker import ToyArtifact
from tests.integration.helpers import cluster, post, until

pytestmark = pytest.mark.timeout(60)


class EngineMetrics:
    """A decode server's plugin endpoint: counters that grow by ``per_scrape`` each read."""

    def __init__(self, unique: float, batch: float) -> None:
        self.unique, self.batch, self.reads = unique, batch, 0
        self.runner = None

    async def handle(self, request: web.Request) -> web.Response:
        self.reads += 1
        steps = 10.0 * self.reads
        return web.Response(text=(
            "# TYPE eldr_decode_steps_total gauge\n"
            f"eldr_decode_steps_total {steps}\n"
            f"eldr_decode_tokens_total {steps * self.batch}\n"
            f"eldr_decode_unique_experts_total {steps * self.unique}\n"))

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/metrics", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/metrics"


def test_parse_prometheus_sums_labelled_samples():
    text = '# HELP x\nfoo{a="1"} 2.5\nfoo{a="2"} 1\nfoo_bar 7\nbaz 1e3\n'
    assert parse_prometheus(text, ("foo", "baz")) == {"foo": 3.5, "baz": 1000.0}


async def test_time_sliced_ab_alternates_and_records_each_slice(tmp_path):
    record = tmp_path / "ab.jsonl"

    engines = [EngineMetrics(40.0, 3.0), EngineMetrics(50.0, 5.0)]
    urls = [await e.start() for e in engines]
    try:
        async with cluster(n_decode=2, artifact=ToyArtifact(num_clusters=2), ab_policies="eldr,round_robin",
                           ab_slice=0.4, ab_record=str(record), engine_metrics=",".join(urls)) as (
                router, url, prefill, decodes, http):
            sent = 0
            while len(router.ab.written) < 4:
                status, _ = await post(http, f"{url}/generate", {"text": f"topic:{sent % 2} x"})
                assert status == 200
                sent += 1
                await asyncio.sleep(0.01)
            status = router.status()["ab"]
            assert status["arms"] == ["eldr", "round_robin"]
    finally:
        for e in engines:
            await e.runner.cleanup()
    recs = [json.loads(line) for line in record.read_text().splitlines()]
    assert [r["arm"] for r in recs[:4]] == ["eldr", "round_robin", "eldr", "round_robin"]
    assert [r["slice"] for r in recs[:4]] == [0, 1, 2, 3]
    assert sum(r["requests"] for r in recs) <= sent and all(r["errors"] == 0 for r in recs)
    assert all(r["requests"] > 0 for r in recs[:4])
    r0 = recs[0]
    # each endpoint answered 10 steps per read: totals over both servers
    assert r0["decode_steps"] == 20.0
    assert r0["unique_per_step"] == pytest.approx((10 * 40 + 10 * 50) / 20)
    assert r0["mean_batch"] == pytest.approx((10 * 3 + 10 * 5) / 20)
    assert r0["tpot_mean_s"] is None  # the stubs export no SGLang histograms
    assert r0["latency_p50_s"] > 0 and r0["end"] > r0["start"]


async def test_shadow_policy_logs_what_eldr_would_have_chosen():
    async with cluster(n_decode=4, policy="round_robin", artifact=ToyArtifact(num_clusters=4),
                       shadow_policy="eldr", signature_port=0) as (router, url, prefill, decodes, http):
        prefill.signature_url = None  # signatures go to each request's return address
        for i in range(8):
            status, _ = await post(http, f"{url}/generate", {"text": f"topic:{i % 4} item"})
            assert status == 200
        await until(lambda: router.metrics.value("shadow_decisions") == 8, what="shadow outcomes")
        async with http.get(f"{url}/eldr/decisions?last=8") as r:
            log = await r.json()
        outcomes = [d["shadow"]["outcome"] for d in log]
        assert set(outcomes) <= {"same", "different"}
        # eldr sends topic t to server t: 4 topics, 4 shadow homes, round robin routed
        assert all(d["policy"] == "round_robin" for d in log)
        homes = {d["shadow"]["decode"] for d in log}
        assert len(homes) == 4
        same = router.metrics.value("shadow_decisions", outcome="same")
        assert same == outcomes.count("same")


def _records(effect: float, n: int = 8, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(2 * n):
        arm = "eldr" if i % 2 else "jsq"
        batch = rng.uniform(4, 12)
        unique = 30 * np.log(batch) * (1 + (effect if arm == "eldr" else 0)) + rng.normal(0, 0.5)
        recs.append({"arm": arm, "start": float(i), "end": i + 1.0, "requests": 10, "unique_per_step": unique,
                     "mean_batch": batch, "throughput_rps": 10 + rng.normal(0, 0.1),
                     "latency_p50_s": 1.0 + rng.normal(0, 0.01)})
    return recs


def test_verdict_finds_a_planted_effect_at_equal_batch_size_and_not_a_null_one():
    found = ab.verdict(_records(-0.10), baseline="jsq")["comparisons"]["eldr"]["unique_per_step_equal_batch"]
    assert found["ci_high"] < 0 and found["relative"] == pytest.approx(-0.10, abs=0.03)
    null = ab.verdict(_records(0.0), baseline="jsq")["comparisons"]["eldr"]["unique_per_step_equal_batch"]
    assert null["ci_low"] < 0 < null["ci_high"]


def test_verdict_cli_prints_plots_and_refuses_bad_files(tmp_path, capsys):
    f = tmp_path / "ab.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in _records(-0.1)) + "\n")
    out = tmp_path / "v.json"
    assert ab.main([str(f), "--baseline", "jsq", "--plot", str(tmp_path / "ab.png"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "eldr vs jsq" in text and "at equal batch size" in text and "fewer" in text
    assert (tmp_path / "ab.png").stat().st_size > 1000
    assert json.loads(out.read_text())["baseline"] == "jsq"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arm": "x", "start": 1}\nnot json\n')
    with pytest.raises(SystemExit) as e:
        ab.main([str(bad)])
    assert e.value.code == 2 and "bad.jsonl:2: not JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main([str(f), "--baseline", "nope"])
    assert "not an arm" in capsys.readouterr().err


def test_ab_flags_are_validated():
    from eldr_sglang.router.config import RouterConfig

    with pytest.raises(ValueError, match="ab_policies"):
        RouterConfig(ab_policies="eldr")
    with pytest.raises(ValueError, match="ab_policies"):
        RouterConfig(ab_policies="eldr,jsq", online=True)
    with pytest.raises(ValueError, match="ab_slice"):
        RouterConfig(ab_slice=0)


async def test_membership_changes_reach_every_ab_arm_and_the_shadow():
    async with cluster(n_decode=3, artifact=ToyArtifact(num_clusters=3), ab_policies="round_robin,eldr",
                       ab_slice=60, shadow_policy="eldr") as (router, url, prefill, decodes, http):
        status, _ = await post(http, f"{url}/generate", {"text": "topic:0 x"})  # builds the shadow
        await until(lambda: router.metrics.value("shadow_decisions") == 1, what="first shadow outcome")
        status, _ = await post(http, f"{url}/eldr/servers", {"remove": [decodes[2].url]})
        assert status == 200
        for arm in router.ab.routings:  # the idle arm follows the pool too
            router.state.set_routing(arm)
            status, _ = await post(http, f"{url}/generate", {"text": "topic:1 x"})
            assert status == 200
        await until(lambda: router.metrics.value("shadow_decisions") == 3, what="shadow outcomes")
        assert router.metrics.value("errors", kind="policy") == 0
        assert router.metrics.value("shadow_decisions", outcome="error") == 0


async def test_requests_spanning_a_slice_boundary_count_in_their_arrival_slice(tmp_path):
    """Decode answers take longer than a slice: every request still counts once, in the
    slice it arrived in (the slice is written one slice later, or at shutdown)."""
    record = tmp_path / "ab.jsonl"
    sent = 0
    async with cluster(n_decode=2, artifact=ToyArtifact(num_clusters=2), ab_policies="eldr,round_robin",
                       ab_slice=0.3, ab_record=str(record), decode_kw={"latency": 0.45}) as (
            router, url, prefill, decodes, http):
        for batch in range(4):
            results = await asyncio.gather(*(post(http, f"{url}/generate", {"text": f"topic:{i % 2} x"})
                                             for i in range(3)))
            assert all(status == 200 for status, _ in results)
            sent += 3
    recs = [json.loads(line) for line in record.read_text().splitlines()]
    assert sum(r["requests"] for r in recs) == sent, recs


def test_a_series_created_during_a_slice_counts_from_zero():
    """SGLang's labelled TPOT/TTFT histograms have no samples before their first request:
    absent at a slice's start means 0 (the engine answered), not 'no value'."""
    from eldr_sglang.router.state.ab import ABController, SliceStats

    tpot = "sglang:request_time_per_output_token_seconds"
    s = SliceStats("eldr", 0, 100.0, requests=2, durations=[1.0, 2.0],
                   engines={"d0": {"eldr_decode_steps_total": 10.0}, "d1": {}})
    s.end = 110.0
    s.engines_end = {"d0": {"eldr_decode_steps_total": 30.0, f"{tpot}_sum": 0.5, f"{tpot}_count": 5.0},
                     "d1": {"eldr_decode_steps_total": 999.0}}  # d1 did not answer at the start
    rec = ABController._record(s)
    assert rec["tpot_mean_s"] == pytest.approx(0.1)
    assert rec["decode_steps"] == 20.0 and "d1" not in rec["decode"]
