"""Helpers shared by the integration tests: a stub PD cluster behind an in-process
ELDR router, HTTP and event-loop shortcuts, waiting for a condition, and a small
calibration artifact file."""

import asyncio
import contextlib
import json
from pathlib import Path

import aiohttp
import orjson

from eldr_sglang.router import Router, start_router
from eldr_sglang.testing.local_cluster import free_port
from eldr_sglang.testing.stub_worker import StubWorker, ToyArtifact
from eldr_sglang.testing.toy_artifact import save_toy_artifact
from tests.helpers import until, wait_until  # noqa: F401 (the integration tests import them from here)

BOOT_PORT = 8998


@contextlib.asynccontextmanager
async def cluster(n_decode=4, policy="eldr", prefill_kw=None, decode_kw=None,
                  dead_decodes=(), push_url=True, **router_kw):
    """Start 1 prefill + n_decode stubs and a router; yields (router, url, prefill, decodes, http).
    ``push_url``: the prefill stub posts signatures to the router's URL (else to the
    return address each request carries)."""
    prefill = StubWorker("prefill", name="p0", **(prefill_kw or {}))
    decodes = [StubWorker("decode", name=f"d{i}", **(decode_kw or {})) for i in range(n_decode)]
    purl = await prefill.start()
    durls = [await d.start() for d in decodes]
    for i in dead_decodes:  # replace by a closed port
        await decodes[i].stop()
        durls[i] = f"http://127.0.0.1:{free_port()}"
    router_kw.setdefault("artifact", ToyArtifact(num_clusters=n_decode) if policy == "eldr" else None)
    router = Router([(purl, BOOT_PORT)], durls, policy, **router_kw)
    runner, port = await start_router(router)
    url = f"http://127.0.0.1:{port}"
    if push_url:
        prefill.signature_url = f"{url}/eldr/signature"
    http = aiohttp.ClientSession()
    try:
        yield router, url, prefill, decodes, http
    finally:
        await http.close()
        await runner.cleanup()
        for i, w in enumerate([prefill] + decodes):
            if i - 1 not in dead_decodes:
                await w.stop()


def run(coro):
    return asyncio.run(coro)


async def post(http, url, body, **kw):
    async with http.post(url, data=orjson.dumps(body) if not isinstance(body, bytes) else body,
                         **kw) as r:
        return r.status, await r.read()


def save_artifact(path, num_clusters, corrupt=False, layers=(0, 1)):
    save_toy_artifact(path, num_clusters, layers)
    if corrupt:
        doc = json.loads(Path(path).read_text())
        doc["tau"] = 0.5  # content no longer matches the checksum
        Path(path).write_text(json.dumps(doc))
    return str(path)
