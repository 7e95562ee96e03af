"""Online calibration core: window, warm start, matching, churn, drift, lifecycle."""

from __future__ import annotations

import numpy as np
import pytest

from eldr_sglang.core.artifact import CalibrationArtifact
from eldr_sglang.core.online import (DriftMonitor, DriftReference, OnlineCalibrator, OnlineSettings,
                                     SignatureWindow, match_to_servers, model_from_message, run_fit)
from eldr_sglang.core.synthetic import make_synthetic_traces
from eldr_sglang.core.traces import ModelSpec

LAYERS = [1, 3]


def _traces(n, seed, task_strength=3.0, language_strength=0.0):
    return make_synthetic_traces(n, num_layers=4, num_experts=32, top_k=4, informative_layers=LAYERS,
                                 task_strength=task_strength, language_strength=language_strength,
                                 seed=seed).traces


def _counts(traces):
    return traces.prefill_counts[:, LAYERS]


def _feed(cal, traces):
    for c in _counts(traces):
        cal.observe(c, LAYERS)


def test_window_keeps_the_most_recent_in_order_and_restarts_on_new_layers():
    w = SignatureWindow(4)
    for i in range(6):
        w.add(np.full((2, 3), i), [0, 1])
    assert len(w) == 4
    assert w.recent()[:, 0, 0].tolist() == [2, 3, 4, 5]
    assert w.recent(2)[:, 0, 0].tolist() == [4, 5]
    assert w.add(np.ones((2, 3)), [0, 2]) is True
    assert len(w) == 1 and w.resets == 1


def test_settings_name_the_bad_field():
    with pytest.raises(ValueError, match="min_signatures"):
        OnlineSettings(min_signatures=0)
    with pytest.raises(ValueError, match="window"):
        OnlineSettings(min_signatures=100, window=50)
    with pytest.raises(ValueError, match="variant"):
        OnlineSettings(variant="gate_logit")


def test_warming_then_initial_fit_matches_an_offline_fit_on_the_same_counts():
    traces = _traces(600, seed=1)
    cal = OnlineCalibrator(OnlineSettings(min_signatures=400, window=1000),
                           model=ModelSpec("synthetic", 4, 32, 4))
    _feed(cal, traces.subset(slice(0, 399)))
    assert cal.state == "warming" and cal.due(4) is None
    _feed(cal, traces.subset(slice(399, 400)))
    assert cal.due(4) == "initial"
    result = run_fit(cal.job(4, "initial"))
    cal.install(result)
    art = result.artifact
    assert cal.state == "fitted" and art.num_clusters == 4 and art.layers == LAYERS
    assert art.created["mode"] == "online" and art.created["n_requests"] == 400
    assert sorted(art.extra["cluster_sizes"]) == [100, 100, 100, 100]
    # regions follow the planted task structure: each task mostly in one region
    held = traces.subset(slice(400, 600))
    region = art.similarities(art.signature(_counts(held))).argmax(axis=1)
    task = held.labels["task"]
    purity = sum(np.bincount(region[task == t]).max() for t in np.unique(task)) / len(task)
    assert purity > 0.8


def test_refit_on_the_same_traffic_keeps_owners_and_reports_low_churn():
    traces = _traces(1200, seed=2)
    st = OnlineSettings(min_signatures=500, window=1200)
    cal = OnlineCalibrator(st, model=ModelSpec("synthetic", 4, 32, 4))
    _feed(cal, traces.subset(slice(0, 600)))
    cal.install(run_fit(cal.job(4, "initial")))
    first = cal.artifact
    _feed(cal, traces.subset(slice(600, 1200)))
    again = run_fit(cal.job(4, "manual", owners=[[0], [1], [2], [3]]))
    assert again.churn is not None and again.churn < 0.15
    assert np.diag(first.centroids @ again.artifact.centroids.T).min() > 0.9
    # a fit whose centroids come back permuted is matched back to their servers
    perm = np.array([2, 0, 3, 1])
    order = match_to_servers(first.centroids, [[0], [1], [2], [3]], again.artifact.centroids[perm])
    assert (perm[order] == np.arange(4)).all()


def test_scale_out_moves_about_one_region_of_signature_space():
    traces = _traces(3000, seed=3, task_strength=2.0, language_strength=1.5)
    st = OnlineSettings(min_signatures=2000, window=3000)
    cal = OnlineCalibrator(st, model=ModelSpec("synthetic", 4, 32, 4))
    _feed(cal, traces)
    cal.install(run_fit(cal.job(8, "initial")))
    owners = [[i] for i in range(8)] + [[0]]  # the new server shares a centroid until the refit
    out = run_fit(cal.job(9, "membership", owners=owners))
    assert out.artifact.num_clusters == 9
    assert out.churn <= 1 / 9 + 0.10


def test_drift_monitor_fires_on_a_planted_shift_and_not_on_a_stationary_stream():
    model = ModelSpec("synthetic", 4, 32, 4)
    st = OnlineSettings(min_signatures=800, window=2000, drift_window=300)
    task = _traces(2000, seed=4, task_strength=3.0, language_strength=0.0)
    cal = OnlineCalibrator(st, model=model)
    _feed(cal, task.subset(slice(0, 800)))
    cal.install(run_fit(cal.job(4, "initial")))
    _feed(cal, task.subset(slice(800, 2000)))  # same mix, new requests
    assert cal.due(4) is None, cal.monitor.statistics()
    # the mix changes: language now shapes routing, tasks barely
    language = _traces(600, seed=4, task_strength=0.0, language_strength=3.0)  # same model
    _feed(cal, language)
    assert cal.due(4) == "drift", cal.monitor.statistics()
    job = cal.job(4, "drift", owners=[[0], [1], [2], [3]])
    assert len(job.counts) == st.drift_window  # the traffic that tripped it, not the whole window
    cal.install(run_fit(job))
    assert cal.history[-1].reason == "drift" and cal.history[-1].drift["similarity_ks"] > 0.2
    assert cal.due(4) is None
    more = _traces(st.min_signatures, seed=4, task_strength=0.0, language_strength=3.0)
    _feed(cal, more)  # a settle fit on traffic entirely after the drift
    assert cal.due(4) == "settle"
    cal.install(run_fit(cal.job(4, "settle", owners=[[0], [1], [2], [3]])))
    assert cal.due(4) is None


def test_membership_and_manual_reasons():
    traces = _traces(300, seed=6)
    cal = OnlineCalibrator(OnlineSettings(min_signatures=100, window=300), model=ModelSpec("s", 4, 32, 4))
    _feed(cal, traces)
    cal.install(run_fit(cal.job(3, "initial")))
    assert cal.due(3) is None
    assert cal.due(4) == "membership" and cal.due(2) == "membership"
    cal.request()
    assert cal.due(3) == "manual"
    cal.job(3, "manual")
    assert cal.due(3) is None


def test_started_from_an_artifact_takes_its_reference_from_the_first_traffic():
    traces = _traces(1500, seed=7)
    st = OnlineSettings(min_signatures=500, window=1500, drift_window=200)
    seed_cal = OnlineCalibrator(st, model=ModelSpec("s", 4, 32, 4))
    _feed(seed_cal, traces.subset(slice(0, 500)))
    art = run_fit(seed_cal.job(4, "initial")).artifact
    cal = OnlineCalibrator(st, artifact=art)
    assert cal.state == "fitted" and cal.monitor is None
    _feed(cal, traces.subset(slice(500, 1500)))
    assert cal.monitor is not None and cal.due(4) is None
    # signatures of other layers are held for the next fit but not scored
    cal.observe(np.ones((3, 32)), [0, 1, 2])
    assert cal.ignored == 1


def test_model_from_message_prefers_the_engine_model_field():
    counts = np.zeros((2, 16))
    counts[:, :4] = 10  # 10 tokens, top-4
    msg = {"layers": [5, 9], "prompt_tokens": 10}
    assert model_from_message(msg, counts) == ModelSpec("unknown", 10, 16, 4)
    msg["model"] = {"name": "m", "num_layers": 48, "num_experts": 16, "top_k": 4}
    assert model_from_message(msg, counts) == ModelSpec("m", 48, 16, 4)


def test_drift_reference_shares_sum_to_one():
    rng = np.random.default_rng(0)
    c = rng.normal(size=(3, 8)).astype(np.float32)
    c /= np.linalg.norm(c, axis=1, keepdims=True)
    x = rng.normal(size=(50, 8)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    ref = DriftReference.of(c, x, 0.1)
    assert abs(ref.shares.sum() - 1) < 1e-9 and 1 <= ref.band_mean <= 3
    mon = DriftMonitor(c, ref, 10, 0.1)
    for v in x[:9]:
        mon.observe(v)
    assert mon.statistics() is None
    mon.observe(x[9])
    assert mon.statistics() is not None


def test_online_artifact_round_trips_through_save_and_load(tmp_path):
    from eldr_sglang.core.artifact import load_artifact

    traces = _traces(200, seed=8)
    cal = OnlineCalibrator(OnlineSettings(min_signatures=100, window=200), model=ModelSpec("s", 4, 32, 4))
    _feed(cal, traces)
    art = run_fit(cal.job(2, "initial")).artifact
    assert isinstance(art, CalibrationArtifact)
    back = load_artifact(art.save(tmp_path / "live.json"))
    assert back.checksum() == art.checksum() and back.created["reason"] == "initial"


def test_simulator_runs_the_online_policy_and_it_fits_after_min_signatures():
    from eldr_sglang.sim.online import OnlineEldrPolicy, elastic_refits
    from eldr_sglang.sim.simulator import SimConfig, simulate
    from eldr_sglang.sim.workload import build_workload

    traces = _traces(400, seed=9)
    wl = build_workload(traces, "task")
    policy = OnlineEldrPolicy(4, LAYERS, traces.model, OnlineSettings(min_signatures=150, window=400))
    cfg = SimConfig(num_prefill=2, num_decode=4, rate=40.0, warmup_s=1.0, measure_s=6.0, seed=0)
    res = simulate(wl, policy, cfg, counts=_counts(traces))
    assert res.summary["conserved"]
    assert [f["reason"] for f in policy.fits][:1] == ["initial"]
    assert policy.fits[0]["at_decision"] == 150  # routed by load until then
    assert policy.inner.name == "eldr"
    steps = elastic_refits(policy.calibrator, 4, 6)
    assert [s["servers"] for s in steps] == [5, 6] and policy.calibrator.artifact.num_clusters == 6
    # without counts the policy never learns (the simulator only passes what it is given)
    blind = OnlineEldrPolicy(4, LAYERS, traces.model, OnlineSettings(min_signatures=150, window=400))
    simulate(wl, blind, cfg)
    assert blind.fits == [] and blind.inner.name == "jsq"
