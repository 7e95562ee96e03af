"""A decision counts at most one fallback (eldr_balanced counted a
signature of other layers twice, as layer_mismatch and as policy_mismatch), and a
decision the policy could not make by its own rule is counted with its reason."""

import pytest

from eldr_sglang.testing.stub_worker import ToyArtifact, topic_counts
from tests.integration.helpers import cluster, post

pytestmark = pytest.mark.timeout(60)


def three_layer_counts(text):
    return topic_counts(text, layers=(0, 1, 2))


@pytest.mark.parametrize("policy", ["eldr_balanced", "state_aware", "eldr"])
async def test_a_signature_of_other_layers_is_one_fallback_per_decision(policy):
    async with cluster(n_decode=2, policy=policy, artifact=ToyArtifact(num_clusters=2)) as (
            router, url, prefill, decodes, http):
        st, raw = await post(http, f"{url}/generate", {"text": "topic:0"})
        assert st == 200, raw
        assert router.metrics.value("fallbacks") == 0
        # the plugin restarts with another layer set: 3 layers instead of the artifact's 2
        prefill.layers, prefill.counts_fn = [0, 1, 2], three_layer_counts
        for i in range(6):
            st, raw = await post(http, f"{url}/generate", {"text": f"topic:{i % 2} {i}"})
            assert st == 200, raw
        assert router.metrics.value("fallbacks") == 6, router.metrics.value("fallbacks")
        assert router.metrics.value("fallbacks", reason="layer_mismatch") == 6
        assert all(d.inflight == 0 for d in router.pool.decodes)


async def test_a_policy_fallback_is_counted_with_its_reason():
    async with cluster(n_decode=2, policy="eldr_balanced", artifact=ToyArtifact(num_clusters=2)) as (
            router, url, prefill, decodes, http):
        router.routing.policy._costs = lambda request, loads, rows=None: [float("nan")] * len(loads)
        for i in range(3):
            st, raw = await post(http, f"{url}/generate", {"text": f"topic:{i % 2} {i}"})
            assert st == 200, raw
        assert router.metrics.value("fallbacks", reason="degenerate_cost") == 3
        assert router.metrics.value("fallbacks") == 3
        assert router.policy.describe()["fallbacks"] == {"degenerate_cost": 3}


async def test_a_batch_whose_signatures_are_lost_is_one_fallback():
    async with cluster(prefill_kw={"send_signature": False}, signature_timeout=0.2,
                       signature_timeout_min=0.1) as (router, url, prefill, decodes, http):
        st, raw = await post(http, f"{url}/generate", {"text": ["topic:1 a", "topic:2 b", "topic:3 c"]})
        assert st == 200, raw
        assert router.metrics.value("fallbacks", reason="timeout") == 1
        assert router.metrics.value("fallbacks") == 1
