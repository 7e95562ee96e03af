"""The contract every registered policy keeps, one test per clause, parametrised over the
registry (a new policy is checked without a line here): it builds with its default
parameters; it refuses each bad field by name; ``choose`` picks what ``explain`` picks; an
admit and its release restore what it reports and decides; it follows membership changes
(``add_server``/``remove_server``); ``describe()`` is JSON. Also: the README's policy
table (between its markers, if it has them) is the registry's."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from eldr_sglang.core.policies import (FAMILIES, PolicyContext, RouteRequest, build_policy, parse_params,
                                       policy_names, policy_spec)
from eldr_sglang.core.policies.params import bounds, param_docs
from eldr_sglang.core.policies.table import END, START, with_table

N, D = 5, 48
NAMES = policy_names()
ROOT = Path(__file__).resolve().parents[2]


def _context(n: int = N, params=None) -> PolicyContext:
    rng = np.random.default_rng(3)
    return PolicyContext(n, seed=0, centroids=rng.random((n, D)).astype(np.float32),
                         domain_map={"a": [0, 1], "b": [2]}, params=params)


def _requests(count: int, seed: int = 1) -> list[RouteRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        sig = rng.random(D).astype(np.float32)
        act = (rng.random(D) * rng.choice([0.1, 0.6])).astype(np.float32)
        out.append(RouteRequest(sig / np.linalg.norm(sig), label="ab"[i % 2], activation=act))
    return out


def _loads(rng, n: int) -> list[int]:
    return [int(x) for x in rng.integers(0, 6, n)]


@pytest.mark.parametrize("name", NAMES)
def test_builds_with_its_defaults_and_declares_what_it_is(name):
    spec = policy_spec(name)
    pol = build_policy(name, _context())
    assert spec.family in FAMILIES and spec.summary
    assert parse_params(name, spec.params) == spec.params()  # the defaults pass their own checks
    assert all(param_docs(spec.params).values()), "each parameter says what it is (param(..., doc=))"
    assert 0 <= pol.choose(_requests(1)[0], [0] * N) < N


def _bad_values(kind, low):
    out = ["wide", "nan", True]
    if low is not None:
        out.append(low - 1 if kind is int else low - 0.5)
    if kind is int:
        out.append("2.5")
    return out


@pytest.mark.parametrize("name", NAMES)
def test_refuses_each_bad_field_by_name(name):
    spec = policy_spec(name)
    for field, (kind, _, low) in bounds(spec.params).items():
        for bad in _bad_values(kind, low):
            with pytest.raises(ValueError) as e:
                build_policy(name, _context(params={field: bad}))
            assert str(e.value).startswith(f"{field}: ") and "\n" not in str(e.value), (field, bad, str(e.value))
    with pytest.raises(ValueError, match=r"^no_such_field: "):
        build_policy(name, _context(params={"no_such_field": "1"}))


@pytest.mark.parametrize("name", NAMES)
def test_choose_picks_what_explain_picks(name):
    a, b = build_policy(name, _context()), build_policy(name, _context())
    rng = np.random.default_rng(5)
    for i, req in enumerate(_requests(60)):
        loads = _loads(rng, N)
        allowed = None if i % 3 == 0 else [bool(x) for x in rng.random(N) < 0.7]
        got, dec = a.choose(req, loads, allowed), b.explain(req, loads, allowed)
        assert got == dec.index, i
        assert allowed is None or not any(allowed) or allowed[got], i
        a.admit(got, req)
        b.admit(dec.index, req)


@pytest.mark.parametrize("name", NAMES)
def test_an_admit_and_its_release_restore_the_state(name):
    pol = build_policy(name, _context())
    rng = np.random.default_rng(7)
    reqs = _requests(40)
    for req in reqs[:20]:  # some live requests on every server
        pol.admit(pol.choose(req, _loads(rng, N)), req)
    before = copy.deepcopy(pol)
    want = json.dumps(before.describe(), sort_keys=True)
    for req in reqs[20:30]:  # admitted and released again, on every server
        tokens = [pol.admit(i, req) for i in range(N)]
        for tok in tokens:
            pol.release(tok)
        pol.release(tokens[0])  # a second release of one token changes nothing
        pol.release(None)
    assert json.dumps(pol.describe(), sort_keys=True) == want
    rng_a, rng_b = np.random.default_rng(9), np.random.default_rng(9)
    for req in reqs[30:]:  # and decides as it would have
        assert pol.choose(req, _loads(rng_a, N)) == before.choose(req, _loads(rng_b, N))


@pytest.mark.parametrize("name", NAMES)
def test_follows_membership_changes(name):
    pol = build_policy(name, _context())
    rng = np.random.default_rng(11)
    reqs = iter(_requests(80))
    tokens = []
    for n, change in ((N, None), (N + 1, "add"), (N, "remove_first"), (N - 1, "remove_last"),
                      (N, "add"), (N - 1, "remove_middle")):
        if change == "add":
            pol.add_server()
        elif change == "remove_first":
            pol.remove_server(0)
        elif change == "remove_last":
            pol.remove_server(n)
        elif change == "remove_middle":
            pol.remove_server(2)
        for _ in range(8):
            req = next(reqs)
            loads = _loads(rng, n)
            i = pol.choose(req, loads)
            assert 0 <= i < n and pol.explain(req, loads).index < n
            tokens.append(pol.admit(i, req))
        json.dumps(pol.describe())
    for tok in tokens:  # tokens of removed servers included
        pol.release(tok)
    json.dumps(pol.describe())


@pytest.mark.parametrize("name", NAMES)
def test_describe_is_json(name):
    pol = build_policy(name, _context())
    assert json.loads(json.dumps(pol.describe()))["policy"] == policy_spec(name).name
    req = _requests(1)[0]
    pol.admit(pol.choose(req, [1] * N), req)
    json.dumps(pol.describe())


def test_the_readme_policy_table_is_the_registry():
    text = (ROOT / "README.md").read_text()
    if START not in text or END not in text:
        pytest.skip("README.md has no policy-table markers")
    assert with_table(text) == text, "regenerate: python -m tools.policy_table --write README.md"
