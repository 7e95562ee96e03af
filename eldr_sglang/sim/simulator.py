"""Discrete-event SIMULATOR of xPyD (x prefill, y decode servers) serving.

Every number it produces is simulated. Per request:

1. arrival (Poisson, or gamma inter-arrival times with a given coefficient of
   variation for bursty traffic) at ``rate`` req/s for ``warmup_s + measure_s``;
2. prefill on the prefill server that frees up first (FIFO, one request at a
   time): ``prefill_fixed_s + prefill_s_per_token * prompt * (1 - cached)``, where
   ``cached`` is the prefix-cached share of the prompt;
3. first token at prefill end + ``kv_transfer_s`` (+ ``signature_wait_s`` with late
   binding: the prefill server holds the KV until the decode server is chosen;
   ``binding="early"`` chooses at arrival without a signature, as sglang-router
   does, so the transfer starts as the prefill ends); the decode server is chosen
   then (late binding) by an unchanged :mod:`eldr_sglang.core.policies` object,
   given the in-flight request count per decode server and a
   :class:`~eldr_sglang.core.policies.RouteRequest` with the request's
   signature and label;
4. decode with continuous batching: a request joins the running batch at a step
   boundary when the batch has fewer than ``max_batch`` sequences and its
   ``prompt + output`` tokens fit the KV capacity; every step produces one token
   for every running sequence and lasts :func:`~.cost_model.step_time` of the
   batch's size, its KV tokens and its distinct experts per layer (expected union,
   see :mod:`.workload`; or, where the workload carries recorded per-step expert
   sets, the true union of the running requests' current steps), mapped onto the target model: the trace model's
   union fraction per layer times the target's expert count, the trace layers'
   mean standing for every MoE layer of the target. With expert parallelism the
   trace experts are split contiguously into ``ep_size`` groups (or by
   ``placement``) and each layer waits for its busiest group.

Per-server state keeps ``sum_r log(1 - p_r)`` over running requests ([L, E],
updated on join/leave), so one step costs O(L E) whatever the batch size, and
servers advance through one event heap.

Metrics cover requests that ARRIVE in ``[warmup_s, warmup_s + measure_s)``; the
run continues until every request has finished (each arrival finishes once).
TPOT = (finish - first token) / (output tokens - 1), decode queueing included.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import numpy as np

from ..core.policies import Policy, RouteRequest
from ..core.step_sets import used_experts
from .cost_model import CostParams, get_params, step_time
from .workload import SimWorkload

__all__ = ["SimConfig", "SimResult", "simulate", "arrival_times"]

_ARRIVAL, _PREFILL_DONE, _STEP_DONE, _REPORT = 0, 1, 2, 3


@dataclass(frozen=True)
class SimConfig:
    """One simulated run (times in seconds)."""

    num_prefill: int = 8
    num_decode: int = 16
    rate: float = 60.0  # requests per second
    warmup_s: float = 30.0
    measure_s: float = 120.0
    arrival: str = "poisson"  # "poisson" | "gamma"
    burst_cv: float = 2.0  # gamma: coefficient of variation of inter-arrival times
    cost: str = "qwen3-30b-a3b-mi300x"  # cost_model.PARAM_SETS key
    max_batch: int = 256
    kv_capacity_tokens: int = 1_000_000
    prefill_fixed_s: float = 0.005
    prefill_s_per_token: float = 4e-5
    prefix_cached_fraction: float = 0.0  # share of each prompt served from the prefix cache
    kv_transfer_s: float = 0.002
    # "late": the decode server is chosen after the prefill, with its signature (ELDR's
    # flow: the prefill server holds the KV meanwhile); "early": chosen at arrival, with
    # no signature (sglang-router's flow: the transfer starts as the prefill ends)
    binding: str = "late"
    signature_wait_s: float = 0.0  # late binding: prefill end -> decode chosen (publish + router)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("num_prefill and num_decode must be >= 1")
        if not self.rate > 0 or self.warmup_s < 0 or not self.measure_s > 0:
            raise ValueError("rate and measure_s must be > 0, warmup_s >= 0")
        if self.arrival not in ("poisson", "gamma"):
            raise ValueError(f"arrival must be 'poisson' or 'gamma', got {self.arrival!r}")
        if not 0.0 <= self.prefix_cached_fraction <= 1.0:
            raise ValueError("prefix_cached_fraction must be in [0, 1]")
        if self.binding not in ("late", "early"):
            raise ValueError(f"binding must be 'late' or 'early', got {self.binding!r}")
        if not self.signature_wait_s >= 0:
            raise ValueError("signature_wait_s must be >= 0")
        if self.max_batch < 1 or self.kv_capacity_tokens < 1:
            raise ValueError("max_batch and kv_capacity_tokens must be >= 1")


@dataclass
class SimResult:
    """Per-request records and summary figures of one SIMULATED run."""

    config: SimConfig
    policy: str
    arrival: np.ndarray  # [n] arrival times
    first_token: np.ndarray  # [n]
    finish: np.ndarray  # [n]
    output_tokens: np.ndarray  # [n]
    server: np.ndarray  # [n] decode server index
    finished_count: np.ndarray  # [n] times each request finished (1 when conserved)
    summary: dict = field(default_factory=dict)

    @property
    def measured(self) -> np.ndarray:
        c = self.config
        return (self.arrival >= c.warmup_s) & (self.arrival < c.warmup_s + c.measure_s)

    @property
    def ttft(self) -> np.ndarray:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> np.ndarray:
        return (self.finish - self.first_token) / np.maximum(self.output_tokens - 1, 1)


def arrival_times(config: SimConfig, rng: np.random.Generator) -> np.ndarray:
    """Arrival times in ``[0, warmup_s + measure_s)`` (Poisson or gamma renewal process)."""
    horizon = config.warmup_s + config.measure_s
    n_draw = int(config.rate * horizon * 1.2 + 50)
    mean = 1.0 / config.rate
    times = np.empty(0)
    while times.size == 0 or times[-1] < horizon:
        if config.arrival == "poisson":
            gaps = rng.exponential(mean, n_draw)
        else:
            shape = 1.0 / config.burst_cv ** 2
            gaps = rng.gamma(shape, mean / shape, n_draw)
        start = times[-1] if times.size else 0.0
        times = np.concatenate([times, start + np.cumsum(gaps)])
    return times[times < horizon]


class _Server:
    """Decode server state: running batch as expert log-sums, FIFO waiting queue."""

    __slots__ = ("logsum", "running", "waiting", "finishing", "steps", "ctx", "kv", "busy", "joined")

    def __init__(self, shape: tuple[int, int]) -> None:
        self.logsum = np.zeros(shape)
        self.joined: dict[int, int] = {}  # replay: running request -> server step it joined at
        self.running = 0
        self.waiting: deque[int] = deque()
        self.finishing: list[tuple[int, int]] = []  # (server step at which it ends, request)
        self.steps = 0
        self.ctx = 0  # KV tokens of the running sequences
        self.kv = 0  # KV tokens reserved (prompt + output of running sequences)
        self.busy = False


def simulate(workload: SimWorkload, policy: Policy | Sequence[Policy], config: SimConfig,
             signatures: Optional[np.ndarray] = None, cost: Optional[CostParams] = None,
             placement: Optional[np.ndarray] = None,
             activations: Optional[np.ndarray] = None, counts: Optional[np.ndarray] = None,
             rows=None, engine_report_s: Optional[float] = None, fit_law_s: Optional[float] = None,
             sample_noise: float = 0.1) -> SimResult:
    """Run one SIMULATED experiment; ``signatures`` [N, D] (rows of ``workload``) feed the policy,
    ``activations`` [N, D'] (per-step expert probabilities from prefill counts) feed policies
    that price a server's live batch; ``counts`` [N, n_sel, E] (raw prefill counts) feed
    policies that learn online. The policy is told of every dispatch and finish
    (``admit`` / ``release``), as the router tells it. ``rows(arrival_times, rng) -> [n]``
    picks which workload row each arrival replays (default: uniform; a traffic mix that
    changes over time passes its own).

    ``cost`` overrides ``config.cost``; ``placement`` ([E] or [L, E], trace-expert ->
    EP group) is used when the cost model has ``ep_size > 1``.

    Router replicas: ``policy`` may be a list, one policy object per replica; each arrival
    goes to a replica drawn uniformly (its own random stream, so the arrivals and their
    rows stay those of a one-router run), which alone admits and releases it. Every
    replica sees the servers' true in-flight counts (the shared load poll). With
    ``engine_report_s``, every that many seconds each replica whose policy prices live
    batches (``observe_engine``) is told each server's true batch: the sum of
    ``log(1 - activation)`` over every request bound to it, whichever replica sent it
    (the engines' ``/eldr/batch`` through the load poll).

    Step laws fitted online: with ``fit_law_s`` (and ``engine_report_s``), every decode
    step also gives a sample (batch size, distinct experts summed over the model's MoE
    layers, KV tokens, its time times a log-normal noise of sd ``sample_noise``), and
    every ``fit_law_s`` seconds each server's law is fitted from its last samples
    (:func:`~eldr_sglang.core.step_law.fit_step_law`, the router's fit) and handed to
    every replica's policy (``set_step_law``): the policy is not told the simulator's law.
    """
    replicas = list(policy) if isinstance(policy, (list, tuple)) else [policy]
    policy = replicas[0]
    params = cost or get_params(config.cost)
    rng = np.random.default_rng(config.seed)
    arrivals = arrival_times(config, rng)
    n = arrivals.size
    pick = (rng.integers(0, len(workload), n) if rows is None  # which trace request each arrival replays
            else np.asarray(rows(arrivals, rng), dtype=np.int64))
    prompt = workload.prompt_tokens[pick]
    output = workload.output_tokens[pick]
    L, E = workload.num_layers, workload.num_experts
    ep = params.ep_size
    scale = params.num_experts / E  # trace experts -> target experts (same fraction)
    if ep > 1:
        place = _group_matrix(placement, L, E, ep)  # [L, E, G] one-hot
        group_size = place.sum(axis=1)  # [L, G]
    wants_sig = signatures is not None and getattr(policy, "needs_signature", False)
    wants_act = activations is not None and getattr(policy, "uses_activation", False)
    wants_counts = counts is not None and getattr(policy, "uses_counts", False)
    tokens: list = [None] * n  # the policy's admit() tokens, released at finish
    owner = (np.random.default_rng([config.seed, 0x5EED]).integers(0, len(replicas), n) if len(replicas) > 1
             else np.zeros(n, dtype=np.int64))  # the replica each arrival reaches
    reporting = engine_report_s is not None and activations is not None
    fitting = reporting and fit_law_s is not None
    step_samples = [deque(maxlen=1024) for _ in range(config.num_decode)] if fitting else None
    noise_rng = np.random.default_rng([config.seed, 0x1A3])
    last_fit = 0.0
    batch_log = None  # [num_decode, D'] true batch: sum of log(1 - activation) of the bound requests
    if reporting:
        from eldr_sglang.core.policies.state_aware import unused_log

        batch_log = np.zeros((config.num_decode, activations.shape[1]))
    replay = workload.step_experts
    replay_len = replay.shape[1] if replay is not None else 0
    w0, w1 = config.warmup_s, config.warmup_s + config.measure_s

    # prefill: the server that frees up first, FIFO (computed in arrival order)
    prefill_t = config.prefill_fixed_s + config.prefill_s_per_token * prompt * (1.0 - config.prefix_cached_fraction)
    free_at = [0.0] * config.num_prefill
    events: list[tuple[float, int, int, int]] = []
    early = config.binding == "early"
    hold = config.kv_transfer_s + (0.0 if early else config.signature_wait_s)  # prefill KV held for transfer
    for r in range(n):
        p = min(range(config.num_prefill), key=free_at.__getitem__)
        end = max(arrivals[r], free_at[p]) + prefill_t[r]
        free_at[p] = end
        events.append((end + hold, r, _PREFILL_DONE, r))
        if early:
            events.append((arrivals[r], r, _ARRIVAL, r))
    if reporting:
        t = engine_report_s
        while n and t < float(arrivals[-1]) + 60.0:  # binds end with the last prefill
            events.append((t, -1, _REPORT, 0))
            t += engine_report_s
    heapq.heapify(events)
    seq = n

    servers = [_Server((L, E)) for _ in range(config.num_decode)]
    loads = [0] * config.num_decode
    first_token = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    server_of = np.full(n, -1, dtype=np.int64)
    finished_count = np.zeros(n, dtype=np.int64)
    load_sum = np.zeros(config.num_decode)
    load_samples = 0
    step_count = batch_sum = token_count = 0
    unique_sum = 0.0

    def start_step(s: int, sv: _Server, now: float) -> None:
        nonlocal seq, step_count, batch_sum, unique_sum
        if replay is None:
            free = np.exp(sv.logsum)  # prod_r (1 - p_re)
        else:  # the true union of every running request's current recorded step
            members = np.fromiter(sv.joined, dtype=np.int64, count=len(sv.joined))
            at = (sv.steps - np.fromiter(sv.joined.values(), dtype=np.int64, count=len(sv.joined))) % replay_len
            free = 1.0 - used_experts(replay[pick[members], at], E)
        if ep > 1:
            per_gpu = (group_size - np.einsum("le,leg->lg", free, place)) * scale  # [L, G]
            unique = per_gpu
            layer_unique = per_gpu.sum(axis=1)
        else:
            unique = layer_unique = (E - free.sum(axis=1)) * scale  # [L]
        dt = step_time(params, sv.running, sv.ctx, unique)
        if step_samples is not None:  # what the engine reports: distinct experts over all its MoE layers
            step_samples[s].append({"batch_size": sv.running, "kv_tokens": sv.ctx,
                                    "unique_experts": float(np.mean(layer_unique)) * params.num_moe_layers,
                                    "seconds": dt * float(np.exp(sample_noise * noise_rng.standard_normal()))})
        if w0 <= now < w1:
            step_count += 1
            batch_sum += sv.running
            unique_sum += float(layer_unique.mean())
        sv.busy = True
        seq += 1
        heapq.heappush(events, (now + dt, seq, _STEP_DONE, s))

    def admit(sv: _Server) -> None:
        while sv.waiting and sv.running < config.max_batch:
            r = sv.waiting[0]
            need = int(prompt[r] + output[r])
            if sv.running and sv.kv + need > config.kv_capacity_tokens:
                break
            sv.waiting.popleft()
            sv.running += 1
            sv.kv += need
            sv.ctx += int(prompt[r]) + 1
            sv.logsum += workload.log1mp[pick[r]]
            sv.joined[r] = sv.steps
            heapq.heappush(sv.finishing, (sv.steps + int(output[r]) - 1, r))

    def bind(r: int, req: RouteRequest) -> None:
        nonlocal load_sum, load_samples
        pol = replicas[owner[r]]
        s = pol.choose(req, loads)
        tokens[r] = pol.admit(s, req)
        if batch_log is not None:
            batch_log[s] += unused_log(np.asarray(activations[pick[r]], dtype=np.float32))
        if w0 <= arrivals[r] < w1:
            load_sum += loads
            load_samples += 1
        server_of[r] = s
        loads[s] += 1

    while events:
        now, _, kind, x = heapq.heappop(events)
        if kind == _REPORT:
            if fitting and now - last_fit >= fit_law_s:
                last_fit = now
                fit_laws(replicas, step_samples, params.num_moe_layers * scale / activations.shape[1] * E)
            for pol in replicas:
                observe = getattr(pol, "observe_engine", None)
                if observe is not None:
                    for k in range(config.num_decode):
                        observe(k, batch_log[k].copy())
            continue
        if kind == _ARRIVAL:  # early binding: chosen now, without a signature
            bind(x, RouteRequest(label=str(workload.labels[pick[x]])))
        elif kind == _PREFILL_DONE:
            r = x
            first_token[r] = now
            if not early:
                sig = signatures[pick[r]] if wants_sig else None
                label = str(workload.labels[pick[r]])
                bind(r, RouteRequest(signature=sig, label=label,
                                     activation=activations[pick[r]] if wants_act else None,
                                     counts=counts[pick[r]] if wants_counts else None))
            s = int(server_of[r])
            sv = servers[s]
            sv.waiting.append(r)
            if not sv.busy:
                admit(sv)
                start_step(s, sv, now)
        else:
            s = x
            sv = servers[s]
            sv.steps += 1
            sv.ctx += sv.running
            if w0 <= now < w1:
                token_count += sv.running
            while sv.finishing and sv.finishing[0][0] <= sv.steps:
                _, r = heapq.heappop(sv.finishing)
                finish[r] = now
                finished_count[r] += 1
                sv.running -= 1
                sv.kv -= int(prompt[r] + output[r])
                sv.ctx -= int(prompt[r] + output[r])
                sv.logsum -= workload.log1mp[pick[r]]
                del sv.joined[r]
                loads[s] -= 1
                replicas[owner[r]].release(tokens[r])
                tokens[r] = None
                if batch_log is not None:
                    batch_log[s] -= unused_log(np.asarray(activations[pick[r]], dtype=np.float32))
                    if loads[s] == 0:
                        batch_log[s] = 0.0  # drop accumulated rounding
            if sv.running == 0:
                sv.logsum[:] = 0.0  # drop accumulated rounding
            admit(sv)
            if sv.running:
                start_step(s, sv, now)
            else:
                sv.busy = False

    result = SimResult(config, policy.name, arrivals, first_token, finish, output, server_of, finished_count)
    result.summary = _summarise(result, load_sum / max(load_samples, 1), step_count, batch_sum, unique_sum,
                                token_count, params)
    m = result.measured
    # prompt tokens whose KV a prefill server holds until the decode server has pulled it, on average
    result.summary["prefill_kv_held_tokens"] = float((prompt[m] * hold).sum() / config.measure_s)
    result.summary["binding"] = config.binding
    return result


def fit_laws(replicas: Sequence[Policy], samples: Sequence, expert_factor: float) -> None:
    """The servers' step law, handed to every replica that prices with laws: each server's
    own fit where it differs from the pool's (:func:`~eldr_sglang.core.step_law.pooled_laws`)."""
    from eldr_sglang.core.step_law import as_step_cost, pooled_laws

    for k, (law, buf) in enumerate(zip(pooled_laws([list(b) for b in samples]), samples)):
        if law is None:
            continue
        for pol in replicas:
            setter = getattr(pol, "set_step_law", None)
            if setter is not None:
                setter(k, as_step_cost(law, expert_factor, buf, pol.cost))


def _group_matrix(placement: Optional[np.ndarray], L: int, E: int, groups: int) -> np.ndarray:
    """[L, E, G] one-hot of each trace expert's EP group."""
    if placement is None:
        if E % groups:
            raise ValueError(f"{E} trace experts cannot be split into {groups} EP groups")
        placement = np.arange(E) // (E // groups)
    place = np.broadcast_to(np.asarray(placement, dtype=np.int64), (L, E))
    if place.min() < 0 or place.max() >= groups:
        raise ValueError(f"placement must map experts to groups 0..{groups - 1}")
    return np.eye(groups)[place]


def _summarise(res: SimResult, mean_load: np.ndarray, steps: int, batch_sum: int, unique_sum: float,
               tokens: int, params: CostParams) -> dict:
    m = res.measured
    tpot, ttft = res.tpot[m], res.ttft[m]
    pct = lambda a, q: float(np.percentile(a, q)) if a.size else float("nan")  # noqa: E731
    c = res.config
    return {
        "simulated": True,
        "policy": res.policy,
        "cost_params": params.name,
        "config": asdict(c),
        "requests": int(res.arrival.size),
        "measured_requests": int(m.sum()),
        "conserved": bool((res.finished_count == 1).all()),
        "tpot_median_ms": 1e3 * pct(tpot, 50),
        "tpot_p99_ms": 1e3 * pct(tpot, 99),
        "tpot_mean_ms": 1e3 * float(tpot.mean()) if tpot.size else float("nan"),
        "ttft_median_ms": 1e3 * pct(ttft, 50),
        "ttft_p99_ms": 1e3 * pct(ttft, 99),
        "unique_experts_per_step": unique_sum / max(steps, 1),
        "mean_batch": batch_sum / max(steps, 1),
        "steps": int(steps),
        "load_mean": float(mean_load.mean()),
        "load_cv": float(mean_load.std() / mean_load.mean()) if mean_load.mean() > 0 else 0.0,
        "load_max_over_mean": float(mean_load.max() / mean_load.mean()) if mean_load.mean() > 0 else 0.0,
        "throughput_tokens_s": tokens / c.measure_s,
        "throughput_req_s": float(((res.finish >= c.warmup_s) & (res.finish < c.warmup_s + c.measure_s)).sum()
                                  / c.measure_s),
    }
