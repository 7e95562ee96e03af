"""Past one router: replicas side by side, shared decode load, ``--workers N``.

Each replica puts its own signature return address in the requests it sends to
prefill, so the prefill stubs (as the engine plugin) publish every signature to the
replica that waits for it; replicas see each other's traffic through the decode
servers' ``GET /v1/loads``.
"""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import pytest

from eldr_sglang.router import Router, start_router
from eldr_sglang.testing.stub_worker import KvHandoff, StubWorker, ToyArtifact
from tests.integration.helpers import BOOT_PORT, free_port, post, save_artifact, until

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def router_cli(purl, durls, port, artifact, *extra):
    argv = [sys.executable, "-m", "eldr_sglang.router", "--prefill", purl, str(BOOT_PORT)]
    for d in durls:
        argv += ["--decode", d]
    argv += ["--policy", "eldr", "--calibration", artifact, "--host", "127.0.0.1",
             "--port", str(port), "--signature-port", "0", "--health-interval", "0.2",
             "--load-interval", "0.05", "--event-loop", "asyncio", *extra]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


async def ready(http, url, timeout=30.0):
    async def up():
        try:
            async with http.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False
    await until(up, timeout)


async def test_replicas_get_their_own_signatures_and_survive_each_other(tmp_path):
    """2 replicas, 1P + 3D stubs in SGLang's PD order, mixed traffic; one replica is
    killed (SIGKILL) mid-load: every request sent to the other completes, routed by
    its own signatures, and the decode load stays balanced."""
    kv = KvHandoff(timeout=5.0)
    prefill = StubWorker("prefill", name="p0", kv=kv)  # no configured address
    decodes = [StubWorker("decode", name=f"d{i}", kv=kv, latency=0.05) for i in range(3)]
    purl = await prefill.start()
    durls = [await d.start() for d in decodes]
    art = save_artifact(tmp_path / "a.json", 3)
    port_a = free_port()
    proc_a = router_cli(purl, durls, port_a, art)
    router_b = Router([(purl, BOOT_PORT)], durls, "eldr", artifact=ToyArtifact(num_clusters=3),
                      signature_port=0, health_interval=0.2, load_interval=0.05)
    runner_b, port_b = await start_router(router_b)
    url_a, url_b = f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"
    http = aiohttp.ClientSession()
    try:
        await ready(http, url_a)

        async def send(url, i):
            try:
                st, raw = await post(http, f"{url}/generate",
                                     {"text": f"topic:{i % 3} r{i}", "stream": i % 4 == 0},
                                     timeout=aiohttp.ClientTimeout(total=30))
                return url, i, st, raw
            except aiohttp.ClientError as e:
                return url, i, 0, repr(e).encode()

        async def killer():
            await until(lambda: sum(len(d.requests) for d in decodes) >= 30)
            proc_a.send_signal(signal.SIGKILL)
        tasks = [send(url_a if i % 2 else url_b, i) for i in range(120)]
        results, _ = await asyncio.gather(asyncio.gather(*tasks), killer())
        on_b = [r for r in results if r[0] == url_b]
        assert len(on_b) == 60
        assert all(st == 200 for _, _, st, _ in on_b), [r for r in on_b if r[2] != 200][:3]
        for _, i, _, raw in on_b:  # routed by B's own signatures: topic k -> d{k}
            if i % 4:
                assert orjson.loads(raw)["meta_info"]["server"] == f"d{i % 3}"
        assert router_b.metrics.value("fallbacks") == 0
        assert router_b.metrics.value("events", event="signatures_used") == 60
        assert any(st != 200 for u, _, st, _ in results if u == url_a)  # A really died
        counts = [len(d.requests) for d in decodes]
        assert max(counts) <= 2 * min(counts), counts
    finally:
        proc_a.kill()
        proc_a.wait()
        await http.close()
        await runner_b.cleanup()
        for w in [prefill] + decodes:
            await w.stop()


async def test_shared_load_keeps_replicas_off_a_server_the_other_filled():
    """Replica A holds 6 requests on d0; replica B (least loaded) sees them through
    d0's reported load and sends nothing there; with load polling off it would."""
    prefill = StubWorker("prefill", name="p0")
    decodes = [StubWorker("decode", name=f"d{i}") for i in range(3)]
    purl = await prefill.start()
    durls = [await d.start() for d in decodes]
    a = Router([(purl, BOOT_PORT)], durls, "eldr", artifact=ToyArtifact(num_clusters=3, tau=0.0),
               signature_port=0, health_interval=0)
    b = Router([(purl, BOOT_PORT)], durls, "jsq", health_interval=0, load_interval=0.05)
    (ra, pa), (rb, pb) = await start_router(a), await start_router(b)
    http = aiohttp.ClientSession()
    try:
        decodes[0].hang = True
        held = [asyncio.ensure_future(post(http, f"http://127.0.0.1:{pa}/generate",
                                           {"text": f"topic:0 {i}"})) for i in range(6)]
        await until(lambda: len(decodes[0].requests) == 6)
        await until(lambda: b.pool.decodes[0].load >= 6)
        for i in range(9):
            st, raw = await post(http, f"http://127.0.0.1:{pb}/generate", {"text": f"x{i}"})
            assert st == 200
        assert len(decodes[0].requests) == 6  # B sent nothing to the server A filled
        assert sum(len(d.requests) for d in decodes[1:]) == 9
        for h in held:
            h.cancel()
    finally:
        await http.close()
        await ra.cleanup()
        await rb.cleanup()
        for w in [prefill] + decodes:
            await w.stop()


async def test_workers_share_one_port_and_drain_together(tmp_path):
    """``--workers 2``: two processes on one port (SO_REUSEPORT), each with its own
    signature port; requests through either are routed by signature; SIGTERM stops both."""
    prefill = StubWorker("prefill", name="p0")
    decodes = [StubWorker("decode", name=f"d{i}") for i in range(3)]
    purl = await prefill.start()
    durls = [await d.start() for d in decodes]
    port = free_port()
    proc = router_cli(purl, durls, port, save_artifact(tmp_path / "a.json", 3), "--workers", "2")
    url = f"http://127.0.0.1:{port}"
    try:
        pids = set()
        async with aiohttp.ClientSession() as http:
            await ready(http, url)
            t0 = time.monotonic()
            while len(pids) < 2:  # new connections are spread over both processes
                assert time.monotonic() - t0 < 30, pids
                async with aiohttp.ClientSession(
                        connector=aiohttp.TCPConnector(force_close=True)) as fresh:
                    async with fresh.get(f"{url}/eldr/status") as r:
                        if r.status == 200:
                            pids.add((await r.json())["pid"])
                    for i in range(6):
                        st, raw = await post(fresh, f"{url}/generate", {"text": f"topic:{i % 3}"})
                        assert st == 200 and orjson.loads(raw)["meta_info"]["server"] == f"d{i % 3}"
        assert proc.pid not in pids
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.get_running_loop().run_in_executor(None, proc.communicate, None)
        assert proc.returncode == 0, out
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
        for w in [prefill] + decodes:
            await w.stop()
