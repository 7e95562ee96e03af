"""Online calibration in the SIMULATOR: the router's lifecycle run inline.

:class:`OnlineEldrPolicy` holds the same :class:`~eldr_sglang.core.online.OnlineCalibrator`
and calls the same :func:`~eldr_sglang.core.online.run_fit` as the router's
``--online`` controller, and routes with the same ``eldr`` policy object. One
difference, stated wherever its numbers appear: a fit here is instantaneous in
simulated time (the router runs it in another process and keeps routing with the
previous calibration meanwhile, for the fit's duration: seconds).

:func:`elastic_refits` replays a decode pool growing or shrinking one server at a
time, as the router does on ``POST /eldr/servers``: the policy's centroid ownership
changes at once, then a ``membership`` refit with K = servers follows.
"""

from __future__ import annotations

from typing import Optional, Sequence


from ..core.artifact import CalibrationArtifact
from ..core.online import FitResult, OnlineCalibrator, OnlineSettings, run_fit
from ..core.policies import Policy, RouteRequest, make_policy
from ..core.traces import ModelSpec

__all__ = ["OnlineEldrPolicy", "elastic_refits"]


class OnlineEldrPolicy(Policy):
    """Least loaded while warming, then ELDR on the live online calibration."""

    name = "online"
    uses_counts = True

    def __init__(self, num_servers: int, layers: Sequence[int], model: ModelSpec,
                 settings: OnlineSettings = OnlineSettings(),
                 artifact: Optional[CalibrationArtifact] = None, seed: int = 0) -> None:
        self.n, self.layers, self.seed = num_servers, list(layers), seed
        self.calibrator = OnlineCalibrator(settings, artifact=artifact, model=model)
        self.inner = self._policy(artifact)
        self.fits: list[dict] = []
        self.decisions = 0

    def _policy(self, artifact: Optional[CalibrationArtifact]) -> Policy:
        if artifact is None:
            return make_policy("jsq", self.n, seed=self.seed)
        return make_policy("eldr", self.n, centroids=artifact.centroids, tau=artifact.tau, seed=self.seed)

    def choose(self, request: RouteRequest, loads, allowed=None) -> int:
        cal, counts = self.calibrator, request.counts
        sig = None
        if counts is not None and cal.artifact is not None:
            sig = cal.artifact.signature(counts)
        pick = self.inner.choose(RouteRequest(signature=sig, label=request.label), loads, allowed)
        self.decisions += 1
        if counts is not None:  # the signature arrives; a due fit swaps in for later requests
            cal.observe(counts, self.layers)
            reason = cal.due(self.n)
            if reason is not None:
                self.install(run_fit(cal.job(self.n, reason, self._owners())))
        return pick

    def _owners(self) -> Optional[list[list[int]]]:
        own = getattr(self.inner, "ownership", None)
        return own.as_lists() if own is not None and own.num_servers == self.n else None

    def install(self, result: FitResult) -> None:
        self.calibrator.install(result)
        self.inner = self._policy(result.artifact)
        self.fits.append({"at_decision": self.decisions, "reason": result.reason, "churn": result.churn,
                          "n_signatures": result.n_signatures, "fit_seconds": round(result.seconds, 3)})

    def describe(self) -> dict:
        return {"policy": self.name, "fits": self.fits, **self.calibrator.describe()}


def elastic_refits(calibrator: OnlineCalibrator, start: int, end: int, seed: int = 0) -> list[dict]:
    """Grow or shrink a fitted calibrator's pool from ``start`` to ``end`` servers one at a
    time (the last server leaves first), each step a ``membership`` refit warm-started
    from the ownership the eldr policy had after the change. Returns each step's
    ``{"servers", "churn", "fit_seconds"}``; the calibrator holds the final artifact."""
    if calibrator.artifact is None:
        raise ValueError("elastic_refits needs a fitted calibrator")
    steps = []
    n = start
    while n != end:
        art = calibrator.artifact
        policy = make_policy("eldr", n, centroids=art.centroids, tau=art.tau, seed=seed)
        if end > n:
            policy.add_server()
            n += 1
        else:
            policy.remove_server(n - 1)
            n -= 1
        result = run_fit(calibrator.job(n, "membership", policy.ownership.as_lists()))
        calibrator.install(result)
        steps.append({"servers": n, "churn": result.churn, "fit_seconds": round(result.seconds, 3)})
    return steps
