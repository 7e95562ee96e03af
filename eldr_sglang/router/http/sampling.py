"""Parallel sampling (``n > 1``, ``best_of``): what the routers pass on and what they
refuse at once with a 400.

SGLang 0.5.23 serves ``n > 1`` by expanding one request in its tokenizer manager
(``TokenizerManager._handle_batch_request``): a prefix warm-up request
(``max_new_tokens = 0``) per prompt, then ``n`` copies of it, each a shallow copy of
the prompt's request, so the warm-up and all ``n`` samples carry the *same*
``bootstrap_room`` (a list of rooms is repeated ``n`` times by
``GenerateReqInput._normalize_bootstrap_params``). A prefill/decode pair binds a room
once: under PD disaggregation the second use fails ("Duplicate bootstrap room") only
after the bootstrap timeout, so the client saw a 60 s hang and a 500. Nothing the
router puts in the body changes that, so the PD router refuses ``n > 1`` (one prompt
or a list) before anything goes upstream. Plain servers (``--mode colocated``) serve
it: the co-located router passes it on, routed by the prompt's predicted signature.

``best_of`` is accepted and ignored by SGLang 0.5.23 (``CompletionRequest.best_of``
is read nowhere): ``best_of > n`` would silently return ``n`` samples instead of the
best ``n`` of ``best_of``, so both routers refuse it; ``best_of < n`` is refused as
OpenAI does. ``best_of`` equal to ``n`` (or to 1) asks for nothing more and passes.
"""

from __future__ import annotations

from typing import Any, Optional

PD_PARALLEL_SAMPLING = (
    "n > 1 (parallel sampling) is not supported with prefill/decode disaggregation: "
    "SGLang 0.5.23 sends the n samples of a prompt (and their prefix warm-up) with one "
    "bootstrap room, which a prefill/decode pair can bind only once, so the request would "
    "hang and fail. Send n requests with n = 1 (the prefill server's prefix cache shares "
    "the prompt){generate}, or use a co-located router (--mode colocated)")


MAX_COUNT = 2 ** 31 - 1


def _count(value: Any, field: str) -> Optional[int]:
    """A plain JSON integer from 1 to :data:`MAX_COUNT`, or None when absent; ValueError
    naming ``field`` for anything else. SGLang's OpenAI protocol reads ``"+2"``, ``"2.0"``,
    ``"2_0"`` as 2, 2, 20 (pydantic's lax mode): the router takes no spelling it might
    read otherwise than SGLang does."""
    if value is None:
        return None
    if type(value) is int and 1 <= value <= MAX_COUNT:
        return value
    raise ValueError(f"'{field}' must be an integer from 1 to {MAX_COUNT}")


def samples(body: dict, endpoint: str) -> int:
    """How many samples per prompt the request asks for (``n``; 1 when absent);
    ValueError naming the field when ``n`` (or ``beam_width``) is not a plain integer.

    OpenAI routes: the top-level ``n``. ``/generate``: ``sampling_params.n`` (a list of
    sampling params: the largest); 1 for a beam search (``beam_width > 1``: SGLang's ``n``
    is then the number of beams returned, one request, no fan-out)."""
    if endpoint != "generate":
        return _count(body.get("n"), "n") or 1
    sp = body.get("sampling_params")
    params = [p for p in (sp if isinstance(sp, list) else [sp]) if isinstance(p, dict)]
    ns = [_count(p.get("n"), "sampling_params.n") or 1 for p in params]
    beams = [_count(p.get("beam_width"), "sampling_params.beam_width") or 1 for p in params]
    if beams and beams[0] > 1:
        return 1
    return max(ns, default=1)


def refusal(body: dict, endpoint: str, pd: bool) -> Optional[str]:
    """Why the request is refused (answered 400 with this message), or None.

    ``pd``: the request goes through prefill/decode disaggregation (no ``n > 1``)."""
    try:
        n = samples(body, endpoint)
        best_of = _count(body.get("best_of"), "best_of") if endpoint == "v1/completions" else None
    except ValueError as e:
        return str(e)
    if best_of is not None and best_of < n:
        return f"best_of ({best_of}) must be greater than or equal to n ({n})"
    if best_of is not None and best_of > n:
        return (f"best_of > n (best_of {best_of}, n {n}) is not supported: SGLang 0.5.23 accepts "
                "best_of and ignores it (it would return n samples, not the best n of best_of); "
                "ask for n samples with logprobs and rank them yourself")
    if pd and n > 1:
        generate = " or, on /generate, a batch of n copies of the prompt" if endpoint == "generate" else ""
        return PD_PARALLEL_SAMPLING.format(generate=generate)
    return None
