"""A real SGLang CPU server gives exactly transformers' greedy tokens."""

import pytest

from conftest import greedy_generate

pytestmark = pytest.mark.sglang


def test_single_server_matches_hf_generate(single_server, hf_greedy):
    for prompt, expected in hf_greedy.items():
        assert greedy_generate(single_server.url, prompt) == expected, prompt
