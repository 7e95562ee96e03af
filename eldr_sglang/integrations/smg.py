"""SMG (``sglang-router`` 0.3.2, PD mode): pin the ELDR decode worker with a routing key.

Checked against 0.3.2 with stub workers: with ``--pd-disaggregation --decode-policy
manual``, ``X-SMG-Routing-Key`` is sticky (a new key is bound to a decode worker of
SMG's choosing, by ``--assignment-mode``, and keeps it until that worker turns
unhealthy, the key idles past ``--max-idle-secs`` or SMG restarts), while
``X-SMG-Target-Worker`` is not consulted in PD mode. 0.3.2 has no routing-key
override and no routing-token hints, so a key cannot be *chosen* for a worker, only
*learned*, and it must be checked for as long as it is used.

``key_mode="worker"`` (default): one key per decode worker, learned and verified
from SMG's ``smg_worker_routing_keys_active{worker}`` gauge (:mod:`.smg_keys`; only
keyed requests move it, so other traffic neither slows learning nor misleads it):

* learning: a probe (``probe_body``) carries a new key; while it is in flight the
  gauge is read, and the decode workers whose gauge rose (with the pre-router's own
  keyed requests unchanged) are the round's candidates; two rounds that agree on one
  worker bind the key. Up to ``max_keys_per_worker`` keys per missing worker per run,
  ``probe_rounds`` probes per key; a run that leaves a worker without a key says so
  (WARNING, ``status()["learning"]``) and backs off ``learn_backoff_s``;
* verification: every ``verify_s`` the gauge is read between two snapshots of the
  pre-router's in-flight requests per key; a key steadily in flight must show at its
  worker. A key judged wrong stops being used at once (its worker goes unpinned) and
  is probed again to learn where it is now;
* restarts and replicas: SMG draws a new ``id`` for every worker when it starts, so
  a changed set of ids in ``GET /workers`` is a restart: every key stops being used
  until a probe re-learns where the new SMG binds it. A set of ids seen before coming
  back means several SMG replicas answer behind ``host_url`` (a key means a different
  worker in each): worker pinning stops (``fallback_smg_replicas``) with a WARNING.
  While ``GET /workers`` fails (SMG down, restarting) nothing is pinned, so no request
  after a restart carries a key before the new ids are seen;
* a key unused for ``key_ttl_s`` is probed again before SMG's idle eviction could
  move it (keep it below ``--max-idle-secs``); keys are never dropped all at once.

``key_mode="region"``: ``X-SMG-Routing-Key: eldr-region-<k>`` for the predicted
region k: no probes, SMG keeps each region on one decode worker of its choosing.

Workers come from SMG's ``GET /workers`` (``worker_type == "decode"``, healthy), with
``control_token`` as a bearer token where SMG's control plane needs one; probes carry
``api_key`` (SMG's ``--api-key``).
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
from eldr_sglang.integrations.smg_keys import GAUGE, KeyBook, parse_keys_active

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
                 probe_rounds: int = 6, max_keys_per_worker: int = 8, verify_s: float = 0.5,
                 learn_backoff_s: float = 30.0, **kw: Any) -> None:
        super().__init__(smg_url, scorer, **kw)
        if key_mode not in ("worker", "region"):
            raise ValueError("key_mode must be 'worker' or 'region'")
        if key_mode == "worker" and not metrics_url:
            raise ValueError("key_mode 'worker' learns keys from SMG's metrics: give metrics_url "
                             "(its --prometheus-host:--prometheus-port)")
        self.metrics_url, self.key_mode = metrics_url, key_mode
        self.probe_body, self.probe_path = probe_body or DEFAULT_PROBE, probe_path
        self.key_ttl_s, self.probe_rounds, self.max_keys_per_worker = key_ttl_s, probe_rounds, max_keys_per_worker
        self.verify_s, self.learn_backoff_s = verify_s, learn_backoff_s
        self.book = KeyBook()
        self.suspects: list[str] = []  # keys to probe again (restart, wrong, idle): where are they now?
        self.fingerprint: Optional[frozenset] = None  # SMG's worker ids: new after a restart
        self.ids: dict[str, str] = {}
        self.fingerprints_seen: set[frozenset] = set()
        self.replicas = False
        self.unreachable = False  # the last GET /workers failed: no pins until it answers
        self.learning: dict[str, Any] = {"missing": [], "last_run": None, "gauge": None}
        self._learner: Optional[asyncio.Task] = None
        self._verifier: Optional[asyncio.Task] = None
        self._learn_after = 0.0

    @property
    def keys(self) -> dict[str, str]:
        """Decode worker URL -> the routing key in use for it (verified so far)."""
        return {w: k.key for w, k in self.book.active.items()}

    # ------------------------------------------------------------------ discovery
    async def discover(self) -> None:
        try:
            await self._discover()
            self.unreachable = False
        except Exception:
            # SMG down (restarting?) or its list unreadable: pin nothing until it answers again, so
            # that requests right after a restart never carry keys the new SMG binds at random
            self.unreachable = True
            raise

    async def _discover(self) -> None:
        async with self.session.get(self.host_url + "/workers", headers=self.control_headers) as r:
            if r.status != 200:
                raise RuntimeError(f"GET /workers answered {r.status}" +
                                   (" (control-plane auth: give a control token)" if r.status in (401, 403) else ""))
            doc = orjson.loads(await r.read())
        listed = doc.get("workers", [])
        decodes = sorted({str(w["url"]).rstrip("/") for w in listed
                          if w.get("worker_type") == "decode" and w.get("is_healthy", True)})
        self._check_ids({str(w.get("url")).rstrip("/"): str(w["id"]) for w in listed if w.get("id") is not None})
        now = time.monotonic()
        for w in list(self.book.active):
            if w not in decodes:
                self.book.drop(w)
            elif now - self.book.active[w].used > self.key_ttl_s:
                self._suspect(self.book.drop(w), "unused for key_ttl_s: probed again before SMG evicts it")
        self.set_workers(decodes)
        if self.key_mode == "worker" and not self.replicas:
            if self._verifier is None:
                self._verifier = asyncio.get_running_loop().create_task(self._verify_loop())
            self._maybe_learn()

    def _check_ids(self, ids: dict[str, str]) -> None:
        """Worker URL -> SMG's id for it: all ids new is a restart, an id set seen before
        coming back is a second replica, one worker's new id its re-registration."""
        fp = frozenset(ids.values())
        if not fp or fp == self.fingerprint:
            return
        old, self.fingerprint = self.ids, fp
        self.ids = ids
        if old and not fp & frozenset(old.values()) and fp in self.fingerprints_seen:
            if not self.replicas:
                self.replicas = True
                self.counters["smg_replicas_detected"] += 1
                logger.warning("smg: %s answers with worker ids seen before: several SMG replicas (a routing "
                               "key means a different worker in each); worker pinning stops until this "
                               "pre-router restarts. Point it at one SMG, or use --key-mode region", self.host_url)
        elif old and not fp & frozenset(old.values()):
            self.counters["smg_restarts"] += 1
            logger.warning("smg: every worker id at %s is new: SMG restarted; its keys are probed again "
                           "(requests go unpinned until then)", self.host_url)
            for w in list(self.book.active):
                self._suspect(self.book.drop(w), "SMG restarted")
            self._learn_after = 0.0
        else:
            for w in [w for w in self.book.active if old.get(w) != ids.get(w)]:
                self._suspect(self.book.drop(w), "SMG registered the worker anew")
        self.fingerprints_seen.add(fp)

    def _suspect(self, key: Any, why: str) -> None:
        if key is not None and key.key not in self.suspects:
            logger.info("smg: key %s (was %s) to be probed again: %s", key.key, key.worker, why)
            self.suspects.append(key.key)

    def pin_headers(self, choice: Choice) -> Optional[dict[str, str]]:
        if self.key_mode == "region":
            return None if choice.region is None else {KEY_HEADER: f"eldr-region-{choice.region}"}
        if self.replicas or self.unreachable:
            self.counters["fallback_smg_replicas" if self.replicas else "fallback_smg_unlisted"] += 1
            return None
        key = self.book.key_for(choice.worker)
        return {KEY_HEADER: key} if key else None

    def pin_started(self, pin: dict[str, str]) -> None:
        if self.key_mode == "worker" and KEY_HEADER in pin:
            self.book.started(pin[KEY_HEADER])

    def pin_ended(self, pin: dict[str, str]) -> None:
        if self.key_mode == "worker" and KEY_HEADER in pin:
            self.book.ended(pin[KEY_HEADER])

    def describe(self) -> dict:
        return {"key_mode": self.key_mode, "keys": self.keys, "key_evidence": self.book.describe(),
                "suspect_keys": list(self.suspects), "smg_replicas": self.replicas, "learning": self.learning}

    async def stop(self) -> None:
        for task in (self._learner, self._verifier):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await super().stop()

    # ------------------------------------------------------------------ evidence
    async def _gauge(self) -> Optional[dict[str, float]]:
        async with self.session.get(self.metrics_url) as r:
            found = parse_keys_active(await r.text())
        if found is None and self.learning["gauge"] is not False:
            logger.warning("smg: %s has no smg_ metrics: keys can be neither learned nor verified (is "
                           "--metrics-url SMG's Prometheus endpoint? %s is read)", self.metrics_url, GAUGE)
        self.learning["gauge"] = found is not None
        return found

    async def _verify_loop(self) -> None:
        while True:
            await asyncio.sleep(self.verify_s)
            if not self.book.active:
                continue
            try:
                before = self.book.snapshot()
                await asyncio.sleep(0.01)  # a request sent just now: let SMG count it
                gauge = await self._gauge()
                await asyncio.sleep(0.01)  # one that SMG finished just now: let it reach us
                after = self.book.snapshot()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                self.counters["verify_errors"] += 1
                logger.debug("smg: key verification read failed: %r", e)
                continue
            if gauge is None:
                continue
            self.counters["verify_reads"] += 1
            for k in self.book.observe(gauge, before, after):
                self.counters["keys_contradicted"] += 1
                logger.warning("smg: key %s is not at %s (%d of its last %d observations miss): no longer "
                               "used; probing where it is", k.key, k.worker, k.misses, len(k.seen))
                self._suspect(k, "contradicted")
            self._maybe_learn()

    # ------------------------------------------------------------------ learning
    def _maybe_learn(self) -> None:
        if self.replicas or self.unreachable:
            return
        wanted = self.suspects or any(w not in self.book.active for w in self.workers)
        if wanted and (self._learner is None or self._learner.done()) and time.monotonic() >= self._learn_after:
            self._learner = asyncio.get_running_loop().create_task(self._learn())

    async def _learn(self) -> None:
        probes0, unseen0, t0 = self.counters["probe_requests"], self.counters["probes_unseen"], time.monotonic()
        minted = 0
        budget = self.max_keys_per_worker * max(1, sum(w not in self.book.active for w in self.workers))
        while True:
            missing = [w for w in self.workers if w not in self.book.active]
            if not missing:
                self.suspects.clear()  # every worker has a verified key: old ones idle out in SMG
            if not self.suspects and (not missing or minted >= budget):
                break
            if self.suspects:
                key = self.suspects.pop(0)
            else:
                key, minted = f"eldr-{uuid.uuid4().hex[:12]}", minted + 1
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
            if worker is not None and worker in self.workers and worker not in self.book.active:
                self.book.bind(key, worker)
                self.counters["keys_learned"] += 1
                logger.info("smg: routing key %s -> %s", key, worker)
        missing = [w for w in self.workers if w not in self.book.active]
        self.learning.update(missing=missing, last_run={
            "probe_requests": self.counters["probe_requests"] - probes0, "seconds": round(time.monotonic() - t0, 2),
            "keys": minted, "converged": not missing})
        if missing:
            self.counters["learning_failed"] += 1
            self._learn_after = time.monotonic() + self.learn_backoff_s
            logger.warning("smg: no routing key learned for %s after %d probe requests (their requests go "
                           "unpinned; next try in %.0f s). %s", missing, self.learning["last_run"]["probe_requests"],
                           self.learn_backoff_s, "Probes were never seen in flight: a longer --probe-body "
                           "(more new tokens) helps" if self.counters["probes_unseen"] - unseen0 ==
                           self.counters["probe_requests"] - probes0 else "")

    async def _probe(self, key: str) -> None:
        self.counters["probe_requests"] += 1
        async with self.session.post(self.host_url + self.probe_path, data=orjson.dumps(self.probe_body),
                                     headers={KEY_HEADER: key, "Content-Type": "application/json",
                                              **self.api_headers},
                                     timeout=aiohttp.ClientTimeout(total=120)) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"probe answered {r.status}")

    async def _probe_key(self, key: str) -> Optional[str]:
        """The decode worker SMG binds ``key`` to, or None when the rounds disagree or see nothing."""
        candidates: Optional[set[str]] = None
        agreed = 0
        for _ in range(self.probe_rounds):
            decodes = set(self.workers)
            before, base = self.book.snapshot(), await self._gauge()
            if base is None:
                return None
            probe = asyncio.get_running_loop().create_task(self._probe(key))
            moved: set[str] = set()
            try:
                while not probe.done() and not moved:  # the first steady read that shows it ends the round
                    gauge = await self._gauge()
                    if gauge is not None and self.book.steady(before, self.book.snapshot()):
                        moved = {w for w in decodes if gauge.get(w, 0.0) > base.get(w, 0.0)}
                    await asyncio.sleep(0.002)
            except BaseException:
                probe.cancel()
                await asyncio.gather(probe, return_exceptions=True)
                raise
            await probe  # raises what the probe raised
            if not moved:
                self.counters["probes_unseen"] += 1
                continue
            candidates = moved if candidates is None else candidates & moved
            agreed += 1
            if not candidates:
                candidates, agreed = None, 0
            elif len(candidates) == 1 and agreed >= 2:
                return next(iter(candidates))
        return None
