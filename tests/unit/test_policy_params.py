"""Each policy's typed, validated parameter set: reachable from
``--policy-param NAME=VALUE``, the router's config file and code, through one builder
(router, co-located router, simulator, benchmarks); bad names and values are one-line
errors naming the field; a setting the chosen policy ignores is a WARNING at start."""

import logging

import numpy as np
import pytest

from eldr_sglang.core.policies import PolicyContext, build_policy, make_policy, parse_params, policy_spec
from eldr_sglang.core.policies.eldr_balanced import (BALANCED_COST, DEFAULT_COST_BAND, DEFAULT_LOAD_CAP,
                                                     DEFAULT_LOAD_SLACK, DEFAULT_SIM_BAND, DEFAULT_SIM_BAND_FULL,
                                                     BalancedParams)
from eldr_sglang.core.policies.params import param_names
from eldr_sglang.core.policies.state_aware import StepCost
from eldr_sglang.router import cli as router_cli
from eldr_sglang.router.config import RouterConfig

WORKERS = ["--prefill", "http://127.0.0.1:30000", "8998", "--decode", "http://127.0.0.1:30001",
           "--decode", "http://127.0.0.1:30002"]
LAW = ("base_s", "per_seq_s", "per_expert_s", "max_batch")
BALANCED = ("cost_band", "cost_band_full", "load_cap", "load_slack", "sim_band", "sim_band_full", *LAW)


def test_each_policy_declares_its_parameters():
    assert param_names(policy_spec("eldr_balanced").params) == BALANCED
    assert param_names(policy_spec("state_aware").params) == LAW
    assert param_names(policy_spec("eldr").params) == ("tau",)
    for name in ("jsq", "round_robin", "random", "p2c", "domain"):
        assert param_names(policy_spec(name).params) == ()
    d = BalancedParams()
    assert (d.cost_band, d.load_cap, d.load_slack, d.sim_band, d.sim_band_full, d.step_cost()) == (
        DEFAULT_COST_BAND, DEFAULT_LOAD_CAP, DEFAULT_LOAD_SLACK, DEFAULT_SIM_BAND, DEFAULT_SIM_BAND_FULL, BALANCED_COST)


def test_text_values_are_typed_and_reach_the_policy():
    pol = build_policy("eldr_balanced", PolicyContext(3, params={
        "cost_band": "0.1", "load_cap": "1.25", "per_expert_s": "1e-4", "max_batch": "64"}))
    assert pol.cost_band == 0.1 and pol.load_cap == 1.25
    assert pol.cost == StepCost(BALANCED_COST.base_s, BALANCED_COST.per_seq_s, 1e-4, 64)
    assert build_policy("eldr_balanced", PolicyContext(3, params={"load_cap": "none"})).load_cap is None
    sa = make_policy("state_aware", 2, params={"base_s": 0.5, "max_batch": 8})  # numbers from YAML
    assert sa.cost == StepCost(base_s=0.5, max_batch=8)
    cents = np.eye(2, 4)
    assert make_policy("eldr", 2, centroids=cents, tau=0.3).tau == 0.3
    assert make_policy("eldr", 2, centroids=cents, tau=0.3, params={"tau": "0.05"}).tau == 0.05
    assert make_policy("eldr_balanced", 2, params=BalancedParams(cost_band=0.0)).cost_band == 0.0


@pytest.mark.parametrize("policy, values, message", [
    ("eldr_balanced", {"cost_band": "-0.1"}, "cost_band: expected a finite number >= 0, got -0.1"),
    ("eldr_balanced", {"cost_band": "wide"}, "cost_band: expected a finite number, got 'wide'"),
    ("eldr_balanced", {"cost_band": "nan"}, "cost_band: expected a finite number, got 'nan'"),
    ("eldr_balanced", {"load_cap": "0.5"}, "load_cap: expected a finite number >= 1, got 0.5"),
    ("eldr_balanced", {"max_batch": "2.5"}, "max_batch: expected an integer, got '2.5'"),
    ("eldr_balanced", {"max_batch": "0"}, "max_batch: expected an integer >= 1, got 0"),
    ("eldr_balanced", {"per_expert_s": True}, "per_expert_s: expected float, got True"),
    ("eldr_balanced", {"tau": "0.1"}, "tau: eldr_balanced has no parameter 'tau' (its parameters: "
                                      + ", ".join(BALANCED) + ")"),
    ("state_aware", {"per_seq_s": "-1"}, "per_seq_s: expected a finite number >= 0, got -1.0"),
    ("eldr", {"tau": "-1"}, "tau: expected a finite number >= 0, got -1.0"),
    ("jsq", {"tau": "0.1"}, "tau: jsq has no parameter 'tau' (it takes none)"),
])
def test_a_bad_name_or_value_is_one_line_naming_the_field(policy, values, message):
    spec = policy_spec(policy)
    with pytest.raises(ValueError) as e:
        parse_params(spec.name, spec.params, values)
    assert str(e.value) == message and "\n" not in str(e.value)


def test_router_flag_repeats_and_the_config_file_maps_to_it(tmp_path):
    args = router_cli.parse_args([*WORKERS, "--policy-param", "cost_band=0.05",
                                  "--policy-param", "load_cap=1.5"])
    assert args.router_config.policy_params() == {"cost_band": "0.05", "load_cap": "1.5"}
    cfg = tmp_path / "router.yaml"
    cfg.write_text("policy-param:\n  cost_band: 0.2\n  per_expert_s: 7.0e-05\n")
    args = router_cli.parse_args(["--config", str(cfg), *WORKERS])
    assert args.router_config.policy_params() == {"cost_band": "0.2", "per_expert_s": "7e-05"}
    # the command line wins per name; the config's other names stay
    args = router_cli.parse_args(["--config", str(cfg), *WORKERS, "--policy-param", "cost_band=0.01"])
    assert args.router_config.policy_params() == {"cost_band": "0.01", "per_expert_s": "7e-05"}
    cfg.write_text('{"policy_param": ["load_cap=2"]}')
    cfg = cfg.rename(tmp_path / "router.json")
    assert router_cli.parse_args(["--config", str(cfg), *WORKERS]).router_config.policy_params() == {
        "load_cap": "2"}


@pytest.mark.parametrize("argv, message", [
    (["--policy-param", "cost_band=-1"], "--policy-param: cost_band: expected a finite number >= 0, got -1.0"),
    (["--policy-param", "band=0.1"], "--policy-param: band: eldr_balanced has no parameter 'band'"),
    (["--policy-param", "cost_band"], "--policy-param: expected NAME=VALUE, got 'cost_band'"),
    (["--policy", "jsq", "--policy-param", "cost_band=0.1"], "--policy-param: cost_band: jsq has no parameter"),
])
def test_router_cli_refuses_bad_parameters_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        router_cli.parse_args([*WORKERS, *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_config_file_parameters_are_checked_too(tmp_path, capsys):
    cfg = tmp_path / "router.yaml"
    cfg.write_text("policy_param:\n  load_cap: 0.5\n")
    with pytest.raises(SystemExit):
        router_cli.parse_args(["--config", str(cfg), *WORKERS])
    err = capsys.readouterr().err
    assert "load_cap: expected a finite number >= 1, got 0.5" in err and len(err.strip().splitlines()) == 1


def test_parameters_reach_the_router_its_ab_arms_and_the_colocated_router():
    from eldr_sglang.router.app import Router
    from eldr_sglang.router.colocated import ColocatedRouter
    from eldr_sglang.testing.stub_worker import ToyArtifact

    urls = ["http://127.0.0.1:30001", "http://127.0.0.1:30002"]
    router = Router([("http://127.0.0.1:30000", 8998)], urls, "eldr_balanced",
                    policy_param=("cost_band=0.3", "per_expert_s=2e-4"), health_interval=0, load_interval=0)
    assert router.policy.cost_band == 0.3 and router.policy.cost.per_expert_s == 2e-4
    # A/B: each arm takes the parameters it declares
    ab = Router([("http://127.0.0.1:30000", 8998)], urls, "eldr", artifact=ToyArtifact(num_clusters=2),
                ab_policies="eldr,eldr_balanced", policy_param={"tau": 0.2, "cost_band": 0.1},
                health_interval=0, load_interval=0)
    ab.state.set_arms(["eldr", "eldr_balanced"])
    assert ab.state.arms[0].policy.tau == 0.2 and ab.state.arms[0].tau == 0.2
    assert ab.state.arms[1].policy.cost_band == 0.1
    co = ColocatedRouter(urls, policy="eldr_balanced", policy_param=("load_cap=1.5",),
                         health_interval=0, load_interval=0)
    assert co.policy.load_cap == 1.5


def test_a_setting_the_policy_ignores_is_a_warning_at_start(caplog):
    from eldr_sglang.router.app import Router

    assert RouterConfig(tau=0.1).ignored_settings() == [
        "--tau 0.1 is ignored: policy eldr_balanced has no similarity band (only eldr reads it)"]
    assert RouterConfig(policy="eldr", calibration="a.json", tau=0.1).ignored_settings() == []
    assert RouterConfig(ab_policies="eldr,jsq", calibration="a.json", tau=0.1).ignored_settings() == []
    with caplog.at_level(logging.WARNING, logger="eldr_sglang.router"):
        Router([("http://127.0.0.1:30000", 8998)], ["http://127.0.0.1:30001"],
               config=RouterConfig(tau=0.1, domain_map='{"a": [0]}', health_interval=0, load_interval=0))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith("--tau 0.1 is ignored") for m in warned), warned
    assert any(m.startswith("--domain-map is ignored") for m in warned), warned


def test_the_simulator_builds_through_the_same_builder():
    from eldr_sglang.sim import experiments

    assert experiments.make_policy is make_policy
    wide = make_policy("eldr_balanced", 4, params={"cost_band": "1.0"})
    assert wide.cost_band == 1.0
