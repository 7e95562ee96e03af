"""A real SGLang CPU server (ELDR plugin capturing layers 1 and 3) gives
exactly transformers' greedy tokens, and returns a request's signature in
``meta_info`` when the request asks for it."""

import numpy as np
import pytest

from eldr_sglang.testing.local_cluster import http_json
from tests.helpers import TEST_ARTIFACT_LAYERS, greedy_generate

pytestmark = pytest.mark.sglang


def test_single_server_matches_hf_generate(single_server, hf_greedy):
    for prompt, expected in hf_greedy.items():
        assert greedy_generate(single_server.url, prompt) == expected, prompt


def test_signature_in_meta_info_on_request(single_server):
    prompt = "Patients with chronic kidney disease often present with anemia."
    params = {"max_new_tokens": 3, "temperature": 0}
    plain = http_json(single_server.url + "/generate", {"text": prompt, "sampling_params": params})
    assert "eldr_signature" not in plain["meta_info"]
    asked = http_json(single_server.url + "/generate", {"text": prompt, "sampling_params": {
        **params, "custom_params": {"eldr_signature": True}}})
    (msg,) = asked["meta_info"]["eldr_signature"]
    counts = np.array(msg["counts"])
    assert msg["layers"] == TEST_ARTIFACT_LAYERS and counts.shape == (2, 16)
    assert msg["prompt_tokens"] == asked["meta_info"]["prompt_tokens"]
    assert msg["cached_tokens"] > 0  # the second request hit the prefix cache: cached + new counted
    assert (counts.sum(axis=1) == 4 * msg["prompt_tokens"]).all()
    assert asked["output_ids"] == plain["output_ids"]
