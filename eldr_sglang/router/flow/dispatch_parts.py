"""What the PD dispatch flow works with: :class:`DispatchParts` (the router parts it
uses, fixed at start), :class:`Flight` (one client request on its way) and
:class:`PrefillResult` (how a prefill call ended)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional

import orjson

from eldr_sglang.core.policies import RouteRequest
from eldr_sglang.router.state.admission import Admission
from eldr_sglang.router.http.bodies import BodyParser
from eldr_sglang.router.config import RouterConfig
from eldr_sglang.router.state.decision_log import DecisionLog
from eldr_sglang.router.signals.intake import RateLimitedLog
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.router.state.routing import Routing, RoutingState
from eldr_sglang.router.runtime import Runtime
from eldr_sglang.router.signals.signatures import SignatureBoard, WaitLimit
from eldr_sglang.router.pool.upstream import UpstreamClient
from eldr_sglang.router.pool.workers import Worker, WorkerPool

if TYPE_CHECKING:
    from eldr_sglang.router.state.ab import ShadowPolicy

EarlyRoute = Callable[[dict, str, Optional[str]], Awaitable[Optional[RouteRequest]]]


@dataclass(frozen=True)
class DispatchParts:
    """The parts of a router the dispatch flow reads and calls; nothing else."""

    config: RouterConfig
    metrics: RouterMetrics
    pool: WorkerPool
    board: SignatureBoard
    parser: BodyParser
    upstream: UpstreamClient
    wait_limit: WaitLimit
    state: RoutingState
    runtime: Runtime
    decisions: DecisionLog
    log: RateLimitedLog  # rate-limited warnings (shared with the signature intake)
    admission: Admission
    shadow: Optional["ShadowPolicy"] = None
    early: Optional[EarlyRoute] = None  # --binding early|auto: a route at arrival, or None
    learns: bool = False  # --online: every request's signature is watched


@dataclass
class PrefillResult:
    status: int  # HTTP status; 0 when the call itself failed
    body: bytes
    error: str = ""
    url: str = ""  # the prefill server that answered
    local: bool = False  # the router's own failure (resources), not the worker's

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


@dataclass(eq=False, slots=True)
class Flight:
    """One client request on its way: body, chosen prefill, the bytes sent upstream,
    the headers that go with them and the workers that got the request (the only
    ones an abort goes to); what the steps found out on the way."""

    endpoint: str
    t0: float  # perf_counter at arrival
    body: dict
    n: Optional[int]  # batch size (None: one request)
    rids: list[str]
    routing: Routing  # the one it arrived under (an A/B arm)
    headers: tuple = ()
    label: Optional[str] = None
    stream: bool = False
    rooms: list[int] = field(default_factory=list)
    waiters: list[asyncio.Future] = field(default_factory=list)
    prefill: Optional[Worker] = None
    payload: bytes = b""
    prefill_task: Optional[asyncio.Task] = None
    route: RouteRequest = field(default_factory=RouteRequest)
    waited: float = 0.0  # seconds waited for the signature
    decode_sent: bool = False
    finished: bool = False  # the client has the whole answer (a stream's last event relayed)
    sent: set[int] = field(default_factory=set)  # ids of the workers the request was written to
    ab: Any = None  # the A/B slice's token (the shell's)

    def on_sent(self, w: Worker) -> Callable[[], None]:
        return lambda: self.sent.add(id(w))

    def set_prefill(self, p: Worker) -> None:
        n, body = self.n, self.body
        self.prefill = p
        body["bootstrap_host"] = [p.host] * n if n else p.host
        body["bootstrap_port"] = [p.bootstrap_port] * n if n else p.bootstrap_port
        self.payload = orjson.dumps(body)
