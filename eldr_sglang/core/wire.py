"""The engine -> router signature message: its fields, build, parse, framing and HMAC.

One message (a JSON object)::

    {"bootstrap_room": int, "rid": str, "prompt_tokens": int, "cached_tokens": int,
     "layers": [int] * n_sel, "counts": [[int] * E] * n_sel | packed, "model": {...},
     "ts": float}

``counts`` is a list of rows or packed (:mod:`eldr_sglang.core.counts_codec`, as the
engine publishes it); only ``bootstrap_room``, ``layers`` and ``counts`` are
required, any other field is dropped on parse. A request's router names where its
message goes in ``custom_params[RETURN_ADDRESS_KEY]``; a client asks for the
message in ``meta_info`` with ``custom_params[META_KEY]``.

Framing: ``POST /eldr/signature`` takes one message or a JSON list; the TCP stream
takes one message per line. With a shared key, the sender signs the exact bytes
(the HTTP body, the JSON of a line) with HMAC-SHA256, ``sha256=<hex>``: in the
``X-Eldr-Hmac`` header, or as the line's prefix (``sha256=<hex> {...}``).

Freshness: :func:`http_body` and :func:`stream_lines` stamp each message with ``ts``
(the sender's wall clock, seconds) before signing, so the timestamp is inside the
MAC. A router refuses a message whose ``ts`` is further than its
``--signature-max-age`` from its own clock, and a second message for one bootstrap
room (a replay); with a key, a message without ``ts`` too. Routers of before the
stamp drop the field (any field outside the contract is dropped), so engines can be
upgraded first.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import orjson

from eldr_sglang.core.counts_codec import pack_counts, unpack_counts

RETURN_ADDRESS_KEY = "eldr_signature_to"
"""``custom_params`` key (``sampling_params.custom_params`` on ``/generate``, top-level
``custom_params`` on the OpenAI routes) holding the router's own signature address."""
META_KEY = "eldr_signature"
"""``custom_params`` flag asking for the message in ``meta_info`` (under the same key)."""

MAX_ROOM = 2**64
MAX_RID_CHARS = 512  # SGLang's rids are 32 hex characters; a client's own rid is short too
MAX_LAYERS = 1024  # published layers per message (a model has at most a few hundred)
MAX_NAME_CHARS = 256
MAX_MODEL_BYTES = 1024  # the optional ``model`` object (name, layers, experts, top-k)
# the message contract: any other field is dropped on parse (it would be memory the
# byte cap of the router's buffer does not see)
FIELDS = frozenset({"bootstrap_room", "rid", "prompt_tokens", "cached_tokens", "layers", "counts",
                    "model", "model_name", "ts"})
TS_FIELD = "ts"  # the sender's time.time() when it framed the message (inside the MAC)

MAC_HEADER = "X-Eldr-Hmac"
MAC_PREFIX = b"sha256="
KEY_ENV = "ELDR_SIGNATURE_KEY"
_MAC_CHARS = len(MAC_PREFIX) + 64  # "sha256=" + hex digest


# ------------------------------------------------------------------ build
def build_message(bootstrap_room: int | None, rid: str | None, prompt_tokens: int, cached_tokens: int,
                  layers: list[int], counts: Any, packed: bool = False,
                  model: dict | None = None) -> dict:
    """One message; ``counts`` [n_sel, E] (array-like, or a dict already packed) packed
    (publishing) or as lists of rows (traces, ``meta_info``). ``model`` lets a router
    without an artifact (``--online``) name the model of the artifact it fits."""
    if not isinstance(counts, dict):
        counts = pack_counts(counts) if packed else counts.tolist() if hasattr(counts, "tolist") else counts
    msg = {"bootstrap_room": bootstrap_room, "rid": rid, "prompt_tokens": int(prompt_tokens),
           "cached_tokens": int(cached_tokens), "layers": list(layers), "counts": counts}
    if model is not None:
        msg["model"] = model
    return msg


def return_address(custom_params: Any) -> str | None:
    """The signature address a router put in ``custom_params``; None if absent or malformed."""
    dest = custom_params.get(RETURN_ADDRESS_KEY) if isinstance(custom_params, dict) else None
    return dest if isinstance(dest, str) and dest else None


def wants_signature(custom_params: Any) -> bool:
    """Whether ``custom_params`` asks for the message in ``meta_info``."""
    return isinstance(custom_params, dict) and bool(custom_params.get(META_KEY))


# ------------------------------------------------------------------ parse
def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_message(obj: Any) -> dict:
    """Validate one message in place (counts become an ndarray); ValueError if malformed."""
    if not isinstance(obj, dict):
        raise ValueError("signature message must be a JSON object")
    room = obj.get("bootstrap_room")
    if not _is_int(room) or not 0 <= room < MAX_ROOM:
        raise ValueError("bootstrap_room must be a non-negative 64-bit integer")
    for key in [k for k in obj if k not in FIELDS]:
        del obj[key]
    layers = obj.get("layers")
    if not isinstance(layers, list) or not set(map(type, layers)) <= {int}:  # C-speed; bools excluded
        raise ValueError("layers must be a list of integers")
    if len(layers) > MAX_LAYERS:
        raise ValueError(f"layers: {len(layers)} entries, at most {MAX_LAYERS}")
    rid = obj.get("rid")
    if rid is not None and (not isinstance(rid, str) or len(rid) > MAX_RID_CHARS):
        raise ValueError(f"rid must be a string of at most {MAX_RID_CHARS} characters")
    _check_model_fields(obj)
    counts = obj.get("counts")
    if isinstance(counts, dict):
        arr = unpack_counts(counts)
    elif isinstance(counts, (list, np.ndarray)):
        try:
            arr = np.array(counts)  # one C pass; ragged rows raise ValueError
        except (ValueError, TypeError):
            raise ValueError("counts rows must be lists of numbers of equal length") from None
    else:
        raise ValueError("counts must be a list of rows (one per layer) or packed counts")
    if arr.ndim != 2 or arr.shape[0] != len(layers) or arr.dtype.kind not in "iuf":
        raise ValueError(f"counts must be numbers shaped [len(layers)={len(layers)}, E], "
                         f"got shape {list(arr.shape)}")
    obj["counts"] = arr  # kept as an array: the encoder needs no second conversion
    for key in ("prompt_tokens", "cached_tokens"):
        if key in obj and obj[key] is not None and not _is_int(obj[key]):
            raise ValueError(f"{key} must be an integer")
    ts = obj.get(TS_FIELD)
    if ts is not None and (not isinstance(ts, (int, float)) or isinstance(ts, bool)
                           or not math.isfinite(ts)):
        raise ValueError(f"{TS_FIELD} must be a number (seconds since the epoch)")
    return obj


def _check_model_fields(obj: dict) -> None:
    name = obj.get("model_name")
    if name is not None and (not isinstance(name, str) or len(name) > MAX_NAME_CHARS):
        raise ValueError(f"model_name must be a string of at most {MAX_NAME_CHARS} characters")
    model = obj.get("model")
    if model is not None:
        try:
            ok = isinstance(model, dict) and len(orjson.dumps(model)) <= MAX_MODEL_BYTES
        except TypeError:  # nested deeper than orjson writes
            ok = False
        if not ok:
            raise ValueError(f"model must be an object of at most {MAX_MODEL_BYTES} bytes")


class Malformed(str):
    """In :func:`preparse`'s answer: a message that failed validation, as its reason
    (a short string, never the message's own bulk)."""


MAX_MESSAGES = 256  # messages in one body or line (publishers send batches of 64)


def preparse(raw: bytes) -> Any:
    """A body (or line) parsed, each message validated (its counts an array) or
    replaced by a :class:`Malformed` reason, so what comes back from the parser
    process is small to unpickle whatever was sent; JSONDecodeError when not JSON."""
    data = orjson.loads(raw)
    if isinstance(data, list) and len(data) > MAX_MESSAGES:
        return Malformed(f"{len(data)} messages in one body; at most {MAX_MESSAGES}")
    msgs = data if isinstance(data, list) else [data]
    for i, m in enumerate(msgs):
        try:
            parse_message(m)
        except ValueError as e:
            msgs[i] = Malformed(str(e))  # refused and counted on intake
    return msgs if isinstance(data, list) else msgs[0]


def message_bytes(msg: dict) -> int:
    """Memory a parsed message holds: its counts array, rid, layers and model fields."""
    counts = msg.get("counts")
    size = counts.nbytes if isinstance(counts, np.ndarray) else 0
    size += len(msg.get("rid") or "") + len(msg.get("model_name") or "")
    size += 36 * len(msg.get("layers") or ())  # a list slot and an int object each
    if isinstance(msg.get("model"), dict):
        size += MAX_MODEL_BYTES
    return size


# ------------------------------------------------------------------ framing and HMAC
def mac(key: bytes, data: bytes) -> bytes:
    """``sha256=<hex>`` of ``data`` under ``key``."""
    return MAC_PREFIX + hmac.new(key, data, hashlib.sha256).hexdigest().encode("ascii")


def verify(key: bytes, data: bytes, given: bytes | str | None) -> bool:
    """Whether ``given`` is the MAC of ``data`` under ``key`` (constant-time compare)."""
    if given is None:
        return False
    if isinstance(given, str):
        given = given.strip().encode("ascii", "replace")
    return hmac.compare_digest(mac(key, data), given)


def stamped(message: dict, now: float | None = None) -> dict:
    """``message`` with its ``ts`` (a copy; one that has a ``ts`` is left as it is)."""
    if TS_FIELD in message:
        return message
    return {**message, TS_FIELD: round(time.time() if now is None else now, 3)}


def http_body(payload: dict | list[dict], key: bytes | None = None) -> tuple[bytes, dict[str, str]]:
    """``POST /eldr/signature`` body (one message or a list, each stamped) and its
    headers (signed with a key)."""
    now = time.time()
    payload = ([stamped(m, now) for m in payload] if isinstance(payload, list)
               else stamped(payload, now))
    body = orjson.dumps(payload)
    headers = {"Content-Type": "application/json"}
    if key:
        headers[MAC_HEADER] = mac(key, body).decode("ascii")
    return body, headers


def stream_lines(messages: Iterable[dict], key: bytes | None = None) -> bytes:
    """TCP stream bytes: one message per line, each stamped, and signed (prefix) when
    there is a key."""
    out = []
    now = time.time()
    for m in messages:
        data = orjson.dumps(stamped(m, now))
        out.append(mac(key, data) + b" " + data + b"\n" if key else data + b"\n")
    return b"".join(out)


def split_line(line: bytes) -> tuple[bytes | None, bytes]:
    """``(mac or None, json bytes)`` of one stream line (newline and spaces stripped)."""
    line = line.strip()
    if line.startswith(MAC_PREFIX):
        return line[:_MAC_CHARS], line[_MAC_CHARS:].lstrip()
    return None, line


def load_key(path: str | None, flag: str, environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The shared key: the file at ``path`` (``flag``), else ``$ELDR_SIGNATURE_KEY``, else None.
    Surrounding whitespace is not part of it. ValueError naming the flag (or the variable)
    for a missing, unreadable or empty file, or a set but empty variable."""
    if path is not None:
        try:
            key = Path(path).read_bytes().strip()
        except OSError as e:
            raise ValueError(f"{flag}: cannot read {path!r}: {e.strerror or e}") from None
        if not key:
            raise ValueError(f"{flag}: {path!r} is empty (a key is at least one non-blank byte)")
        return key
    raw = environ.get(KEY_ENV)
    if raw is None:
        return None
    key = raw.strip().encode()
    if not key:
        raise ValueError(f"{KEY_ENV} is set but empty (unset it for no key)")
    return key
