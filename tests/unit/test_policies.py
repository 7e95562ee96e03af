"""Unit tests of the pure routing policies (eldr_sglang.core.policies)."""

from collections import Counter

import numpy as np
import pytest

from eldr_sglang.core.policies import (CentroidOwnership, DomainPolicy, EldrPolicy, JSQPolicy,
                                       P2CPolicy, RandomPolicy, RoundRobinPolicy, RouteRequest,
                                       make_policy)

NONE = RouteRequest()


def unit(v):
    v = np.asarray(v, dtype=np.float32)
    return v / np.linalg.norm(v)


def eye_centroids(k, d=None):
    return np.eye(k, d or k, dtype=np.float32)


def test_random_is_seeded_and_respects_mask():
    p1, p2 = RandomPolicy(seed=7), RandomPolicy(seed=7)
    s1 = [p1.choose(NONE, [0] * 4) for _ in range(50)]
    s2 = [p2.choose(NONE, [0] * 4) for _ in range(50)]
    assert s1 == s2 and set(s1) == {0, 1, 2, 3}
    p = RandomPolicy(seed=0)
    assert {p.choose(NONE, [0] * 4, [False, True, False, True]) for _ in range(50)} == {1, 3}


def test_round_robin_cycles_and_skips():
    p = RoundRobinPolicy()
    assert [p.choose(NONE, [9, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    assert [p.choose(NONE, [0] * 3, [True, False, True]) for _ in range(3)] == [2, 0, 2]
    # all masked out -> treated as all allowed
    assert p.choose(NONE, [0] * 3, [False] * 3) in (0, 1, 2)


def test_jsq_least_loaded_ties():
    assert JSQPolicy(random_ties=False).choose(NONE, [3, 1, 1, 2]) == 1
    p = JSQPolicy(seed=0)
    assert {p.choose(NONE, [3, 1, 1, 2]) for _ in range(40)} == {1, 2}
    assert p.choose(NONE, [3, 1, 1, 2], [True, False, False, True]) == 3


def test_p2c_never_picks_the_more_loaded_of_two():
    p = P2CPolicy(seed=3)
    loads = [0, 10, 10, 10]
    picks = Counter(p.choose(NONE, loads) for _ in range(300))
    # server 0 wins whenever sampled (half the pairs); a loaded one only when 0 is not
    assert picks[0] == pytest.approx(150, abs=40)
    assert P2CPolicy().choose(NONE, [5, 0], [True, False]) == 0


def test_domain_oracle_and_unknown_label():
    p = DomainPolicy({"code": [0, 1], "math": [2]}, seed=0)
    assert p.choose(RouteRequest(label="code"), [5, 2, 0, 0]) == 1
    assert p.choose(RouteRequest(label="math"), [0, 0, 9, 0]) == 2
    assert p.choose(RouteRequest(label="law"), [4, 3, 2, 1]) == 3  # jsq over all
    assert p.choose(NONE, [4, 3, 0, 1]) == 2
    # label's servers all unhealthy -> jsq over the allowed ones
    assert p.choose(RouteRequest(label="math"), [1, 0, 0, 2], [True, True, False, True]) == 1
    p.remove_server(0)
    assert p.domain_map == {"code": [0], "math": [1]}


def test_eldr_band_tau0_tau1_tau01():
    c = eye_centroids(3)
    sig = unit([1.0, 0.95, 0.0])  # sims: 0.72, 0.69, 0.0
    loads = [5, 1, 0]
    assert EldrPolicy(c, 3, tau=0.0).choose(RouteRequest(sig), loads) == 0   # strict affinity
    assert EldrPolicy(c, 3, tau=0.1).choose(RouteRequest(sig), loads) == 1   # band {0, 1}
    assert EldrPolicy(c, 3, tau=1.0).choose(RouteRequest(sig), loads) == 2   # band = all -> jsq
    # equal loads inside the band -> higher similarity wins
    assert EldrPolicy(c, 3, tau=0.1).choose(RouteRequest(sig), [1, 1, 0]) == 0


def test_eldr_without_signature_is_jsq_and_respects_mask():
    p = EldrPolicy(eye_centroids(3), 3, tau=0.1)
    assert p.choose(NONE, [3, 0, 2]) == 1
    sig = unit([1, 0, 0])
    assert p.choose(RouteRequest(sig), [0, 0, 0], [False, True, True]) in (1, 2)
    with pytest.raises(ValueError):
        p.choose(RouteRequest(unit([1, 0])), [0, 0, 0])


def test_ownership_initial_layouts():
    c = eye_centroids(4)
    assert CentroidOwnership(c, 4).as_lists() == [[0], [1], [2], [3]]
    more = CentroidOwnership(c, 6).as_lists()
    assert more[:4] == [[0], [1], [2], [3]] and more[4:] == [[0], [1]]  # shares
    fewer = CentroidOwnership(c, 2)
    assert sorted(k for h in fewer.as_lists() for k in h) == [0, 1, 2, 3]


def _clustered_centroids():
    # centroids 0,1 close together; 2,3 close together
    return np.stack([unit([1, 0.2, 0, 0]), unit([1, -0.2, 0, 0]),
                     unit([0, 0, 1, 0.2]), unit([0, 0, 1, -0.2])])


def test_remove_hands_centroid_to_nearest_owner_and_add_restores():
    own = CentroidOwnership(_clustered_centroids(), 4)
    own.remove(1)  # centroid 1 is nearest to centroid 0 -> server 0 takes it
    assert own.as_lists() == [[0, 1], [2], [3]]
    own.remove(1)  # old server 2: centroid 2 -> owner of centroid 3 (now index 1)
    assert own.as_lists() == [[0, 1], [2, 3]]
    own.add()      # takes the most recently handed-over centroid (2)
    assert own.as_lists() == [[0, 1], [3], [2]]
    own.add()
    assert own.as_lists() == [[0], [3], [2], [1]]
    own.add()      # every server has one: share the least-shared centroid
    assert own.as_lists() == [[0], [3], [2], [1], [0]]
    own.remove(0)  # shared centroid just loses an owner
    assert own.as_lists() == [[3], [2], [1], [0]]


def test_eldr_routing_follows_ownership_on_churn():
    c = _clustered_centroids()
    p = EldrPolicy(c, 4, tau=0.0)
    sig1 = c[1]
    assert p.choose(RouteRequest(sig1), [0, 0, 0, 0]) == 1
    p.remove_server(1)
    # region 1 now belongs to server 0 (owner of the nearest centroid), not dropped
    assert p.choose(RouteRequest(sig1), [0, 0, 0]) == 0
    assert p.choose(RouteRequest(c[3]), [0, 0, 0]) == 2
    p.add_server()
    assert p.choose(RouteRequest(sig1), [0, 0, 0, 0]) == 3
    # co-owners split a region by load
    q = EldrPolicy(c, 5, tau=0.0)  # server 4 shares centroid 0 with server 0
    assert q.choose(RouteRequest(c[0]), [3, 0, 0, 0, 1]) == 4
    assert q.choose(RouteRequest(c[0]), [0, 0, 0, 0, 1]) == 0


def test_eldr_band_is_load_balanced_under_skew():
    rng = np.random.default_rng(0)
    c = eye_centroids(4, 8)
    p = EldrPolicy(c, 4, tau=0.1)
    loads = [0, 0, 0, 0]
    for _ in range(200):  # all traffic near centroid 0, tiny noise
        sig = unit(c[0] + np.abs(rng.normal(0, 0.01, 8)))  # counts are >= 0
        loads[p.choose(RouteRequest(sig), loads)] += 1
    assert loads[0] == 200  # band of width 0.1 never reaches the orthogonal clusters
    p = EldrPolicy(c, 4, tau=1.0)
    loads = [0, 0, 0, 0]
    for _ in range(200):
        sig = unit(c[0] + np.abs(rng.normal(0, 0.01, 8)))  # counts are >= 0
        loads[p.choose(RouteRequest(sig), loads)] += 1
    assert loads == [50, 50, 50, 50]


def test_make_policy_names():
    c = eye_centroids(2)
    for name in ("random", "round_robin", "rr", "jsq", "p2c", "power_of_two", "domain"):
        assert make_policy(name, 2).choose(NONE, [1, 0]) in (0, 1)
    assert make_policy("eldr", 2, centroids=c).needs_signature
    with pytest.raises(ValueError):
        make_policy("eldr", 2)
    with pytest.raises(ValueError):
        make_policy("nope", 2)


# ---------------------------------------------------------------- constructed states
def test_eldr_band_edge_is_inclusive():
    c = eye_centroids(3)
    sig = np.array([0.8, 0.6, 0.0], dtype=np.float32)
    s1, s2 = float(sig[0]), float(sig[1])
    loads = [3, 0, 0]
    gap = s1 - s2
    # server 1 sits exactly on the band edge s* - tau: inside; a hair narrower: outside
    assert EldrPolicy(c, 3, tau=gap).choose(RouteRequest(sig), loads) == 1
    assert EldrPolicy(c, 3, tau=gap - 1e-6).choose(RouteRequest(sig), loads) == 0
    d = EldrPolicy(c, 3, tau=gap).explain(RouteRequest(sig), loads)
    assert d.band == (0, 1) and d.index == 1 and d.best_similarity == pytest.approx(s1)
    assert d.top(2) == [(0, pytest.approx(s1)), (1, pytest.approx(s2))]


def test_eldr_ties_break_by_similarity_then_index():
    c = _clustered_centroids()
    p = EldrPolicy(c, 6, tau=0.0)  # servers 4, 5 share centroids 0, 1 with servers 0, 1
    assert p.ownership.as_lists()[4:] == [[0], [1]]
    # equal similarity (co-owners), equal load -> lowest index
    assert p.choose(RouteRequest(c[0]), [0, 0, 0, 0, 0, 0]) == 0
    # equal similarity, server 0 busier -> its co-owner
    assert p.choose(RouteRequest(c[0]), [1, 0, 0, 0, 0, 0]) == 4
    # wide band, all loads equal -> the most similar wins, not the lowest index
    q = EldrPolicy(c, 4, tau=1.0)
    assert q.choose(RouteRequest(c[2]), [0, 0, 0, 0]) == 2
    # all masked out -> treated as all allowed
    assert q.choose(RouteRequest(c[2]), [0, 0, 0, 0], [False] * 4) == 2


def test_eldr_tau0_is_strict_affinity_whatever_the_load():
    rng = np.random.default_rng(5)
    c = np.abs(rng.normal(size=(6, 16))).astype(np.float32)
    p = EldrPolicy(c, 6, tau=0.0)
    for _ in range(100):
        sig = unit(np.abs(rng.normal(size=16)))
        loads = rng.integers(0, 50, 6).tolist()
        sims = p.ownership.server_similarity(sig)
        assert p.choose(RouteRequest(sig), loads) == int(np.argmax(sims))


def test_eldr_tau1_equals_jsq_for_count_signatures():
    rng = np.random.default_rng(6)
    c = np.abs(rng.normal(size=(8, 32))).astype(np.float32)
    p = EldrPolicy(c, 8, tau=1.0)
    jsq = JSQPolicy(random_ties=False)
    for _ in range(200):
        sig = unit(np.abs(rng.normal(size=32)))  # counts >= 0 -> cosine in [0, 1]
        loads = rng.integers(0, 6, 8).tolist()
        allowed = (rng.random(8) < 0.8).tolist()
        pick = p.choose(RouteRequest(sig), loads, allowed)
        cand = [i for i in range(8) if allowed[i]] or list(range(8))
        assert loads[pick] == min(loads[i] for i in cand) and pick in cand
        if [loads[i] for i in cand].count(min(loads[i] for i in cand)) == 1:
            assert pick == jsq.choose(NONE, loads, allowed)


def test_explain_matches_choose_and_gather_matches_mask():
    rng = np.random.default_rng(7)
    c = np.abs(rng.normal(size=(7, 12))).astype(np.float32)
    p = EldrPolicy(c, 5, tau=0.05)   # K > N: some servers own several centroids
    p.remove_server(1)
    p.add_server()
    p.add_server()
    own = p.ownership
    assert not own.single
    for _ in range(100):
        sig = unit(np.abs(rng.normal(size=12)))
        loads = rng.integers(0, 4, own.num_servers).tolist()
        sims = own.centroids @ sig
        want = np.where(own.mask, sims[None, :], -np.inf).max(axis=1)
        np.testing.assert_allclose(own.gather(sims), want, rtol=1e-6)
        d = p.explain(RouteRequest(sig), loads)
        assert d.index == p.choose(RouteRequest(sig), loads)
        assert d.index in d.band and len(d.centroid_similarities) == 7
        np.testing.assert_allclose(d.centroid_similarities, sims, rtol=1e-5)
    # non-scoring policies explain too, without a band
    d = JSQPolicy().explain(NONE, [2, 0, 1])
    assert d.index == 1 and d.band is None and d.top() == []
    assert p.explain(NONE, [0] * own.num_servers).reason == "no_signature"


def test_eldr_scan_and_vectorised_picks_agree(monkeypatch):
    rng = np.random.default_rng(8)
    c = np.abs(rng.normal(size=(10, 16))).astype(np.float32)
    scan, vec = EldrPolicy(c, 12, tau=0.07), EldrPolicy(c, 12, tau=0.07)
    monkeypatch.setattr(vec, "SCAN_MAX", 0)
    for _ in range(300):
        sig = unit(np.abs(rng.normal(size=16)))
        loads = rng.integers(0, 3, 12).tolist()
        allowed = (rng.random(12) < 0.7).tolist()
        for a in (None, allowed):
            d1, d2 = scan.explain(RouteRequest(sig), loads, a), vec.explain(RouteRequest(sig), loads, a)
            assert d1.index == d2.index and d1.band == d2.band
            assert d1.best_similarity == pytest.approx(d2.best_similarity)
