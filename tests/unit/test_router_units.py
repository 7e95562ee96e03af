"""Small router pieces: the adaptive signature wait, rate-limited logs, settings and
worker URL validation, the return address in request bodies, the counters view."""

import logging

import pytest

from eldr_sglang.patches.publish import RETURN_ADDRESS_KEY
from eldr_sglang.router.config import RouterConfig, validate_worker_url
from eldr_sglang.router.http.body_rules import set_return_address
from eldr_sglang.router.signals.intake import RateLimitedLog
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.router.signals.signatures import WaitLimit


def test_wait_limit_follows_recent_p99_within_floor_and_ceiling():
    w = WaitLimit(ceiling=10.0, floor=0.5, factor=4.0, window=100, min_samples=32, every=8)
    assert w.value == 10.0  # no data yet: the ceiling
    for _ in range(40):
        w.observe(0.010)
    assert w.value == 0.5  # 4 x 10 ms is under the floor
    for _ in range(100):
        w.observe(0.8)
    assert w.value == pytest.approx(3.2)  # 4 x p99
    for _ in range(100):
        w.observe(7.0)
    assert w.value == 10.0  # capped
    fixed = WaitLimit(ceiling=2.0, factor=0.0)
    for _ in range(100):
        fixed.observe(0.01)
    assert fixed.value == 2.0


def test_rate_limited_log_counts_what_it_suppressed(caplog):
    t = [0.0]
    log = RateLimitedLog(every=10.0, clock=lambda: t[0])
    with caplog.at_level(logging.WARNING, logger="eldr_sglang.router"):
        assert log.warn("bad_json", "bad line %d", 1)
        assert not log.warn("bad_json", "bad line %d", 2)
        assert log.warn("too_large", "big line")  # another kind logs at once
        t[0] = 11.0
        assert log.warn("bad_json", "bad line %d", 3)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["bad line 1", "big line", "bad line 3 (1 more like it not logged)"]


@pytest.mark.parametrize("field, value", [
    ("signature_timeout", 0), ("first_byte_timeout", -1), ("max_batch", 0), ("tau", -0.1),
    ("workers", 0), ("port", 70000), ("max_inflight", -1), ("load_interval", -1),
])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        RouterConfig(**{field: value})


def test_unknown_settings_and_port_clashes_are_refused():
    with pytest.raises(ValueError, match="unknown router setting"):
        RouterConfig.from_dict({"signature_timout": 3})
    with pytest.raises(ValueError, match="signature_port"):
        RouterConfig(port=8000, signature_port=8000)
    assert RouterConfig(max_inflight=0).inflight_limit >= 1  # from the open-file limit
    assert RouterConfig(max_inflight=7).inflight_limit == 7


@pytest.mark.parametrize("url", ["ftp://x:1", "http://", "http://h:99999", "http://h:1/v1",
                                 "http://u:p@h:1", "h:1", 5, ""])
def test_worker_urls_are_validated(url):
    with pytest.raises(ValueError):
        validate_worker_url(url)


def test_worker_url_forms_accepted():
    assert validate_worker_url("http://10.0.0.1:30000/") == "http://10.0.0.1:30000"
    assert validate_worker_url("https://[::1]:8443") == "https://[::1]:8443"


def test_return_address_is_set_per_route_and_a_clients_own_is_removed():
    body = {"text": "x", "sampling_params": {"temperature": 0, "custom_params": {
        RETURN_ADDRESS_KEY: "tcp://evil:1", "other": 1}}}
    set_return_address(body, "generate", "tcp://r:8001")
    assert body["sampling_params"]["custom_params"] == {RETURN_ADDRESS_KEY: "tcp://r:8001", "other": 1}
    batch = {"text": ["a", "b"], "sampling_params": [{}, {"max_new_tokens": 3}]}
    set_return_address(batch, "generate", "tcp://r:8001")
    assert all(p["custom_params"][RETURN_ADDRESS_KEY] == "tcp://r:8001" for p in batch["sampling_params"])
    oai = {"prompt": "x", "custom_params": {RETURN_ADDRESS_KEY: "tcp://evil:1"}}
    set_return_address(oai, "v1/completions", "tcp://r:8001")
    assert oai["custom_params"] == {RETURN_ADDRESS_KEY: "tcp://r:8001"}
    # blind policies send none, and strip a client's
    set_return_address(oai, "v1/completions", None)
    assert oai["custom_params"] is None
    plain = {"text": "x"}
    set_return_address(plain, "generate", None)
    assert plain == {"text": "x"}


def test_counters_view_reads_the_prometheus_registry():
    m = RouterMetrics()
    m.event("requests", 3)
    m.fallbacks.labels("timeout").inc(2)
    m.fallbacks.labels("layer_mismatch").inc()
    d = m.deferred(m.signature_wait)
    d.observe(0.01)
    c = m.counters()
    assert c["requests"] == 3 and c["fallbacks"] == 3
    assert c["fallbacks{reason=timeout}"] == 2
    assert m.value("fallbacks", reason="timeout") == 2
    assert m.value("signature_wait_seconds_count") == 1  # deferred observations flushed on read


def test_upper_quantile_is_numpys_linear_quantile():
    import numpy as np

    from eldr_sglang.router.signals.signatures import upper_quantile

    rng = np.random.default_rng(3)
    for n in (1, 2, 31, 32, 100, 512):
        xs = list(rng.exponential(0.05, n))
        for q in (0.9, 0.99):
            assert upper_quantile(xs, q) == pytest.approx(float(np.quantile(xs, q)), rel=1e-12, abs=0)


def test_deferred_histogram_gives_what_observe_gives():
    """A flush puts every value where ``observe`` would (bucket and sum, in order),
    including ints, numpy floats, infinities and NaN; a bad value is dropped alone."""
    import numpy as np
    from prometheus_client import CollectorRegistry, Histogram

    from eldr_sglang.router.metrics import Deferred

    def samples(values, deferred):
        h = Histogram("h", "h", buckets=(0.1, 0.5, 1, 2.5), registry=CollectorRegistry())
        if deferred:
            d = Deferred(h)
            for v in values:
                d.observe(v)
            d.flush()
        else:
            for v in values:
                try:
                    h.observe(v)
                except (TypeError, ValueError):
                    pass
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in h.collect()[0].samples
                if not s.name.endswith("_created")}

    values = [0.1, 0.1000001, 0.5, 3, np.float32(0.3), np.float64(2.5), float("inf"), -1.0, 0.7, 1e-9, 2]
    assert samples(values, True) == samples(values, False)
    with_nan, direct = samples([0.2, float("nan"), 0.4], True), samples([0.2, float("nan"), 0.4], False)
    assert with_nan.keys() == direct.keys() and np.isnan(with_nan[("h_sum", ())])
    assert all(v == direct[k] for k, v in with_nan.items() if k != ("h_sum", ()))
    assert samples([0.2, "bad", 0.4], True) == samples([0.2, 0.4], False)
