"""Synthetic traces with planted structure (tests, benchmarks, demos).

Each request has a task and a language label. On an *informative* layer its expert
distribution is ``softmax(popularity + a * task_pref + b * lang_pref + c * own_noise)``
and prefill and decode both draw from it, so prefill predicts decode. On a *noise*
layer prefill and decode use independent per-request noise around the global
popularity (scale ``noise_layer_spread``), so that layer's prefill says nothing about decode overlap. Counts are a
Poisson approximation of top-k routing: ``min(Poisson(tokens * k * p), tokens)``.
Gate sums (optional) are ``tokens * softmax(logits / 3)`` (probability spread over
unchosen experts) and ``tokens * logits``.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from .traces import ModelSpec, TraceSet

TASKS = ("code", "math", "medical", "legal")
TASK_WEIGHTS = (0.30, 0.27, 0.22, 0.21)  # largest / smallest ~ 1.4, as in the paper
LANGUAGES = ("en", "zh", "ru", "fr")
LANGUAGE_WEIGHTS = (0.45, 0.30, 0.13, 0.12)  # en + zh = 75%


class SyntheticTraces(NamedTuple):
    traces: TraceSet
    informative_layers: list[int]


def make_synthetic_traces(
    n_requests: int = 2000,
    num_layers: int = 8,
    num_experts: int = 32,
    top_k: int = 4,
    informative_layers: Sequence[int] | None = None,
    n_informative: int | None = None,
    task_strength: float = 2.0,
    language_strength: float = 1.0,
    request_noise: float = 0.6,
    noise_layer_spread: float = 1.2,
    mean_prompt_tokens: float = 200.0,
    mean_output_tokens: float = 120.0,
    include_gates: bool = True,
    model_name: str = "synthetic-moe",
    seed: int = 0,
    chunk: int = 1024,
) -> SyntheticTraces:
    """Generate ``n_requests`` traces; returns them with the planted informative layers."""
    rng = np.random.default_rng(seed)
    if informative_layers is None:
        n_inf = n_informative if n_informative is not None else max(1, num_layers // 4)
        informative_layers = sorted(rng.choice(num_layers, size=n_inf, replace=False).tolist())
    informative = np.zeros(num_layers, dtype=bool)
    informative[list(informative_layers)] = True

    popularity = rng.normal(0.0, 1.0, (num_layers, num_experts))
    task_pref = rng.normal(0.0, 1.0, (len(TASKS), num_layers, num_experts))
    lang_pref = rng.normal(0.0, 1.0, (len(LANGUAGES), num_layers, num_experts))
    task = rng.choice(len(TASKS), size=n_requests, p=np.array(TASK_WEIGHTS) / sum(TASK_WEIGHTS))
    lang = rng.choice(len(LANGUAGES), size=n_requests, p=np.array(LANGUAGE_WEIGHTS) / sum(LANGUAGE_WEIGHTS))
    prompt = np.clip(rng.lognormal(np.log(mean_prompt_tokens), 0.6, n_requests), 8, 8192).astype(np.int64)
    output = np.clip(rng.lognormal(np.log(mean_output_tokens), 0.6, n_requests), 4, 4096).astype(np.int64)

    shape = (n_requests, num_layers, num_experts)
    prefill = np.empty(shape, dtype=np.int32)
    decode = np.empty(shape, dtype=np.int32)
    gate_prob = np.empty(shape, dtype=np.float32) if include_gates else None
    gate_logit = np.empty(shape, dtype=np.float32) if include_gates else None
    inf_mask = informative[None, :, None]
    for s in range(0, n_requests, chunk):
        sl = slice(s, min(s + chunk, n_requests))
        n = sl.stop - sl.start
        shared = popularity + request_noise * rng.normal(size=(n, num_layers, num_experts))
        structured = shared + task_strength * task_pref[task[sl]] + language_strength * lang_pref[lang[sl]]
        noise_pre = popularity + noise_layer_spread * rng.normal(size=(n, num_layers, num_experts))
        logits_pre = np.where(inf_mask, structured, noise_pre)
        noise_dec = popularity + noise_layer_spread * rng.normal(size=(n, num_layers, num_experts))
        logits_dec = np.where(inf_mask, structured + 0.2 * rng.normal(size=structured.shape), noise_dec)
        prefill[sl] = _route_counts(rng, logits_pre, prompt[sl], top_k)
        decode[sl] = _route_counts(rng, logits_dec, output[sl], top_k)
        if include_gates:
            tokens = prompt[sl, None, None].astype(np.float32)
            gate_prob[sl] = tokens * _softmax(logits_pre / 3.0)
            gate_logit[sl] = tokens * (logits_pre + 0.3 * rng.normal(size=logits_pre.shape))
    traces = TraceSet(
        model=ModelSpec(model_name, num_layers, num_experts, top_k),
        request_ids=np.array([f"syn-{i:06d}" for i in range(n_requests)]),
        prefill_counts=prefill,
        decode_counts=decode,
        prompt_tokens=prompt,
        output_tokens=output,
        labels={"task": np.array(TASKS)[task], "language": np.array(LANGUAGES)[lang]},
        gate_prob_sums=gate_prob,
        gate_logit_sums=gate_logit,
    )
    return SyntheticTraces(traces, sorted(int(l) for l in informative_layers))


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def _route_counts(rng: np.random.Generator, logits: np.ndarray, tokens: np.ndarray, top_k: int) -> np.ndarray:
    """Poisson approximation of per-expert top-k hit counts, capped at the token count."""
    lam = _softmax(logits) * (tokens[:, None, None] * top_k)
    return np.minimum(rng.poisson(lam), tokens[:, None, None]).astype(np.int32)
