"""The PD router: the server shell (:mod:`~eldr_sglang.router.shell`) with the
prefill/decode flow and its signature parts.

The shell owns HTTP conventions, admission, drain, lifecycle, status and metrics;
this flow adds:

* :mod:`~eldr_sglang.router.signals.signatures` and :mod:`~eldr_sglang.router.signals.intake`: the
  signature board and its intake (HTTP and TCP);
* :mod:`~eldr_sglang.router.flow.dispatch`: the PD dispatch flow (late binding), as named
  steps over :class:`~eldr_sglang.router.flow.dispatch_parts.DispatchParts`;
* :mod:`~eldr_sglang.router.state.online`: online calibration; :mod:`~eldr_sglang.router.state.ab`:
  the shadow policy (both learn from the signature messages).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import replace
from typing import Any, Optional, Sequence

from aiohttp import web

from eldr_sglang.core.policies import Decision
from eldr_sglang.router.state.ab import ShadowPolicy
from eldr_sglang.router.config import RouterConfig
from eldr_sglang.router.flow.dispatch import Dispatcher
from eldr_sglang.router.flow.dispatch_parts import DispatchParts
from eldr_sglang.router.signals.early import EarlyBinding
from eldr_sglang.router.signals.intake import SignatureIntake
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.router.state.online import OnlineController
from eldr_sglang.router.shell import RouterShell, initial_artifact
from eldr_sglang.router.signals.signatures import SignatureBoard, WaitLimit
from eldr_sglang.router.pool.workers import Worker, WorkerPool

logger = logging.getLogger("eldr_sglang.router")
def _load_json(text: str) -> dict:
    if os.path.exists(text):
        with open(text) as f:
            return json.load(f)
    return json.loads(text)


class Router(RouterShell):
    """One PD router process: the shell, the signature board and intake, and the
    dispatch flow.

    ``Router(prefill, decode, policy, artifact=..., domain_map=..., **settings)``:
    ``settings`` are :class:`RouterConfig` fields (or pass ``config=``)."""

    mode = "pd"

    def __init__(self, prefill: Sequence[tuple[str, Optional[int]]], decode: Sequence[str],
                 policy: Optional[str] = None, *, artifact: Any = None,
                 domain_map: Optional[dict] = None, config: Optional[RouterConfig] = None,
                 **settings: Any) -> None:
        if config is None:
            config = RouterConfig.from_dict({**settings, **({"policy": policy} if policy else {})})
        elif settings or policy:
            config = replace(config, **settings, **({"policy": policy} if policy else {}))
        c, m = config, RouterMetrics()
        if artifact is None:
            artifact = initial_artifact(c)
        if domain_map is None and c.domain_map:
            domain_map = _load_json(c.domain_map)
        super().__init__(c, m, WorkerPool(prefill, decode, c, m), artifact, domain_map)
        state = self.state
        self.board = SignatureBoard(ttl=c.signature_ttl, max_buffered=c.signature_buffer,
                                    max_bytes=int(c.signature_buffer_mb * (1 << 20)))
        self.intake = SignatureIntake(self.board, m,
                                      int(min(c.signature_max_kb * 1024, c.max_body_mb * (1 << 20))),
                                      encoder=lambda: state.routing.encoder,
                                      buffering=lambda: state.routing.policy.needs_signature,
                                      observer=self._observe if c.online or c.shadow_policy else None,
                                      parser=self.parser, body_timeout=c.client_body_timeout or None,
                                      key=c.signature_key(), api_key=self.api_key,
                                      max_age=c.signature_max_age, max_streams=c.signature_max_streams,
                                      stream_idle=c.signature_stream_idle,
                                      line_timeout=c.signature_line_timeout)
        self._warn_open_intake(c)
        ready = self.info.readiness  # /ready says when ELDR is degraded (still 200: served by load)
        self.info.readiness = lambda: {**ready(), "eldr": self._eldr_health()}
        log = self.intake.log  # one rate-limited warning log for the intake and the flow
        self.online = (OnlineController(c, m, state, self.runtime.spawn, log) if c.online else None)
        self.admin.online = self.online
        self.shadow = ShadowPolicy(state, m, c.shadow_policy) if c.shadow_policy else None
        self.wait_limit = WaitLimit(c.signature_timeout, c.signature_timeout_min,
                                    c.signature_timeout_factor)
        m.signature_wait_limit.set(self.wait_limit.value)
        self.early = EarlyBinding(c, m.registry, lambda: state.routing.encoder) if c.binding != "late" else None
        early = self.early.route if self.early is not None else None
        self.dispatcher = Dispatcher(DispatchParts(
            c, m, self.pool, self.board, self.parser, self.upstream, self.wait_limit, state,
            self.runtime, self.decisions, log, self.admission, shadow=self.shadow, early=early,
            learns=self.online is not None))
        self.flow = self.dispatcher

    def _warn_open_intake(self, c: RouterConfig) -> None:
        """Say at start who may post signature messages when no signature key is set."""
        if self.intake.bearer is None and self.intake.key is not None:
            return  # a signature key: only signed messages
        where = "POST /eldr/signature" + (f" and the TCP port --signature-port {c.signature_port}"
                                          if c.signature_port is not None else "")
        if self.intake.bearer is not None:
            logger.warning("no --signature-key-file (or ELDR_SIGNATURE_KEY): the signature intake (%s) "
                           "takes messages authenticated with the client API key (Bearer, or "
                           "signed with it as the HMAC key); give routers and engines a signature "
                           "key of their own", where)
        else:
            logger.warning("the signature intake (%s) is OPEN: no --signature-key-file (or "
                           "ELDR_SIGNATURE_KEY) and no --api-key, so anyone who reaches it can "
                           "steer requests to a decode server of their choice; set a shared key "
                           "on routers and engines, or keep the intake on a network only the "
                           "engines reach", where)

    def _eldr_health(self) -> dict:
        h = self.intake.health.describe()
        return {"degraded": h["degraded"], "causes": h["causes"]}

    def _observe(self, msg: dict) -> None:
        """Every well-formed signature message: online calibration and shadow decisions."""
        if self.online is not None:
            self.online.observe(msg)
        if self.shadow is not None:
            self.shadow.on_message(msg)

    # ------------------------------------------------------------ the public API
    def record(self, rids: list[str], rooms: list[int], label: Optional[str],
               waiters: list[asyncio.Future], d: Worker, dec: Decision, loads: list[int],
               shadow: Optional[dict] = None) -> None:
        """One decision into the log (:meth:`DecisionLog.record`) against the live pool."""
        self.decisions.record(rids, rooms, label, waiters, d, dec, loads, self.pool.decodes, shadow)

    # ------------------------------------------------------------ the shell's hooks
    def adopt(self, art: Any) -> None:
        if self.online is not None:
            self.online.adopt(art)

    def servers_changed(self, added: bool) -> None:
        """The shadow policy is rebuilt at its next use, an online router refits
        (K = decode servers again; the others' regions kept)."""
        if self.shadow is not None:
            self.shadow.policy = None
        if self.online is not None:
            self.online.maybe_fit()

    def flow_status(self) -> dict:
        return {"signature_timeout": self.wait_limit.value,
                "signature_port": self.intake.port, "signature_streams": len(self.intake.streams),
                "signature_intake": self.intake.describe(),
                "return_address": self.runtime.return_address,
                "shadow_policy": self.shadow.spec.name if self.shadow else None,
                "signature_buffer": {"buffered": len(self.board.buffer),
                                     "buffered_bytes": self.board.buffered_bytes,
                                     "waiting": len(self.board.waiters),
                                     "expired": self.board.expired}}

    def update_gauges(self) -> None:
        m = self.metrics
        m.board.labels("waiting").set(len(self.board.waiters))
        m.board.labels("buffered").set(len(self.board.buffer))
        if self.online is not None:
            self.online.update_gauges()

    def flow_routes(self, r: web.UrlDispatcher) -> None:
        r.add_post("/eldr/signature", self.intake.h_signature)

    async def start_flow(self, host: str) -> None:
        """The signature listener (first: a port in use fails before anything starts)
        and the board sweep."""
        c = self.config
        if c.signature_port is not None:
            await self.intake.start(host, c.signature_port)
            self.runtime.return_address = self.intake.address(c.signature_host_for(host))
        self.runtime.spawn(self._sweep_board())

    async def _sweep_board(self) -> None:
        """Expire unclaimed signature messages even when no traffic comes in."""
        while True:
            await asyncio.sleep(min(1.0, max(self.board.ttl / 4, 0.05)))
            self.board.sweep()

    async def stop_flow(self) -> None:
        await self.intake.close()
        if self.early is not None:
            self.early.close()
        if self.online is not None:
            self.online.close()
