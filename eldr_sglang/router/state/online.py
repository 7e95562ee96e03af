"""The router's online calibration (``--online``) and calibration following (``--calibration-watch``).

:class:`OnlineController` feeds every accepted signature message to the core's
:class:`~eldr_sglang.core.online.OnlineCalibrator`, starts a fit when one is due
(initial, drift, periodic, membership, manual), runs it off the event loop (a
one-worker process pool by default: the fit's Python loops must not hold the GIL
the event loop needs), swaps the result in as one :class:`~eldr_sglang.router.state.routing.Routing`
value and writes it to ``--calibration-out``. One fit runs at a time; a fit whose
decode pool changed while it ran is dropped and started again.

:class:`CalibrationWatcher` lets router replicas (other hosts, or ``--workers``
processes) follow the artifact one ``--online`` router writes: it reloads
``--calibration`` whenever the file changes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import time
from typing import Callable, Coroutine, Optional

import numpy as np

from eldr_sglang.core.online import FitResult, OnlineCalibrator, model_from_message, run_fit
from eldr_sglang.router.config import RouterConfig
from eldr_sglang.router.signals.intake import RateLimitedLog
from eldr_sglang.router.metrics import RouterMetrics
from eldr_sglang.router.state.routing import RoutingState

logger = logging.getLogger("eldr_sglang.router")
WINDOW_MAX_BYTES = 2 << 30  # the online window of the shape the first messages vote for
SHAPE_VOTES = 16  # with no artifact: a shape needs a majority of this many first messages


class OnlineController:
    """Fits on the routing state's pool and installs into it; ``spawn`` runs a fit in
    the background, ``log`` rate-limits the refusal warnings."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, state: RoutingState,
                 spawn: Callable[[Coroutine], asyncio.Task], log: RateLimitedLog) -> None:
        self.metrics, self.state, self.spawn, self.log = metrics, state, spawn, log
        self.pool = state.pool
        c = config
        enc = state.routing.encoder
        start = enc.artifact if enc is not None and hasattr(enc.artifact, "checksum") else None
        self.calibrator = OnlineCalibrator(c.online_settings(), artifact=start)
        self.fit_in = c.online_fit_in
        self.out = c.calibration_out
        self.task: Optional[asyncio.Task] = None
        self.executor: Optional[concurrent.futures.Executor] = None
        self.fitted_at: Optional[float] = time.time() if start is not None else None
        self.failures = 0
        self.refused = 0  # messages of another shape than the window's
        # with no artifact, the window's shape is the one a majority of the first
        # messages have (never one message's): they wait here until then
        self.pending: list[dict] = []
        self.votes = max(1, min(SHAPE_VOTES, c.online_min_signatures))
        self.last_error: Optional[str] = None
        m = metrics
        m.calibration_online.set(2 if start is not None else 1)

    # ------------------------------------------------------------ intake side
    def fits(self, msg: dict) -> Optional[str]:
        """Why ``msg`` cannot join the window (None: it can): it must have the live
        artifact's layers and shape, else the window's; before either, a window of its
        shape must stay within ``WINDOW_MAX_BYTES``. A message that does not fit is
        refused and counted, never a reset of the window (one post of another shape
        would undo it)."""
        layers, shape = [int(x) for x in msg["layers"]], tuple(np.shape(msg["counts"]))
        art, window = self.calibrator.artifact, self.calibrator.window
        if art is not None:
            want = (list(art.layers), tuple(np.shape(art.idf)))
        elif window.data is not None:
            want = (window.layers, tuple(window.data.shape[1:]))
        else:
            size = window.capacity * int(np.prod(shape)) * 4
            return None if size <= WINDOW_MAX_BYTES else (
                f"a window of {window.capacity} x {list(shape)} counts would take {size >> 20} MiB")
        if (layers, shape) != want:
            return f"layers {layers} shape {list(shape)}, the window holds {want[0]} {list(want[1])}"
        return None

    def observe(self, msg: dict) -> None:
        """One accepted signature message (called by the intake, on the event loop)."""
        why = self.fits(msg)
        if why is not None:
            self._refuse(why)
            return
        cal = self.calibrator
        if cal.artifact is None and cal.window.data is None:
            self._vote(msg)
            return
        self._feed(msg)
        self.maybe_fit()

    def _refuse(self, why: str) -> None:
        self.refused += 1
        self.metrics.errors.labels("signature_online_mismatch").inc()
        self.log.warn("online_mismatch", "signature message not taken for the online fit: %s", why)

    @staticmethod
    def _shape(msg: dict) -> tuple:
        return tuple(int(x) for x in msg["layers"]), tuple(np.shape(msg["counts"]))

    def _vote(self, msg: dict) -> None:
        """Hold ``msg`` until one shape has a majority of the last ``votes`` messages;
        then that shape's messages open the window and the others are refused. Without
        a majority the oldest held message is refused once ``votes`` are held."""
        self.pending.append(msg)
        shape = self._shape(msg)
        if sum(self._shape(m) == shape for m in self.pending) < self.votes // 2 + 1:
            if len(self.pending) >= self.votes:
                old = self.pending.pop(0)
                layers, counts = self._shape(old)
                self._refuse(f"layers {list(layers)} shape {list(counts)}: no shape has a "
                             f"majority of the first {self.votes} messages yet")
            return
        held, self.pending = self.pending, []
        for m in held:
            if self._shape(m) == shape:
                self._feed(m)
            else:
                layers, counts = self._shape(m)
                self._refuse(f"layers {list(layers)} shape {list(counts)}, the majority of the "
                             f"first messages (the window) holds {list(shape[0])} {list(shape[1])}")
        self.maybe_fit()

    def _feed(self, msg: dict) -> None:
        counts = msg["counts"]
        cal = self.calibrator
        cal.observe(counts, msg["layers"], model_from_message(msg, counts) if cal.model is None else None)

    def request_refit(self) -> None:
        self.calibrator.request()
        self.maybe_fit()

    def maybe_fit(self) -> Optional[str]:
        """Start a fit if one is due and none runs; its reason or None."""
        if self.task is not None and not self.task.done():
            return None
        reason = self.calibrator.due(len(self.pool.decodes))
        if reason is not None:
            self.task = self.spawn(self._fit(reason))
        return reason

    # ------------------------------------------------------------ fitting
    def _executor(self) -> concurrent.futures.Executor:
        if self.executor is None:
            if self.fit_in == "thread":
                self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="eldr-fit")
            else:
                self.executor = concurrent.futures.ProcessPoolExecutor(
                    1, mp_context=multiprocessing.get_context("spawn"))
        return self.executor

    async def _fit(self, reason: str) -> None:
        n = len(self.pool.decodes)
        owners = self._owners(n)
        loop = asyncio.get_running_loop()
        # copying the window (tens of MB) runs off the loop too; a row written meanwhile
        # is one request's counts either way
        job = await loop.run_in_executor(None, self.calibrator.job, n, reason, owners)
        try:
            result: FitResult = await loop.run_in_executor(self._executor(), run_fit, job)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed fit keeps the live calibration
            self.failures += 1
            self.last_error = f"{type(e).__name__}: {e}"
            self.metrics.event("online_fit_failed")
            logger.error("online fit (%s) failed, calibration kept: %s", reason, self.last_error)
            if isinstance(e, concurrent.futures.process.BrokenProcessPool):
                self.executor = None
            return
        if result.artifact.num_clusters != len(self.pool.decodes) or self._owners(n) != owners:
            logger.info("decode pool changed during the online fit; fitting again")
            self.task = None
            self.maybe_fit()
            return
        self.install(result)
        self.task = None
        self.maybe_fit()  # traffic may already call for another

    def _owners(self, n: int) -> Optional[list[list[int]]]:
        own = getattr(self.state.routing.policy, "ownership", None)
        if own is None or own.num_servers != n:
            return None
        return own.as_lists()

    def install(self, result: FitResult) -> None:
        """Swap ``result`` in (one step), persist it, record it."""
        art = result.artifact
        path = None
        if self.out:
            try:
                path = str(art.save(self.out))
            except OSError as e:
                self.metrics.event("online_save_failed")
                logger.error("cannot write --calibration-out %s: %s", self.out, e)
        self.calibrator.install(result)
        self.state.install_artifact(art, path or f"online:{self.calibrator.generation}", origin="online")
        self.fitted_at = time.time()
        m = self.metrics
        m.calibration_refits.labels(result.reason).inc()
        m.calibration_online.set(2)
        if result.churn is not None:
            m.calibration_churn.set(result.churn)
        logger.info("online calibration %d (%s): %d signatures, K=%d, churn=%s, fit %.2fs%s",
                    self.calibrator.generation, result.reason, result.n_signatures,
                    art.num_clusters, "n/a" if result.churn is None else f"{result.churn:.3f}",
                    result.seconds, f", written to {path}" if path else "")

    def adopt(self, artifact) -> None:
        """An artifact loaded by an operator (``POST /eldr/calibration``) becomes the
        starting point of later refits."""
        if hasattr(artifact, "checksum"):
            self.calibrator.artifact = artifact
            self.calibrator.monitor = None
            self.fitted_at = time.time()
            held, self.pending = self.pending, []  # the artifact fixes the shape now
            for m in held:
                if self.fits(m) is None:
                    self._feed(m)

    # ------------------------------------------------------------ observability
    def update_gauges(self) -> None:
        m, cal = self.metrics, self.calibrator
        m.calibration_signatures.set(len(cal.window))
        if self.fitted_at is not None:
            m.calibration_age.set(time.time() - self.fitted_at)
        stats = cal.monitor.statistics() if cal.monitor is not None else None
        for name in ("similarity_ks", "owner_shift"):
            if stats is not None:
                m.calibration_drift.labels(name).set(stats[name])

    def describe(self) -> dict:
        self.update_gauges()
        return {**self.calibrator.describe(), "fitting": self.task is not None and not self.task.done(),
                "fit_in": self.fit_in, "out": self.out, "failures": self.failures,
                "refused": self.refused, "shape_votes_held": len(self.pending),
                "last_error": self.last_error,
                "age_s": None if self.fitted_at is None else round(time.time() - self.fitted_at, 3)}

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
            self.executor = None


class CalibrationWatcher:
    """Reload ``path`` whenever its modification time, size or inode changes (an
    atomic replace within one clock tick, same size, is a new inode)."""

    def __init__(self, reload: Callable[[str], dict], metrics: RouterMetrics, path: str,
                 interval: float) -> None:
        self.reload, self.metrics, self.path, self.interval = reload, metrics, path, interval
        self.seen = self._stamp()
        self.errors = 0

    def _stamp(self) -> Optional[tuple[int, int, int]]:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def check(self) -> bool:
        """Reload if the file changed; True when a new artifact went live."""
        stamp = self._stamp()
        if stamp is None or stamp == self.seen:
            return False
        self.seen = stamp
        try:
            self.reload(self.path)
        except ValueError as e:  # half-written by a non-atomic writer, or bad: keep the live one
            self.errors += 1
            self.metrics.reloads.labels("refused").inc()
            logger.warning("calibration watch: %s not loaded, previous kept: %s", self.path, e)
            return False
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.check()
