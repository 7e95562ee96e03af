"""Shared by the integration tests of eldr_sglang.integrations: the two-topic artifact
(:mod:`eldr_sglang.testing.topic_words`), a failing scorer, the loopback check, a
pre-router served on loopback with a client session."""

from __future__ import annotations

import contextlib

import aiohttp

from eldr_sglang.integrations import serve
from eldr_sglang.integrations.dynamo_local import non_loopback_listeners  # noqa: F401 (tests import it here)
from eldr_sglang.testing.topic_words import TOPIC_WORDS, tokenizer, topic_artifact, topic_prompt  # noqa: F401


class FailingScorer:
    """A scorer that always fails: the adapter's own failure."""

    calls = 0

    async def choose(self, body, endpoint, workers, loads):
        FailingScorer.calls += 1
        raise RuntimeError("scorer down")

    def release(self, choice):
        pass



@contextlib.asynccontextmanager
async def adapter(pre):
    """``pre`` served on 127.0.0.1: yields (its URL, a client session)."""
    runner, port = await serve(pre, "127.0.0.1", 0)
    http = aiohttp.ClientSession()
    try:
        yield f"http://127.0.0.1:{port}", http
    finally:
        await http.close()
        await runner.cleanup()
