"""The bounded view of a request: what a router reads of a client body, checked once
for every surface (the PD router, the co-located router, ``POST /eldr/score``, the
pre-router's in-process scorer).

* The fields a router reads are small scalars or the request is a 400 naming the
  field (:func:`~eldr_sglang.router.http.bodies.check_scalars`).
* Token ids are plain JSON integers from 0 to :data:`MAX_TOKEN_ID` (a 400 naming the
  field otherwise), a batch (a list of texts, of id lists, of prompts) at most
  ``--max-batch`` items (413).
* What the prompt work (tokenising, the chat template, prediction) gets is bounded
  whatever the body's size: the first :data:`VIEW_CHARS` characters or
  :data:`VIEW_TOKENS` ids of each item, at most :data:`VIEW_TOTAL_CHARS` /
  :data:`VIEW_TOTAL_TOKENS` over a batch, the first :data:`VIEW_MESSAGES` chat
  messages. A predicted signature is a normalised direction: a long prompt's first
  thousands of tokens give it as well as the whole.

:func:`prompt_view` parses raw bytes (run in the parser process for big bodies,
:class:`~eldr_sglang.router.http.bodies.BodyParser`); :func:`bounded_view` takes a
parsed dict (the pre-router's scorer).
"""

from __future__ import annotations

from typing import Any, Optional

from eldr_sglang.router.http import sampling
from eldr_sglang.router.http.bodies import BadRequest, check_scalars, parse_object

MAX_TOKEN_ID = 2 ** 31 - 1
VIEW_CHARS = 16 << 10  # prompt characters read per item
VIEW_TOKENS = 4096  # token ids read per item
VIEW_TOTAL_CHARS = 64 << 10  # over a batch or all messages
VIEW_TOTAL_TOKENS = 64 << 10
VIEW_MESSAGES = 256  # chat messages read (the first ones)
ENDPOINTS = ("generate", "v1/completions", "v1/chat/completions")


def token_ids(value: Any, field: str) -> list[int]:
    """``value`` as a non-empty list of token ids; BadRequest naming ``field``."""
    if (isinstance(value, list) and value
            and all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in value)):
        return value
    raise BadRequest(f"'{field}' must hold token ids: non-empty lists of integers from 0 to "
                     f"{MAX_TOKEN_ID}")


def _batch(items: list, field: str, max_batch: int) -> None:
    if len(items) > max_batch:
        raise BadRequest(f"'{field}': batch of {len(items)} items; this router takes at most "
                         f"{max_batch} (--max-batch)", 413)


def _texts(value: list, field: str, max_batch: int) -> list[str]:
    _batch(value, field, max_batch)
    per = min(VIEW_CHARS, VIEW_TOTAL_CHARS // len(value))
    return [t[:per] for t in value]


def _id_lists(value: list, field: str, max_batch: int) -> list[list[int]]:
    _batch(value, field, max_batch)
    per = min(VIEW_TOKENS, VIEW_TOTAL_TOKENS // len(value))
    return [token_ids(x, field)[:per] for x in value]


def _prompt(value: Any, field: str, max_batch: int, texts: bool = True) -> Any:
    """A prompt field (text, ids, or a batch of either), checked and cut to the view."""
    if texts and isinstance(value, str):
        return value[:VIEW_CHARS]
    if isinstance(value, list) and value:
        if type(value[0]) is int or isinstance(value[0], (bool, float)):
            return token_ids(value, field)[:VIEW_TOKENS]
        if texts and all(isinstance(t, str) for t in value):
            return _texts(value, field, max_batch)
        if all(isinstance(t, list) for t in value):
            return _id_lists(value, field, max_batch)
    kinds = "a string, a list of strings, token ids or a list of token id lists" if texts else \
        "token ids or a list of token id lists"
    raise BadRequest(f"'{field}' must be {kinds}")


def _messages(value: Any) -> list:
    if not (isinstance(value, list) and value):
        raise BadRequest("'messages' must be a non-empty list")
    out, budget = [], VIEW_TOTAL_CHARS
    for m in value[:VIEW_MESSAGES]:
        if not isinstance(m, dict):
            raise BadRequest("each message must be an object with 'role' and 'content'")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: their text
            content = " ".join(str(p.get("text", "")) for p in content[:VIEW_MESSAGES]
                               if isinstance(p, dict))
        content = "" if content is None else str(content)[:min(VIEW_CHARS, budget)]
        budget -= len(content)
        role = m.get("role")
        out.append({"role": role if isinstance(role, str) else "user", "content": content})
        if budget <= 0:
            break
    return out


def bounded_view(body: dict, endpoint: str, max_batch: int) -> dict:
    """The fields a pre-prefill router reads, checked and cut to the view's bounds
    (the same keys as the body, so :func:`~eldr_sglang.prompts.request_token_ids`
    reads it); BadRequest (400, 413 for a batch) when the request is not valid."""
    check_scalars(body)
    refused = sampling.refusal(body, endpoint, pd=False)
    if refused:
        raise BadRequest(refused)
    read = ("stream", "model") if endpoint == "generate" else ("stream", "model", "n", "best_of")
    view: dict = {k: body[k] for k in read if body.get(k) is not None}  # checked scalars only
    sp = body.get("sampling_params")
    keep = ("n", "beam_width")
    if isinstance(sp, dict):
        view["sampling_params"] = {k: sp[k] for k in keep if k in sp}
    elif isinstance(sp, list):
        _batch(sp, "sampling_params", max_batch)
        view["sampling_params"] = [{k: x[k] for k in keep if k in x} if isinstance(x, dict) else {} for x in sp]
    if endpoint == "v1/chat/completions":
        view["messages"] = _messages(body.get("messages"))
    elif endpoint == "v1/completions":
        if "prompt" not in body:
            raise BadRequest("'prompt' must be a string or a list")
        view["prompt"] = _prompt(body["prompt"], "prompt", max_batch)
    else:
        text, ids = body.get("text"), body.get("input_ids")
        if text is not None and ids is not None:
            raise BadRequest("give only one of 'text' and 'input_ids'")  # as SGLang does
        if ids is not None:
            view["input_ids"] = _prompt(ids, "input_ids", max_batch, texts=False)
        elif text is not None:
            if not (isinstance(text, str) or (isinstance(text, list) and text
                                              and all(isinstance(t, str) for t in text))):
                raise BadRequest("'text' must be a string or a non-empty list of strings")
            view["text"] = _prompt(text, "text", max_batch)
        elif body.get("input_embeds") is None:
            raise BadRequest("request needs 'text', 'input_ids' or 'input_embeds'")
    return view


def prompt_view(raw: bytes, endpoint: Optional[str], max_batch: int) -> tuple:
    """Parse and view one body: ``("ok", view, endpoint)`` or ``("error", status, message)``.
    ``endpoint`` None: ``POST /eldr/score``, whose body names it (``endpoint``) or
    implies it (``messages``: chat, ``prompt``: completions, else ``/generate``).
    Only the view comes back from the parser process, never the body's other fields."""
    try:
        body = parse_object(raw)
        if endpoint is None:
            endpoint = score_endpoint(body)
        return "ok", bounded_view(body, endpoint, max_batch), endpoint
    except BadRequest as e:
        return "error", e.status, str(e)


def score_endpoint(body: dict) -> str:
    """The route a ``/eldr/score`` body asks about; BadRequest when it names another."""
    named = body.get("endpoint")
    if named is None or named == "":
        return ("v1/chat/completions" if "messages" in body else
                "v1/completions" if "prompt" in body else "generate")
    if isinstance(named, str) and named.lstrip("/") in ENDPOINTS:
        return named.lstrip("/")
    raise BadRequest(f"'endpoint' must be one of {', '.join(ENDPOINTS)}")
