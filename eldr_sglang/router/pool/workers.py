"""The worker pool: prefill and decode servers, their load, health and breakers.

Load of a decode server = what it reported on its last ``GET /v1/loads`` poll
(running + waiting requests of every router that uses it) plus this router's own
requests started there since, never less than this router's own in-flight count.
So router replicas and ``--workers`` processes see each other's traffic within one
``load_interval`` and do not herd onto one server. With R routers sharing the
servers (``--routers`` x ``--workers``), the own change since the poll counts
``1 + 0.5 (R - 1)`` times: the others are assumed to have started half as many
requests there as this one since (``reckoned_load``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import urllib.parse
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Optional, Sequence

import aiohttp
import orjson

from eldr_sglang.router.pool.breaker import CLOSED, STATE_CODES, CircuitBreaker, Ticket
from eldr_sglang.router.config import RouterConfig, validate_worker_url
from eldr_sglang.router.metrics import RouterMetrics, WorkerMetrics

logger = logging.getLogger("eldr_sglang.router")

# the share of each other router's traffic since the last poll assumed to match this
# router's (benchmark/bench_replicas.py --reckon: at 4 replicas and 60 req/s, 0.5 keeps
# 93-103% of one router's P99 gain where 0 keeps 26-47%, and 1 costs median gain)
RECKON_SHARE = 0.5


def reckon_factor(routers: int, share: float = RECKON_SHARE) -> float:
    """How many times a router counts its own change since the last load poll when
    ``routers`` processes share the decode servers: ``1 + share (routers - 1)``;
    exactly the int 1 for one router (loads stay ints, today's view)."""
    return 1 if routers <= 1 else 1 + share * (routers - 1)


ROUTERS_MAX = 64.0  # the largest router count an estimate gives
ROUTERS_WEIGHT = 0.2  # the weight of each poll's estimate in the smoothed one
ROUTERS_LEAST_OWN = 4  # own requests in flight at a poll below which it tells nothing


def estimate_routers(reported: float, own: float, previous: float | None) -> float | None:
    """``--routers 0``: how many routers share the decode servers, from one load poll: every
    router's requests on them (``reported``, summed over servers) over this router's own then
    (``own``), within [1, ROUTERS_MAX], smoothed with ``previous`` (weight ROUTERS_WEIGHT);
    ``previous`` when fewer than ROUTERS_LEAST_OWN of its own were in flight. Used by the
    router's pool and the replica simulator (benchmark/bench_replicas.py)."""
    if own < ROUTERS_LEAST_OWN:
        return previous
    r = min(max(reported / own, 1.0), ROUTERS_MAX)
    return r if previous is None else previous + ROUTERS_WEIGHT * (r - previous)


def reckoned_load(own: int, reported: int, own_at_report: int, factor: float = 1) -> float:
    """A decode server's load as one router sees it: the last polled count, plus its own
    in-flight change since that poll ``factor`` times (``reckon_factor``: the other
    routers' unseen traffic), never less than its own in-flight count. The router's
    ``Worker.load`` and the replica simulator (benchmark/bench_replicas.py) both use it."""
    return max(own, reported + factor * (own - own_at_report))


def _host_of(url: str) -> str:
    host = urllib.parse.urlparse(url).hostname or ""
    try:
        ipaddress.IPv6Address(host)
        return f"[{host}]"
    except ValueError:
        return host


@dataclass(eq=False)
class Worker:
    """One SGLang server as this router sees it."""

    url: str
    role: str  # "prefill" | "decode"
    breaker: CircuitBreaker
    metrics: WorkerMetrics = field(repr=False)
    bootstrap_port: Optional[int] = None
    inflight: int = 0  # this router's requests in flight there
    requests: int = 0
    failures: int = 0
    alive: bool = True  # verdict of the active health checks
    health_misses: int = 0
    reported: Optional[int] = None  # running + waiting at the last load poll
    inflight_at_report: int = 0  # own in-flight count at that poll
    loads_supported: bool = True  # False once /v1/loads answered 404
    reckon: float = 1  # reckon_factor of the routers sharing it: own change since the poll x this
    host: str = field(init=False)
    _endpoints: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.host = _host_of(self.url)

    def endpoint(self, path: str) -> str:
        u = self._endpoints.get(path)
        if u is None:
            u = self._endpoints[path] = f"{self.url}/{path}"
        return u

    def available(self) -> bool:
        """May be picked now: health checks pass and the breaker lets a request through."""
        return self.alive and self.breaker.allows()

    @property
    def load(self) -> float:  # an int unless --routers reckons the others' traffic
        if self.reported is None:
            return self.inflight
        return reckoned_load(self.inflight, self.reported, self.inflight_at_report, self.reckon)

    def update_gauges(self) -> None:
        m = self.metrics
        m.inflight.set(self.inflight)
        m.healthy.set(int(self.available()))
        m.breaker.set(STATE_CODES[self.breaker.state])

    def describe(self) -> dict:
        return {"url": self.url, "inflight": self.inflight, "load": self.load,
                "reported_load": self.reported, "requests": self.requests,
                "failures": self.failures, "healthy": self.available(), "alive": self.alive,
                "breaker": self.breaker.state,
                "consecutive_failures": self.breaker.failures,
                **({"bootstrap_port": self.bootstrap_port} if self.role == "prefill" else
                   {"reckon": self.reckon})}


class WorkerPool:
    """Prefill and decode servers. A subclass without prefill servers names its
    decode-list servers by ``decode_role`` (metrics, errors, readiness)."""

    decode_role = "decode"
    needs_prefill = True
    missing = "need at least one prefill and one decode server"

    def __init__(self, prefill: Sequence[tuple[str, Optional[int]]], decode: Sequence[str],
                 config: RouterConfig, metrics: RouterMetrics) -> None:
        if (self.needs_prefill and not prefill) or not decode:
            raise ValueError(self.missing)
        self.config, self.metrics = config, metrics
        self.session: Optional[aiohttp.ClientSession] = None  # set by the router at start
        self.routers_seen: Optional[float] = None  # --routers 0: the estimate (estimate_routers)
        self.prefills = [self._new(u, "prefill", p) for u, p in prefill]
        self.decodes: list[Worker] = []
        for u in decode:
            self.add_decode(u)
        self._rr = 0

    def _new(self, url: str, role: str, bootstrap_port: Optional[int] = None) -> Worker:
        url = validate_worker_url(url)
        c = self.config
        w = Worker(url, role, CircuitBreaker(c.breaker_threshold, c.health_cooldown),
                   self.metrics.worker(role, url), bootstrap_port)
        w.reckon = self.reckon_factor()
        w.update_gauges()
        return w

    def reckon_factor(self) -> float:
        """``reckon_factor`` of R = ``--routers`` x ``--workers``; with ``--routers 0``, of the
        estimate from the load polls (which already counts the ``--workers`` processes)."""
        c = self.config
        return reckon_factor(c.routers * c.workers if c.routers else self.routers_seen or 1)

    def all(self) -> list[Worker]:
        return list(chain(self.prefills, self.decodes))

    def roles(self) -> dict[str, list[Worker]]:
        """The servers by role (what readiness needs one of each)."""
        return {**({"prefill": self.prefills} if self.needs_prefill else {}), self.decode_role: self.decodes}

    # ------------------------------------------------------------ membership
    def _add(self, workers: list[Worker], role: str, url: str,
             bootstrap_port: Optional[int] = None) -> Worker:
        w = self._new(url, role, bootstrap_port)
        if w.url in (x.url for x in workers):
            raise ValueError(f"{role} server {w.url} already present")
        workers.append(w)
        return w

    @staticmethod
    def _index(workers: list[Worker], role: str, url: str) -> int:
        """Position of ``url``; ValueError when unknown or the last of its role."""
        urls = [x.url for x in workers]
        if url.rstrip("/") not in urls:
            raise ValueError(f"unknown {role} server {url}")
        return urls.index(url.rstrip("/"))

    def add_decode(self, url: str) -> Worker:
        return self._add(self.decodes, self.decode_role, url)

    def decode_index(self, url: str) -> int:
        return self._index(self.decodes, self.decode_role, url)

    def remove_decode(self, index: int) -> Worker:
        if len(self.decodes) == 1:
            raise ValueError("cannot remove the last decode server")
        return self.decodes.pop(index)  # requests in flight keep their Worker object

    def add_prefill(self, url: str, bootstrap_port: Optional[int]) -> Worker:
        return self._add(self.prefills, "prefill", url, bootstrap_port)

    def remove_prefill(self, url: str) -> Worker:
        i = self._index(self.prefills, "prefill", url)
        if len(self.prefills) == 1:
            raise ValueError("cannot remove the last prefill server")
        return self.prefills.pop(i)

    # ------------------------------------------------------------ selection
    def pick_prefill(self, exclude: frozenset[int] | set[int] = frozenset()) -> Optional[Worker]:
        """Least loaded available prefill; ties round robin. ``exclude``: ids already
        tried (None when none is left)."""
        n = len(self.prefills)
        order = [self.prefills[(self._rr + i) % n] for i in range(n)]
        self._rr = (self._rr + 1) % n
        if exclude:
            order = [s for s in order if id(s) not in exclude]
            if not order:
                return None
        pool = [s for s in order if s.available()] or order
        return min(pool, key=lambda s: s.load)

    def decode_loads(self) -> list[int]:
        return [d.inflight if d.reported is None else d.load for d in self.decodes]

    def allowed_decodes(self, exclude: set[int]) -> list[bool]:
        if not exclude:
            allowed = [d.alive and (d.breaker.state == CLOSED or d.breaker.allows())
                       for d in self.decodes]
        else:
            allowed = [d.available() and i not in exclude for i, d in enumerate(self.decodes)]
        if not any(allowed):  # nothing healthy: let every untried server be tried
            allowed = [i not in exclude for i in range(len(self.decodes))]
        return allowed

    # ------------------------------------------------------------ request accounting
    def enter(self, w: Worker) -> Ticket:
        w.inflight += 1
        w.requests += 1
        ticket = w.breaker.ticket()
        w.metrics.requests.inc()
        if ticket.trial:
            w.update_gauges()
        return ticket

    def leave(self, w: Worker, ticket: Ticket) -> None:
        """The request is over: its ticket ends here if nothing gave a verdict."""
        w.inflight -= 1
        ticket.close()  # the in-flight gauge is set at scrape time (update_gauges)

    def success(self, w: Worker, ticket: Ticket) -> None:
        if ticket.success():
            logger.info("%s %s: circuit breaker closed", w.role, w.url)
            w.update_gauges()

    def failure(self, w: Worker, ticket: Ticket, why: str, kind: str, hard: bool = False) -> None:
        """A worker failure (``hard``: unreachable, opens the breaker at once)."""
        w.failures += 1
        m = self.metrics
        m.upstream_failures.labels(w.role, w.url).inc()
        m.worker_errors.labels(w.role, w.url, kind).inc()
        if ticket.failure(hard):
            m.event(f"{w.role}_breaker_opened")
            logger.warning("%s %s: circuit breaker open for %.1fs (%s)", w.role, w.url,
                           w.breaker.cooldown, why)
        w.update_gauges()
        logger.warning("%s %s failed: %s", w.role, w.url, why)

    # ------------------------------------------------------------ health and load
    async def _get_json(self, url: str, timeout: float) -> tuple[int, Any]:
        async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            raw = await r.read()
            return r.status, orjson.loads(raw) if r.status == 200 and raw else None

    async def check_health(self) -> None:
        """One round of ``GET /health`` on every worker."""
        await asyncio.gather(*(self._check(w) for w in self.all()))

    async def _check(self, w: Worker) -> None:
        try:
            async with self.session.get(w.endpoint("health"), timeout=aiohttp.ClientTimeout(
                    total=self.config.health_timeout)) as r:
                await r.read()
                ok = r.status == 200
        except Exception:  # noqa: BLE001 - any failure is a miss
            ok = False
        self.metrics.health_checks.labels(w.role, w.url, "ok" if ok else "fail").inc()
        if ok:
            w.health_misses = 0
            if not w.alive:
                w.alive = True
                self.metrics.event(f"{w.role}_back_in")
                logger.warning("%s %s passes health checks again: back in", w.role, w.url)
            w.breaker.probe_passed()
        else:
            w.health_misses += 1
            if w.alive and w.health_misses >= self.config.health_failures:
                w.alive = False
                self.metrics.event(f"{w.role}_taken_out")
                logger.warning("%s %s failed %d health checks: taken out", w.role, w.url,
                               w.health_misses)
        w.update_gauges()

    async def poll_loads(self) -> None:
        """One round of ``GET /v1/loads`` on every decode server that serves it."""
        await asyncio.gather(*(self._poll(w) for w in list(self.decodes) if w.loads_supported))
        if self.config.routers == 0:
            polled = [w for w in self.decodes if w.reported is not None]
            self.routers_seen = estimate_routers(sum(w.reported for w in polled),
                                                 sum(w.inflight_at_report for w in polled), self.routers_seen)
            factor = self.reckon_factor()
            for w in self.decodes:
                w.reckon = factor

    async def _poll(self, w: Worker) -> None:
        at = w.inflight
        try:
            status, doc = await self._get_json(w.endpoint("v1/loads?include=core"),
                                               self.config.health_timeout)
            if status == 404:
                w.loads_supported = False
                logger.info("decode %s has no /v1/loads: own in-flight counts only", w.url)
                return
            ranks = doc["loads"] if status == 200 else None
            reported = sum(int(x.get("num_running_reqs", 0)) + int(x.get("num_waiting_reqs", 0))
                           for x in ranks)
        except Exception:  # noqa: BLE001 - unknown load: own counts until the next poll
            w.reported = None
            return
        w.reported, w.inflight_at_report = reported, at
        w.metrics.reported_load.set(reported)

    async def run_periodic(self, interval: float, job) -> None:
        """Run ``job()`` every ``interval`` s; a failing round is logged, never fatal."""
        while True:
            await asyncio.sleep(interval)
            try:
                await job()
            except Exception:  # noqa: BLE001
                logger.exception("periodic %s failed", getattr(job, "__name__", job))
