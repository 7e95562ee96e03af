"""Request bodies: read under a size cap and a time limit, validated, parsed off the
event loop when big.

orjson holds the GIL for a whole parse, so a thread would not free the event loop:
a body over ``OFF_LOOP_BYTES`` is parsed and validated in a one-worker process, which
hands back the small fields as a dict and the bulky ones (prompt text, token ids,
messages, and any other field or sampling parameter of ``FRAGMENT_BYTES`` or more)
as JSON fragments (:class:`orjson.Fragment`) that are forwarded as they came, never
turned into Python objects here. What comes back as Python objects is at most
``RESIDUAL_BYTES`` (pickled), else the body is refused (400): no body, of any shape,
costs the event loop more than unpickling that much.

JSON nested deeper than orjson can write again (``MAX_DEPTH``; it reads up to 1024
levels) is refused with 400, never a 500 when the body is forwarded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import pickle
from typing import Any, Optional

import orjson
from aiohttp import web

from eldr_sglang.router.http import sampling

OFF_LOOP_BYTES = 256 << 10  # bodies at least this large are parsed in the parser process
MAX_PENDING = 64  # bodies waiting for the parser process; beyond, 503 + Retry-After
MAX_PENDING_BYTES = 512 << 20
ADMIN_BODY_BYTES = 64 << 10  # admin POSTs: server lists, a calibration path
BULK_FIELDS = ("text", "input_ids", "input_embeds", "prompt", "messages")
FRAGMENT_BYTES = 16 << 10  # in a big body, other values this large are forwarded as fragments
RESIDUAL_BYTES = 256 << 10  # a big body's fields kept as Python objects, pickled: at most this
KEPT_BYTES = 64 << 10  # 'rid' and 'stream' (read by the router): larger is refused
MAX_DEPTH = 254  # orjson.dumps refuses deeper nesting (orjson.loads takes up to 1024)
# fields the router reads or rewrites stay Python objects (a dict: its own values are
# split the same way, one level down; None: kept whole, at most KEPT_BYTES)
ROUTER_FIELDS: dict = {"rid": None, "stream": None, "custom_params": {},
                       "sampling_params": {"custom_params": {}}}
ADMIN_BODY_KEY = web.RequestKey("eldr_admin_body", bytes)  # an admin request's body, read


class BodyError(Exception):
    """A body the router will not take: answered with ``status`` and the message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class BadRequest(BodyError, ValueError):
    """The client's request is wrong (400, or 413 for a batch over the limit)."""


async def read_body(request: web.Request, limit: int, timeout: Optional[float]) -> bytes:
    """The whole body, at most ``limit`` bytes (413 beyond), within ``timeout`` seconds
    (408 beyond; None: no limit)."""
    if (request.content_length or 0) > limit:
        raise BodyError(f"request body too large: {request.content_length} bytes, this route "
                        f"takes at most {limit}", 413)
    content = request.content
    if content.is_eof():  # all of it arrived with the headers: no timer, no wait
        data = content.read_nowait()
        if len(data) > limit:
            raise BodyError(f"request body too large: over {limit} bytes", 413)
        return data
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            while True:
                chunk = await request.content.readany()
                if not chunk:
                    break
                size += len(chunk)
                if size > limit:
                    raise BodyError(f"request body too large: over {limit} bytes", 413)
                chunks.append(chunk)
    except TimeoutError:
        raise BodyError(f"request body not received within {timeout} s", 408) from None
    return b"".join(chunks)


# ------------------------------------------------------------------ validation
def batch_size(body: dict, limit: int) -> Optional[int]:
    """None for a single /generate request, else the batch length; BadRequest if malformed
    or over ``limit`` items (413)."""
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None and ids is not None:
        raise BadRequest("give only one of 'text' and 'input_ids'")  # as SGLang does
    items = text if text is not None else ids
    if isinstance(items, list) and len(items) > limit and items and not isinstance(items[0], int):
        raise BadRequest(f"batch of {len(items)} items; this router takes at most {limit} "
                         "(--max-batch)", 413)
    if text is not None:
        if isinstance(text, str):
            return None
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return len(text)
        raise BadRequest("'text' must be a string or a non-empty list of strings")
    if ids is not None:
        if isinstance(ids, list) and ids:
            if all(isinstance(t, int) for t in ids):
                return None
            if all(isinstance(t, list) and t and all(isinstance(x, int) for x in t) for t in ids):
                return len(ids)
        raise BadRequest("'input_ids' must be a non-empty list of ints or of int lists")
    if body.get("input_embeds") is None:
        raise BadRequest("request needs 'text', 'input_ids' or 'input_embeds'")
    return None


def validate_openai(endpoint: str, body: dict, limit: int) -> None:
    """The OpenAI routes' required fields; a ``prompt`` list of prompts over ``limit`` is 413."""
    if endpoint == "v1/completions":
        prompt = body.get("prompt")
        if not isinstance(prompt, (str, list)):
            raise BadRequest("'prompt' must be a string or a list")
        if isinstance(prompt, list) and len(prompt) > limit and not isinstance(prompt[0], int):
            raise BadRequest(f"batch of {len(prompt)} prompts; this router takes at most {limit} "
                             "(--max-batch)", 413)
    if endpoint == "v1/chat/completions" and not (
            isinstance(body.get("messages"), list) and body["messages"]):
        raise BadRequest("'messages' must be a non-empty list")


MODEL_CHARS = 1024


def check_scalars(body: dict) -> None:
    """The scalars a router reads besides the counts: ``stream`` true/false, ``model`` a
    string; BadRequest naming the field, never a list or megabytes read as one. ``n`` /
    ``best_of`` are read, as plain integers only, by :func:`sampling.refusal
    <eldr_sglang.router.http.sampling.refusal>`, which every caller applies next."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false")
    model = body.get("model")
    if model is not None and not (isinstance(model, str) and len(model) <= MODEL_CHARS):
        raise BadRequest(f"'model' must be a string of at most {MODEL_CHARS} characters")


def prompt_batch(body: dict) -> Optional[int]:
    """A ``/v1/completions`` list of prompts (strings or token id lists) is a batch, as
    SGLang serves it (one bootstrap room per prompt): its length, else None."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return None


def too_deep(raw: bytes, obj: Any) -> bool:
    """Whether ``obj`` (parsed from ``raw``) nests deeper than orjson can write back.
    Counting brackets is a C-speed pass; only a body with enough of them is written
    once to see."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return False
    try:
        orjson.dumps(obj)
    except TypeError:  # orjson.JSONEncodeError: "Recursion limit reached"
        return True
    return False


def _split(obj: dict, spec: dict, path: tuple, out: dict, max_batch: int) -> None:
    """Move ``obj``'s big values (JSON bytes) into ``out`` by path, keeping the
    ``spec`` fields (see ``ROUTER_FIELDS``) as Python objects; BadRequest when a kept
    field is too big."""
    for key in list(obj):
        value = obj[key]
        sub = spec.get(key, False)
        if sub is None:  # read by the router: kept whole, bounded
            if len(orjson.dumps(value)) > KEPT_BYTES:
                raise BadRequest(f"'{key}' is over {KEPT_BYTES} bytes of JSON")
            continue
        if isinstance(sub, dict) and isinstance(value, (dict, list)):  # rewritten by the router
            items = value if isinstance(value, list) else [value]
            if isinstance(value, list) and len(value) > max(max_batch, 1):
                raise BadRequest(f"'{key}': {len(value)} items; this router takes at most "
                                 f"{max_batch} (--max-batch)", 413)
            for i, item in enumerate(items):
                if isinstance(item, dict):
                    _split(item, sub, path + ((key, i) if isinstance(value, list) else (key,)),
                           out, max_batch)
            continue
        if isinstance(value, (dict, list, str)):
            data = orjson.dumps(value)
            if len(data) >= FRAGMENT_BYTES:
                out[path + (key,)] = data
                del obj[key]


def parse_object(raw: bytes) -> dict:
    """A JSON object orjson can also write back; BadRequest (400) otherwise."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if too_deep(raw, body):
        raise BadRequest(f"invalid JSON body: nested deeper than {MAX_DEPTH} levels")
    return body


def prepare(raw: bytes, endpoint: str, max_batch: int, split: bool = False) -> tuple:
    """Parse and validate one client body: ``("ok", body, batch size, fragments)`` or
    ``("error", status, message)``. ``split``: the bulky fields, and any other big
    value, leave ``body`` as JSON bytes in ``fragments`` ({path: bytes}; the parser
    process's answer stays small to unpickle)."""
    try:
        body = parse_object(raw)
        if endpoint == "generate":
            n = batch_size(body, max_batch)
        else:
            validate_openai(endpoint, body, max_batch)
            n = prompt_batch(body) if endpoint == "v1/completions" else None
        check_scalars(body)
    except BadRequest as e:
        return "error", e.status, str(e)
    refused = sampling.refusal(body, endpoint, pd=True)  # n > 1 cannot pass through PD
    if refused:
        return "error", 400, refused
    fragments: dict = {}
    if split:
        fragments = {(k,): orjson.dumps(body.pop(k)) for k in BULK_FIELDS if k in body}
        try:
            _split(body, ROUTER_FIELDS, (), fragments, max_batch)
        except BadRequest as e:
            return "error", e.status, str(e)
        if len(pickle.dumps(body, pickle.HIGHEST_PROTOCOL)) > RESIDUAL_BYTES:
            return "error", 400, (f"request body has too many small fields (over {RESIDUAL_BYTES} "
                                  "bytes of them besides the prompt and big values)")
    return "ok", body, n, fragments


def place_fragments(body: dict, fragments: dict) -> dict:
    """Put each ``{path: JSON bytes}`` back into ``body`` as an :class:`orjson.Fragment`."""
    for path, value in fragments.items():
        obj = body
        for step in path[:-1]:
            obj = obj[step]
        obj[path[-1]] = orjson.Fragment(value)
    return body


class BodyParser:
    """:func:`prepare` on the event loop for small bodies, in one worker process for big ones."""

    def __init__(self, off_loop_bytes: int = OFF_LOOP_BYTES, max_pending: int = MAX_PENDING,
                 max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self.off_loop_bytes = off_loop_bytes
        self.executor: Optional[concurrent.futures.ProcessPoolExecutor] = None
        self.off_loop = 0  # bodies parsed in the worker process
        # waiting for the parser process: at most this many bodies and bytes, then 503
        self.max_pending, self.max_pending_bytes = max_pending, max_pending_bytes
        self.pending = self.pending_bytes = self.refused = 0

    def _pool(self) -> concurrent.futures.ProcessPoolExecutor:
        if self.executor is None:
            self.executor = concurrent.futures.ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn"))
        return self.executor

    async def run(self, fn, raw: bytes, *args: Any, off_loop_bytes: Optional[int] = None) -> Any:
        """``fn(raw, *args)``: here for a small body, in the parser process for a big one
        (``fn`` must be a module-level function; ``off_loop_bytes``: this call's threshold)."""
        if len(raw) < min(self.off_loop_bytes, off_loop_bytes or self.off_loop_bytes):
            return fn(raw, *args)
        if self.pending >= self.max_pending or self.pending_bytes + len(raw) > self.max_pending_bytes:
            self.refused += 1
            raise BodyError(f"router busy: {self.pending} large bodies wait to be parsed; retry", 503)
        self.off_loop += 1
        self.pending += 1
        self.pending_bytes += len(raw)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool(), fn, raw, *args)
        except concurrent.futures.process.BrokenProcessPool:
            self.executor = None
            raise
        finally:
            self.pending -= 1
            self.pending_bytes -= len(raw)

    async def request(self, raw: bytes, endpoint: str, max_batch: int) -> tuple[dict, Optional[int]]:
        """(body, batch size); BadRequest (4xx) when the body is not a valid request."""
        out = await self.run(prepare, raw, endpoint, max_batch, len(raw) >= self.off_loop_bytes)
        if out[0] == "error":
            raise BadRequest(out[2], out[1])
        _, body, n, fragments = out
        return place_fragments(body, fragments), n

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
            self.executor = None
