"""SMG (``sglang-router`` 0.3.2, PD mode): pin the ELDR decode worker with a routing key.

Checked against 0.3.2 with stub workers: with ``--pd-disaggregation --decode-policy
manual``, ``X-SMG-Routing-Key`` is sticky (a new key is bound to a decode worker of
SMG's choosing, by ``--assignment-mode``, and keeps it until that worker turns
unhealthy or the key idles past ``--max-idle-secs``), while ``X-SMG-Target-Worker``
is not consulted in PD mode (it routes at random; its policy counter
``smg_manual_policy_branch_total`` shows ``no_routing_id``). So a key cannot be
*chosen* for a worker, only *learned*:

``key_mode="worker"`` (default): the adapter mints a key, sends one small probe
request with it (``probe_body``, 1 new token) and reads which decode worker's
completed-request counter moved (SMG's ``smg_worker_cb_outcomes_total{worker=URL}``
on its Prometheus port): two probe rounds whose moved workers intersect in one
worker bind the key to that worker (concurrent traffic only widens a round, it
cannot bind a key to the wrong worker unless it moves the same worker in both
rounds alone). Keys are minted until every decode worker has one (SMG assigns at
random: a few per worker; a run that leaves a worker without a key backs off 30 s);
a key that landed on an already keyed worker is left to idle out. A request then carries the key of the worker the ELDR policy picked;
a worker without a key yet goes unpinned (SMG's choice). Keys older than
``key_ttl_s`` are learned anew (keep it below SMG's ``--max-idle-secs``).

``key_mode="region"``: ``X-SMG-Routing-Key: eldr-region-<k>`` for the predicted
region k: no probes, SMG keeps each region on one decode worker of its choosing
(grouping by region, without ELDR's load band or its worker choice).

Workers come from SMG's ``GET /workers`` (``worker_type == "decode"``, healthy);
one that leaves the list or turns unhealthy loses its key and leaves the mapping.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from typing import Any, Optional

import aiohttp
import orjson

from eldr_sglang.integrations.prerouter import PreRouter
from eldr_sglang.integrations.scorer import Choice

logger = logging.getLogger("eldr_sglang.integrations")
KEY_HEADER = "X-SMG-Routing-Key"
DEFAULT_PROBE = {"text": "ping", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
_OUTCOME = re.compile(r'^smg_worker_cb_outcomes_total\{([^}]*)\}\s+([0-9.eE+-]+)')
_WORKER = re.compile(r'worker="([^"]*)"')


def parse_outcomes(text: str) -> dict[str, float]:
    """Completed requests per worker URL (all outcomes) from SMG's Prometheus text."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _OUTCOME.match(line)
        if m:
            w = _WORKER.search(m.group(1))
            if w:
                url = w.group(1).rstrip("/")
                out[url] = out.get(url, 0.0) + float(m.group(2))
    return out


class SmgPreRouter(PreRouter):
    kind = "smg"
    repin_statuses: frozenset[int] = frozenset()  # a key never fails: SMG remaps it itself

    def __init__(self, smg_url: str, scorer: Any, *, metrics_url: Optional[str] = None, key_mode: str = "worker",
                 probe_body: Optional[dict] = None, probe_path: str = "/generate", key_ttl_s: float = 3600.0,
                 probe_rounds: int = 6, max_keys_per_worker: int = 8, **kw: Any) -> None:
        super().__init__(smg_url, scorer, **kw)
        if key_mode not in ("worker", "region"):
            raise ValueError("key_mode must be 'worker' or 'region'")
        if key_mode == "worker" and not metrics_url:
            raise ValueError("key_mode 'worker' learns keys from SMG's metrics: give metrics_url "
                             "(its --prometheus-host:--prometheus-port)")
        self.metrics_url, self.key_mode = metrics_url, key_mode
        self.probe_body, self.probe_path = probe_body or DEFAULT_PROBE, probe_path
        self.key_ttl_s, self.probe_rounds, self.max_keys_per_worker = key_ttl_s, probe_rounds, max_keys_per_worker
        self.keys: dict[str, tuple[str, float]] = {}  # worker URL -> (key, learned at, monotonic)
        self._learner: Optional[asyncio.Task] = None
        self._learn_after = 0.0  # after a learning run that left workers without a key: back off
        self.learn_backoff_s = 30.0

    # ------------------------------------------------------------------ discovery
    async def discover(self) -> None:
        async with self.session.get(self.host_url + "/workers") as r:
            doc = orjson.loads(await r.read())
        decodes = sorted({str(w["url"]).rstrip("/") for w in doc.get("workers", [])
                          if w.get("worker_type") == "decode" and w.get("is_healthy", True)})
        now = time.monotonic()
        for w in list(self.keys):
            if w not in decodes or now - self.keys[w][1] > self.key_ttl_s:
                del self.keys[w]
        self.set_workers(decodes)
        if self.key_mode == "worker" and any(w not in self.keys for w in decodes) and \
                (self._learner is None or self._learner.done()) and now >= self._learn_after:
            self._learner = asyncio.get_running_loop().create_task(self._learn())

    def pin_headers(self, choice: Choice) -> Optional[dict[str, str]]:
        if self.key_mode == "region":
            return None if choice.region is None else {KEY_HEADER: f"eldr-region-{choice.region}"}
        entry = self.keys.get(choice.worker)
        return {KEY_HEADER: entry[0]} if entry else None

    def describe(self) -> dict:
        return {"key_mode": self.key_mode, "keys": {w: k for w, (k, _) in self.keys.items()}}

    async def stop(self) -> None:
        if self._learner is not None:
            self._learner.cancel()
            await asyncio.gather(self._learner, return_exceptions=True)
        await super().stop()

    # ------------------------------------------------------------------ key learning
    async def _learn(self) -> None:
        tries = 0
        while True:
            missing = [w for w in self.workers if w not in self.keys]
            if not missing or tries >= self.max_keys_per_worker * max(1, len(self.workers)):
                if missing:
                    self._learn_after = time.monotonic() + self.learn_backoff_s
                    logger.warning("smg: no routing key learned for %s (requests to it go unpinned; "
                                   "next try in %.0f s)", missing, self.learn_backoff_s)
                return
            tries += 1
            key = f"eldr-{uuid.uuid4().hex[:12]}"
            try:
                worker = await self._probe_key(key)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                self.counters["key_probe_errors"] += 1
                logger.warning("smg: probing key %s failed: %r", key, e)
                await asyncio.sleep(self.refresh_s)
                continue
            self.counters["key_probes"] += 1
            if worker is not None and worker in self.workers and worker not in self.keys:
                self.keys[worker] = (key, time.monotonic())
                logger.info("smg: routing key %s -> %s", key, worker)

    async def _outcomes(self) -> dict[str, float]:
        async with self.session.get(self.metrics_url) as r:
            return parse_outcomes(await r.text())

    async def _probe_key(self, key: str) -> Optional[str]:
        """The decode worker SMG bound ``key`` to, or None when the rounds disagree."""
        decodes = set(self.workers)
        candidates: Optional[set[str]] = None
        rounds = 0
        for _ in range(self.probe_rounds):
            before = await self._outcomes()
            async with self.session.post(self.host_url + self.probe_path, data=orjson.dumps(self.probe_body),
                                         headers={KEY_HEADER: key, "Content-Type": "application/json"},
                                         timeout=aiohttp.ClientTimeout(total=120)) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"probe answered {r.status}")
            moved: set[str] = set()
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:  # SMG counts an outcome as the answer completes
                after = await self._outcomes()
                moved = {w for w in decodes if after.get(w, 0.0) - before.get(w, 0.0) >= 1}
                if moved:
                    break
                await asyncio.sleep(0.02)
            if not moved:
                continue
            candidates = moved if candidates is None else candidates & moved
            rounds += 1
            if not candidates:
                candidates, rounds = None, 0
            elif len(candidates) == 1 and rounds >= 2:
                return next(iter(candidates))
        return None
