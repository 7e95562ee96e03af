"""The ELDR decision for a host router: which decode worker a request should go to.

Two scorers answer the same question, ``choose(body, endpoint, workers, loads)``:

* :class:`LocalScorer` (in process, the default): the artifact's signature predictor
  (:class:`~eldr_sglang.router.signals.scoring.PredictedRouting`) and the router's default
  policy (``eldr_balanced``, any registered name) decide over the adapter's current
  worker list with the loads the adapter sees (its own in-flight requests per worker).
  The policy's server list follows the worker list (``add_server``/``remove_server``),
  so per-server state (centroid ownership) survives a worker joining or leaving.
* :class:`RemoteScorer`: ``POST /eldr/score`` of a running co-located ELDR router. The
  pick there is made with that router's loads (its own in-flight counts), and its
  ``server`` URL is matched to a worker by URL where workers have URLs (SMG), else its
  ``index`` is taken over the adapter's worker order.

Both return ``None`` when they cannot decide (no predictor, no tokens, no workers);
the adapter then lets the host router choose. Neither ever raises into the request
path: the adapter catches and falls back (see :mod:`.prerouter`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import aiohttp
import numpy as np
import orjson

from eldr_sglang.core.policies import PolicyContext, RouteRequest, build_policy
from eldr_sglang.prompts import Tokenizer, default_tokenizer_path, load_tokenizer
from eldr_sglang.router.http.prompt_view import bounded_view
from eldr_sglang.router.signals.prompt_work import PromptWork
from eldr_sglang.router.signals.scoring import PredictedRouting, decide
from eldr_sglang.router.signals.signatures import load_calibration


@dataclass
class Choice:
    """One ELDR decision: the worker (adapter key), the predicted region, the path."""

    worker: str
    region: Optional[int] = None
    path: str = "predicted"  # predicted | fallback | blind (router.scoring.PATHS)
    ticket: Any = None  # the policy's admit token (LocalScorer), released by the adapter
    elapsed_s: float = 0.0


class LocalScorer:
    """Predicted signature + the policy, in process (no I/O).

    ``artifact``: a CalibrationArtifact with a predictor (or a path to one);
    ``tokenizer``: a Tokenizer, a path, or None for the one the artifact names."""

    def __init__(self, artifact: Any, tokenizer: Any = None, policy: str = "eldr_balanced",
                 policy_params: Optional[dict] = None, tau: Optional[float] = None, seed: int = 0,
                 max_batch: int = 256) -> None:
        if isinstance(artifact, (str, bytes)) or hasattr(artifact, "__fspath__"):
            artifact = load_calibration(str(artifact))
        if tokenizer is None or isinstance(tokenizer, str) or hasattr(tokenizer, "__fspath__"):
            path = tokenizer if tokenizer is not None else default_tokenizer_path(artifact)
            tokenizer = load_tokenizer(path) if path else None
        self.artifact, self.tokenizer = artifact, tokenizer
        self.routing = PredictedRouting(artifact, tokenizer)
        self.policy_name, self.policy_params, self.tau, self.seed = policy, policy_params, tau, seed
        self.centroids = np.asarray(artifact.centroids, dtype=np.float32)
        self.policy: Any = None
        self.order: list[str] = []  # the policy's server order (adapter worker keys)
        self.work, self.max_batch = PromptWork(), max_batch

    @property
    def can_predict(self) -> bool:
        return self.routing.can_predict

    def _sync(self, workers: Sequence[str]) -> None:
        """Keep the policy's server list equal to ``workers`` (as a set; order of arrival)."""
        if self.policy is None:
            if not workers:
                return
            self.order = list(workers)
            art_tau = getattr(self.artifact, "tau", None)
            ctx = PolicyContext(len(self.order), seed=self.seed, tau=self.tau, centroids=self.centroids,
                                artifact_tau=None if art_tau is None else float(art_tau),
                                params=self.policy_params)
            self.policy = build_policy(self.policy_name, ctx)
            return
        live = set(workers)
        for i in range(len(self.order) - 1, -1, -1):
            if self.order[i] not in live and len(self.order) > 1:
                self.policy.remove_server(i)
                del self.order[i]
        for w in workers:
            if w not in self.order:
                self.policy.add_server()
                self.order.append(w)

    def route(self, body: dict, endpoint: str) -> Optional[RouteRequest]:
        """The predicted route of a parsed body, from its bounded view (the routers' own
        :func:`~eldr_sglang.router.http.prompt_view.bounded_view`); ValueError (the
        adapter falls back) for a body a router would refuse. Runs on the prompt thread."""
        if not self.can_predict:
            return None
        route, _ = self.routing.predict(bounded_view(body, endpoint, self.max_batch), endpoint)
        return route

    async def choose(self, body: dict, endpoint: str, workers: Sequence[str],
                     loads: dict[str, int]) -> Optional[Choice]:
        t0 = time.perf_counter()
        if not workers:
            return None
        route = await self.work.run(self.route, body, endpoint)  # off the loop, bounded queue
        if route is None:
            return None
        self._sync(workers)
        live = set(workers)
        allowed = [w in live for w in self.order]
        dec, path = decide(self.policy, route, [int(loads.get(w, 0)) for w in self.order], allowed)
        worker = self.order[dec.index]
        if worker not in live:  # every allowed server was excluded: the policy picked any
            return None
        region = int(np.argmax(self.centroids @ route.signature))
        ticket = self.policy.admit(dec.index, route)
        return Choice(worker, region, path, ticket, time.perf_counter() - t0)

    def release(self, choice: Choice) -> None:
        if self.policy is not None and choice.ticket is not None:
            self.policy.release(choice.ticket)


class ScorerAnswerError(ValueError):
    """A remote scorer's answer that cannot be trusted (status, size, type, range)."""


_UNSAFE = frozenset("\r\n\x00")
PATH_NAMES = frozenset({"predicted", "fallback", "blind"})


def header_safe(value: Any, limit: int = 1024) -> bool:
    """``value`` is a str that can go into an HTTP header as is (no CR, LF, NUL; short)."""
    return isinstance(value, str) and len(value) <= limit and not (_UNSAFE & set(value))


def _int(value: Any, lo: int, hi: int, what: str) -> int:
    """An int (not bool, not float) in [lo, hi), else ScorerAnswerError."""
    if type(value) is not int or not lo <= value < hi:
        raise ScorerAnswerError(f"{what} ({type(value).__name__}) is not an int in [{lo}, {hi})")
    return value


def parse_answer(doc: Any, workers: Sequence[str], max_regions: int = 1 << 16) -> tuple[str, Optional[int], str]:
    """(worker, region, path) from a ``/eldr/score`` answer, validated.

    ``server`` (a URL) names the worker when it matches one; else ``index`` must be an
    int in [0, len(workers)). ``region`` is None or an int in [0, max_regions); ``path``
    one of :data:`PATH_NAMES` (anything else is recorded as ``"remote"``)."""
    if not isinstance(doc, dict):
        raise ScorerAnswerError("answer is not a JSON object")
    server = doc.get("server")
    by_url = {w.rstrip("/"): w for w in workers}
    worker = by_url.get(server.rstrip("/")) if header_safe(server, 2048) else None
    if worker is None:
        worker = workers[_int(doc.get("index"), 0, len(workers), "index")]
    region = doc.get("region")
    if region is not None:
        region = _int(region, 0, max_regions, "region")
    path = doc.get("path")
    return worker, region, path if path in PATH_NAMES else "remote"


async def read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body of ``resp``, or ScorerAnswerError once it passes ``limit`` bytes."""
    if (resp.content_length or 0) > limit:
        raise ScorerAnswerError(f"answer of {resp.content_length} bytes > {limit}")
    buf = bytearray()
    async for chunk in resp.content.iter_chunked(65536):
        buf += chunk
        if len(buf) > limit:
            raise ScorerAnswerError(f"answer over {limit} bytes")
    return bytes(buf)


class RemoteScorer:
    """``POST {url}/eldr/score`` of a co-located ELDR router.

    ``timeout_s`` bounds the whole call (connect, headers, body); the answer is read
    up to ``max_answer_bytes`` and validated (:func:`parse_answer`): a slow, large or
    malformed answer raises (the adapter falls back, the request never fails)."""

    remote = True

    def __init__(self, url: str, timeout_s: float = 0.25, api_key: Optional[str] = None,
                 max_answer_bytes: int = 256 << 10, max_regions: int = 1 << 16) -> None:
        self.url = url.rstrip("/") + "/eldr/score"
        self.timeout_s, self.max_answer_bytes, self.max_regions = timeout_s, max_answer_bytes, max_regions
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.session: Optional[aiohttp.ClientSession] = None

    async def start(self) -> None:
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=max(1.0, 4 * self.timeout_s)))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def choose(self, body: dict, endpoint: str, workers: Sequence[str],
                     loads: dict[str, int]) -> Optional[Choice]:
        t0 = time.perf_counter()
        if not workers:
            return None
        await self.start()
        async with asyncio.timeout(self.timeout_s):  # the whole answer, not each read
            async with self.session.post(self.url, data=orjson.dumps({**body, "endpoint": endpoint}),
                                         headers=self.headers) as r:
                if r.status != 200:
                    raise ScorerAnswerError(f"/eldr/score answered {r.status}")
                raw = await read_capped(r, self.max_answer_bytes)
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise ScorerAnswerError(f"answer is not JSON: {e}") from None
        worker, region, path = parse_answer(doc, list(workers), self.max_regions)
        return Choice(worker, region, path, None, time.perf_counter() - t0)

    def release(self, choice: Choice) -> None:
        pass
