"""Fault injection on the real path: a decode server dies under load.

Runs last (it kills a server of the shared cluster): every request either
completes or gets a clear JSON error, none hangs, and routing recovers.
"""

from __future__ import annotations

import json
import urllib.error
from concurrent.futures import ThreadPoolExecutor

import pytest

from eldr_sglang.testing.local_cluster import http_json
from tests.helpers import wait_until

pytestmark = [pytest.mark.sglang, pytest.mark.destructive]


def _request(url: str, i: int) -> str:
    body = {"text": f"Request number {i}: summarise the history of the printing press.",
            "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
    try:
        http_json(url + "/generate", body, timeout=150)
        return "ok"
    except urllib.error.HTTPError as exc:
        payload = json.loads(exc.read() or b"{}")
        return f"error {exc.code}" if "error" in payload else f"unclear {exc.code}: {payload}"
    except OSError as exc:  # timeout or dropped connection: the router must not do this
        return f"no answer: {exc!r}"


def test_killing_a_decode_server_mid_load(eldr_router, pd_cluster):
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(_request, eldr_router.url, i) for i in range(24)]
        loads: dict[str, int] = {}

        def held() -> bool:  # not a fixed sleep: CPUs vary
            loads.update((s["url"], s["inflight"]) for s in http_json(eldr_router.url + "/eldr/status")["decode"])
            return max(loads.values()) > 0
        wait_until(held, timeout=60, what="a decode server holding requests", step=0.5)
        victim = next(p for p, _ in pd_cluster.decodes if p.url == max(loads, key=loads.get))
        assert loads[victim.url] > 0, loads  # it dies with requests in flight
        victim.stop(grace=0)  # SIGTERM then SIGKILL of the whole process group
        outcomes = [f.result(timeout=300) for f in futures]
    unclear = [o for o in outcomes if not (o == "ok" or o.startswith("error "))]
    assert not unclear, unclear
    assert outcomes.count("ok") >= 1
    # routing recovers: new requests go to the surviving decode server(s)
    assert [_request(eldr_router.url, 100 + i) for i in range(4)] == ["ok"] * 4
    status = http_json(eldr_router.url + "/eldr/status")
    (dead,) = [s for s in status["decode"] if s["url"] == victim.url]
    assert not (dead["alive"] and dead["healthy"]), dead  # taken out of rotation
