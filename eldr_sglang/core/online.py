"""Online calibration: the artifact's lifecycle inside a running router (or the simulator).

Pure numeric (numpy, scipy, scikit-learn): no clock, thread or I/O. The router's
controller (:mod:`eldr_sglang.router.state.online`) feeds it signature messages and runs
:func:`run_fit` off its event loop; the simulator runs the same objects inline.

Lifecycle of an :class:`OnlineCalibrator`:

1. **warming**: no artifact. The router routes by load while the raw counts of the
   published layers collect in a sliding :class:`SignatureWindow`.
2. **first fit** once ``min_signatures`` are held: IDF + balanced K-means with
   K = the number of decode servers (:func:`run_fit`), then routing by signature.
3. **fitted**: every signature also feeds a :class:`DriftMonitor`. A refit is due on
   ``drift`` (the recent best-centroid similarities or region shares moved away from
   the fit's), ``periodic`` (``refit_every`` signatures since the last fit),
   ``membership`` (K differs from the number of decode servers) or ``manual``.
   A drift fit uses only the last ``drift_window`` signatures (the traffic that
   tripped it), and a ``settle`` fit follows ``min_signatures`` later, on traffic
   entirely after the drift.

A refit warm-starts from the current centroids (each server's own centroid is its
starting point; a new server gets a k-means++ style seed), then matches the new
centroids to servers with a min-cost assignment (``scipy.optimize.linear_sum_assignment``)
so that as few regions as possible change owner. ``churn`` is the share of the
window's signatures whose server changed. Layer selection needs decode traces and
stays an offline step (``python -m eldr_sglang.calibrate``): online fits use the
layers the engines publish. scipy and scikit-learn are imported where a fit or a drift
statistic needs them, so a router that never fits online does not load them.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Optional, Sequence

import numpy as np

from .artifact import DEFAULT_TAU, CalibrationArtifact, creation_info
from .signature import COUNT_VARIANTS, SignatureBuilder, l2_normalize
from .traces import ModelSpec

REASONS = ("initial", "periodic", "drift", "settle", "membership", "manual")
ONLINE_TOOL = "eldr_sglang.router (online)"
SLACK = 0.1  # membership refits: regions may exceed N / K by this share (fewer forced moves)


@dataclass(frozen=True)
class OnlineSettings:
    """When to fit and refit (counts are signatures, i.e. prefilled requests)."""

    min_signatures: int = 2000  # first fit; also when (and on how many) a settle fit follows a drift fit
    window: int = 20000  # signatures kept for fits (most recent)
    refit_every: int = 0  # periodic refit after this many signatures (0: off)
    drift_window: int = 512  # recent signatures compared with the fit
    drift_ks: float = 0.2  # refit above this KS distance of best-centroid similarity
    drift_shift: float = 0.2  # refit above this total-variation distance of region shares
    variant: str = "idf"
    tau: float = DEFAULT_TAU
    max_iter: int = 30
    n_init: int = 2  # k-means++ restarts of a cold fit (a warm start runs once)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("min_signatures", "window", "drift_window", "max_iter", "n_init"):
            if not int(getattr(self, name)) >= 1:
                raise ValueError(f"online {name}: expected an integer >= 1, got {getattr(self, name)!r}")
        if self.refit_every < 0:
            raise ValueError(f"online refit_every: expected >= 0, got {self.refit_every!r}")
        if self.window < self.min_signatures:
            raise ValueError(f"online window ({self.window}) must hold at least min_signatures "
                             f"({self.min_signatures})")
        for name in ("drift_ks", "drift_shift"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"online {name}: expected a number in (0, 1], got {getattr(self, name)!r}")
        if self.variant not in COUNT_VARIANTS:
            raise ValueError(f"online variant: {self.variant!r} is not one of {COUNT_VARIANTS}")
        from eldr_sglang.core.policies.eldr import EldrParams  # tau's bounds: where eldr declares it

        try:
            EldrParams(float(self.tau))
        except (TypeError, ValueError) as e:
            raise ValueError(f"online {e}") from None

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


class SignatureWindow:
    """The most recent ``capacity`` raw count arrays [n_sel, E] of one layer set (a ring).

    A message with other layers or another shape starts the window again (the
    engines were reconfigured); :attr:`resets` counts that."""

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self.data: Optional[np.ndarray] = None
        self.layers: Optional[list[int]] = None
        self.seen = 0  # signatures added since the last reset
        self.resets = 0

    def __len__(self) -> int:
        return min(self.seen, self.capacity)

    def add(self, counts: np.ndarray, layers: Sequence[int]) -> bool:
        """Add one request's counts; True if this started the window again."""
        counts = np.asarray(counts)
        layers = [int(x) for x in layers]
        reset = self.data is None or layers != self.layers or counts.shape != self.data.shape[1:]
        if reset:
            self.resets += self.data is not None
            self.data = np.zeros((self.capacity, *counts.shape), dtype=np.float32)
            self.layers, self.seen = layers, 0
        self.data[self.seen % self.capacity] = counts
        self.seen += 1
        return reset

    def recent(self, n: Optional[int] = None) -> np.ndarray:
        """A copy of the ``n`` most recent (default all) counts, oldest first."""
        size = len(self)
        n = size if n is None else min(int(n), size)
        if self.data is None or n == 0:
            return np.zeros((0, 0, 0), dtype=np.float32)
        end = self.seen % self.capacity if self.seen >= self.capacity else self.seen
        idx = (np.arange(end - n, end) % self.capacity) if self.seen >= self.capacity else np.arange(end - n, end)
        return self.data[idx].copy()


@dataclass
class DriftReference:
    """What a fit looked like: best-centroid similarities (a sorted sample) and region shares."""

    best_similarity: np.ndarray  # sorted sample
    shares: np.ndarray  # [K] share of signatures nearest each centroid (unconstrained)
    band_mean: float  # mean number of centroids within tau of the best

    @classmethod
    def of(cls, centroids: np.ndarray, signatures: np.ndarray, tau: float, sample: int = 4096,
           seed: int = 0) -> "DriftReference":
        if len(signatures) > sample:
            signatures = signatures[np.random.default_rng(seed).choice(len(signatures), sample, replace=False)]
        sims = signatures @ centroids.T
        best = sims.max(axis=1)
        shares = np.bincount(sims.argmax(axis=1), minlength=centroids.shape[0]) / max(len(sims), 1)
        band = (sims >= best[:, None] - tau - 1e-9).sum(axis=1)
        return cls(np.sort(best), shares, float(band.mean()))


class DriftMonitor:
    """Recent signatures against a :class:`DriftReference`.

    ``similarity_ks``: two-sample Kolmogorov-Smirnov distance between the recent and
    the reference best-centroid similarities (traffic the centroids no longer fit);
    ``owner_shift``: total-variation distance between the recent and the reference
    region shares (traffic moving between regions, so between servers). Statistics
    are computed once ``window`` signatures were seen since the fit."""

    def __init__(self, centroids: np.ndarray, reference: DriftReference, window: int, tau: float) -> None:
        self.centroids = np.asarray(centroids, dtype=np.float32)
        self.reference, self.window, self.tau = reference, int(window), float(tau)
        self.best: deque[float] = deque(maxlen=self.window)
        self.owner: deque[int] = deque(maxlen=self.window)
        self.band: deque[int] = deque(maxlen=self.window)
        self._stats: Optional[dict] = None
        self._since = 0

    def observe(self, signature: np.ndarray) -> None:
        sims = self.centroids @ signature
        j = int(sims.argmax())
        self.best.append(float(sims[j]))
        self.owner.append(j)
        self.band.append(int((sims >= sims[j] - self.tau - 1e-9).sum()))
        self._since += 1

    @property
    def ready(self) -> bool:
        return len(self.best) >= self.window

    def statistics(self) -> Optional[dict]:
        """``{"similarity_ks", "owner_shift", "band_mean", "reference_band_mean", ...}`` or
        None before ``window`` signatures; recomputed every ``window // 8`` signatures."""
        from scipy.stats import ks_2samp  # here: a router that never fits online does not load scipy

        if not self.ready:
            return None
        if self._stats is None or self._since >= max(1, self.window // 8):
            self._since = 0
            best = np.fromiter(self.best, float, len(self.best))
            shares = np.bincount(np.fromiter(self.owner, int, len(self.owner)),
                                 minlength=len(self.reference.shares)) / len(self.owner)
            self._stats = {
                "similarity_ks": float(ks_2samp(best, self.reference.best_similarity).statistic),
                "owner_shift": float(0.5 * np.abs(shares - self.reference.shares).sum()),
                "best_similarity_mean": float(best.mean()),
                "reference_best_similarity_mean": float(self.reference.best_similarity.mean()),
                "band_mean": float(np.mean(self.band)),
                "reference_band_mean": self.reference.band_mean,
            }
        return self._stats

    def drifted(self, ks: float, shift: float) -> bool:
        s = self.statistics()
        return s is not None and (s["similarity_ks"] > ks or s["owner_shift"] > shift)


@dataclass
class FitJob:
    """Everything one fit needs (picklable: it may run in another process)."""

    counts: np.ndarray  # [N, n_sel, E] raw counts, oldest first
    layers: list[int]
    model: ModelSpec
    num_servers: int
    reason: str
    settings: OnlineSettings
    previous: Optional[CalibrationArtifact] = None
    owners: Optional[list[list[int]]] = None  # per current server: previous centroids it owns
    generation: int = 1


@dataclass
class FitResult:
    artifact: CalibrationArtifact
    reference: DriftReference
    churn: Optional[float]  # share of the fit's signatures whose server changed
    seconds: float
    reason: str
    n_signatures: int


def warm_start(previous: np.ndarray, owners: Sequence[Sequence[int]], X: np.ndarray, k: int,
               seed: int = 0) -> np.ndarray:
    """[k, D] starting centroids in server order: each server's first own previous
    centroid (one not taken by an earlier server); a server that only shares centroids
    starts at a member of their region (it splits it); else a D^2-sampled point of
    ``X`` (far from the centroids chosen so far)."""
    rng = np.random.default_rng(seed)
    rows: list[Optional[np.ndarray]] = []
    taken: set[int] = set()
    for s in range(k):
        mine = [c for c in (owners[s] if s < len(owners) else []) if c not in taken and c < len(previous)]
        if mine:
            taken.add(mine[0])
            rows.append(previous[mine[0]])
        else:
            rows.append(None)
    chosen = [r for r in rows if r is not None]
    labels = (X @ previous.T).argmax(axis=1) if len(previous) else None
    for s in range(k):
        if rows[s] is None:
            shared = [c for c in (owners[s] if s < len(owners) else []) if c < len(previous)]
            region = np.flatnonzero(np.isin(labels, shared)) if shared and labels is not None else []
            if len(region) > 1:  # it shares a region: split it (a member as its seed)
                rows[s] = X[rng.choice(region)]
                chosen.append(rows[s])
                continue
            if chosen:
                d2 = np.maximum(1.0 - (X @ np.asarray(chosen).T).max(axis=1), 0.0) ** 2
                p = d2 / d2.sum() if d2.sum() > 0 else None
            else:
                p = None
            rows[s] = X[rng.choice(len(X), p=p)]
            chosen.append(rows[s])
    return l2_normalize(np.asarray(rows, dtype=np.float32))


def match_to_servers(previous: np.ndarray, owners: Sequence[Sequence[int]], new: np.ndarray) -> np.ndarray:
    """Order of ``new`` centroids, one per server, that keeps regions with their owners:
    min-cost assignment of new centroid j to server s at cost ``-max_{c owned by s}
    <previous_c, new_j>`` (a server owning nothing costs 0 everywhere)."""
    k = new.shape[0]
    cost = np.zeros((k, k))
    for s in range(min(k, len(owners))):
        own = [c for c in owners[s] if c < len(previous)]
        if own:
            cost[s] = -(previous[own] @ new.T).max(axis=0)
    from scipy.optimize import linear_sum_assignment

    _, cols = linear_sum_assignment(cost)
    return cols


def owner_churn(previous: CalibrationArtifact, owners: Sequence[Sequence[int]], counts: np.ndarray,
                new: CalibrationArtifact) -> float:
    """Share of ``counts`` (requests) whose decode server differs between ``previous``
    (with ``owners``: centroid -> servers) and ``new`` (centroid i = server i)."""
    if previous.layers != new.layers or previous.idf.shape != new.idf.shape or not len(counts):
        return 1.0
    old_best = previous.similarities(previous.signature(counts)).argmax(axis=1)
    new_server = new.similarities(new.signature(counts)).argmax(axis=1)
    holders: list[set[int]] = [set() for _ in range(previous.num_clusters)]
    for s, own in enumerate(owners):
        for c in own:
            if c < len(holders):
                holders[c].add(s)
    same = np.fromiter((int(n) in holders[int(o)] for o, n in zip(old_best, new_server)), bool, len(counts))
    return float(1.0 - same.mean())


def run_fit(job: FitJob) -> FitResult:
    """IDF + balanced K-means on the job's counts (warm-started when possible)."""
    t0 = time.perf_counter()
    st = job.settings
    prev = job.previous
    builder = SignatureBuilder(st.variant).fit(job.counts)
    if (job.reason == "membership" and prev is not None and prev.layers == list(job.layers)
            and prev.variant == st.variant and prev.idf.shape == builder.idf_.shape):
        builder.idf_ = prev.idf.copy()  # same traffic, other pool: only the regions move
    X = builder.transform(job.counts)
    k = min(job.num_servers, len(X))
    if k < 1:
        raise ValueError("an online fit needs at least one signature and one decode server")
    owners = job.owners if job.owners is not None else (
        [[i % prev.num_clusters] for i in range(k)] if prev is not None else None)
    warm = prev is not None and prev.layers == list(job.layers) and prev.dim == X.shape[1]
    init = warm_start(prev.centroids, owners, X, k, st.seed) if warm else "k-means++"
    # a membership change moves regions only as far as one balanced assignment from the
    # warm start needs (measured: full iterations move 15-30% of signature space per
    # one-server step, one iteration 8-18%; benchmark/bench_online.py)
    iters = 1 if warm and job.reason == "membership" else st.max_iter
    from .clustering import BalancedKMeans

    km = BalancedKMeans(k, n_init=st.n_init, max_iter=iters, random_state=st.seed, init=init,
                        slack=SLACK if warm and job.reason == "membership" else 0.0).fit(X)
    centers, labels = km.cluster_centers_, km.labels_
    if warm:
        order = match_to_servers(prev.centroids, owners, centers)
        centers = centers[order]
        labels = np.argsort(order)[labels]
    artifact = CalibrationArtifact(
        model=job.model, variant=st.variant, layers=list(job.layers), idf=builder.selected_idf(),
        centroids=centers, tau=st.tau,
        created=creation_info(len(X), tool=ONLINE_TOOL, mode="online", reason=job.reason,
                              generation=job.generation, warm_start=bool(warm), seed=st.seed),
        extra={"cluster_sizes": np.bincount(labels, minlength=k).tolist(), "inertia": km.inertia_})
    churn = owner_churn(prev, owners, job.counts, artifact) if prev is not None else None
    if churn is not None:
        artifact.created["churn"] = round(churn, 6)
    artifact.created["fit_seconds"] = round(time.perf_counter() - t0, 3)
    return FitResult(artifact, DriftReference.of(artifact.centroids, X, st.tau, seed=st.seed), churn,
                     time.perf_counter() - t0, job.reason, len(X))


@dataclass
class FitRecord:
    """One swap, for status pages."""

    generation: int
    reason: str
    n_signatures: int
    churn: Optional[float]
    seconds: float
    drift: Optional[dict] = None


class OnlineCalibrator:
    """State of the online lifecycle (see the module doc). Not thread-safe: one owner
    calls :meth:`observe`, :meth:`due`, :meth:`job` and :meth:`install`; the fit itself
    (:func:`run_fit`) may run anywhere."""

    def __init__(self, settings: OnlineSettings = OnlineSettings(),
                 artifact: Optional[CalibrationArtifact] = None, model: Optional[ModelSpec] = None) -> None:
        self.settings = settings
        self.window = SignatureWindow(settings.window)
        self.artifact = artifact
        self.model = model or (artifact.model if artifact is not None else None)
        self.monitor: Optional[DriftMonitor] = None
        self._reference_signatures: list[np.ndarray] = []  # a started-from artifact's first signatures
        self.generation = 0
        self.since_fit = 0
        self.manual = False
        self.history: deque[FitRecord] = deque(maxlen=32)
        self.ignored = 0  # signatures whose layers differ from the live artifact's
        self.settling = False  # a drift fit is live: refit once min_signatures more arrived

    @property
    def state(self) -> str:
        return "warming" if self.artifact is None else "fitted"

    def observe(self, counts: np.ndarray, layers: Sequence[int], model: Optional[ModelSpec] = None) -> None:
        """One prefilled request's raw counts of ``layers``."""
        if model is not None and self.model is None:
            self.model = model
        self.window.add(counts, layers)
        self.since_fit += 1
        art = self.artifact
        if art is None:
            return
        if list(layers) != art.layers or np.shape(counts) != art.idf.shape:
            self.ignored += 1
            return
        sig = art.signature(counts)
        if self.monitor is None:  # started from a given artifact: its reference is the first traffic
            self._reference_signatures.append(sig)
            if len(self._reference_signatures) >= 2 * self.settings.drift_window:
                ref = DriftReference.of(art.centroids, np.asarray(self._reference_signatures), art.tau)
                self.monitor = DriftMonitor(art.centroids, ref, self.settings.drift_window, art.tau)
                self._reference_signatures = []
            return
        self.monitor.observe(sig)

    def request(self) -> None:
        """Ask for a refit at the next :meth:`due` (admin API)."""
        self.manual = True

    def due(self, num_servers: int) -> Optional[str]:
        """Why a fit should start now, or None."""
        st, held = self.settings, len(self.window)
        if self.model is None or held < 1:
            return None
        if self.artifact is None:
            return "initial" if held >= min(st.min_signatures, st.window) and held >= num_servers else None
        if held < num_servers:
            return None
        if self.artifact.num_clusters != num_servers:
            return "membership"
        if self.manual:
            return "manual"
        if self.window.layers != self.artifact.layers and held >= st.min_signatures:
            return "drift"  # the engines now publish other layers
        if self.monitor is not None and self.monitor.drifted(st.drift_ks, st.drift_shift):
            return "drift"
        if self.settling and self.since_fit >= st.min_signatures:
            return "settle"
        if st.refit_every and self.since_fit >= st.refit_every:
            return "periodic"
        return None

    def job(self, num_servers: int, reason: str, owners: Optional[list[list[int]]] = None) -> FitJob:
        """The fit to run for ``reason``: a drift fit uses the last ``drift_window``
        signatures, a settle fit the last ``min_signatures``, the others the whole window."""
        if self.model is None or self.window.layers is None:
            raise ValueError("no signature seen yet")
        n = {"drift": self.settings.drift_window, "settle": self.settings.min_signatures}.get(reason)
        layers = self.window.layers
        model = self.model
        if max(layers) >= model.num_layers:
            model = ModelSpec(model.name, max(layers) + 1, model.num_experts, model.top_k)
        self.manual = False
        return FitJob(self.window.recent(n), list(layers), model, num_servers, reason, self.settings,
                      self.artifact, owners, self.generation + 1)

    def install(self, result: FitResult) -> None:
        """The fit's artifact is live from now on."""
        art = result.artifact
        drift = self.monitor.statistics() if self.monitor is not None else None
        self.artifact = art
        self.monitor = DriftMonitor(art.centroids, result.reference, self.settings.drift_window, art.tau)
        self._reference_signatures = []
        self.generation += 1
        self.since_fit = 0
        self.settling = result.reason == "drift"
        self.history.append(FitRecord(self.generation, result.reason, result.n_signatures,
                                      result.churn, round(result.seconds, 3), drift))

    def describe(self) -> dict:
        last = self.history[-1] if self.history else None
        return {
            "state": self.state, "generation": self.generation,
            "signatures_held": len(self.window), "signatures_since_fit": self.since_fit,
            "layers": self.window.layers, "window_resets": self.window.resets,
            "ignored_other_layers": self.ignored,
            "drift": self.monitor.statistics() if self.monitor is not None else None,
            "last_fit": None if last is None else last.__dict__,
            "fits": [r.__dict__ for r in self.history],
            "settings": {f: getattr(self.settings, f) for f in OnlineSettings.names()},
        }


def model_from_message(msg: dict, counts: np.ndarray) -> ModelSpec:
    """The model a signature message describes: its ``model`` field when the engine sent
    one, else what the counts show (experts from their width, top-k from counts per
    prompt token, layers at least the highest published one)."""
    m = msg.get("model")
    if isinstance(m, dict):
        try:
            return ModelSpec.from_dict(m, "signature message field 'model'")
        except (ValueError, TypeError):
            pass
    tokens = max(float(msg.get("prompt_tokens") or 0), 1.0)
    experts = int(np.shape(counts)[-1])
    top_k = min(experts, max(1, int(round(float(np.asarray(counts)[0].sum()) / tokens))))
    return ModelSpec(str(msg.get("model_name") or "unknown"), max(msg["layers"]) + 1, experts, top_k)


__all__ = ["OnlineSettings", "SignatureWindow", "DriftReference", "DriftMonitor", "FitJob", "FitResult",
           "FitRecord", "OnlineCalibrator", "run_fit", "warm_start", "match_to_servers", "owner_churn",
           "model_from_message", "REASONS", "ONLINE_TOOL"]
