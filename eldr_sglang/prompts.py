"""Prompt token ids: the model's own tokenizer, request bodies, workload files.

Shared by calibration (fitting the signature predictor on workload prompts joined
to trace records by request id) and by the routers that predict signatures before
prefill (co-located mode, ``POST /eldr/score``). ``transformers`` is imported only
when a tokenizer is loaded.

Token ids per request body, as the SGLang server would see them:

* ``/generate``: ``input_ids`` (list of ints, or a batch of lists) when given, else
  ``text`` (a string or a batch of strings) tokenised;
* ``/v1/completions``: ``prompt`` as a string, list of strings, list of ints or list
  of int lists;
* ``/v1/chat/completions``: ``messages`` through the tokenizer's chat template
  (generation prompt added); a tokenizer without one gets the contents joined by
  newlines.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

ENCODE_PIECE = 4096  # characters tokenised at a time by Tokenizer.encode_pieces

__all__ = ["load_tokenizer", "Tokenizer", "PieceTokenizer", "request_token_ids", "read_prompt_ids", "join_prompt_ids"]


class Tokenizer:
    """A thin wrapper: ``encode(text) -> list[int]`` and ``chat(messages) -> list[int]``."""

    def __init__(self, hf: Any, path: str = "") -> None:
        self.hf, self.path = hf, path
        self._fast = getattr(hf, "backend_tokenizer", None) or getattr(hf, "_tokenizer", None)

    def encode(self, text: str) -> list[int]:
        if self._fast is not None and hasattr(self._fast, "encode"):
            return list(self._fast.encode(text).ids)  # the Rust tokenizer, same ids, less overhead
        return list(self.hf.encode(text))

    def chat(self, messages: list) -> list[int]:
        if getattr(self.hf, "chat_template", None):  # content parts as text, as SGLang gives a string template
            ids = self.hf.apply_chat_template(_text_parts(messages), add_generation_prompt=True, tokenize=True)
            return list(ids if isinstance(ids, list) else ids["input_ids"])  # transformers 5: a BatchEncoding
        return self.encode("\n".join(_content(m) for m in messages))

    def encode_pieces(self, text: str, special: bool = True, piece: int = ENCODE_PIECE) -> list[int]:
        """:meth:`encode` of a long text in pieces of at most ``piece`` characters cut
        before a space: the tokenizer holds the GIL for one piece at a time, so a thread
        tokenising leaves the event loop free. The ids differ at most at the cuts.
        ``special``: the tokenizer's special tokens (BOS) before the first piece."""
        if self._fast is None or not hasattr(self._fast, "encode"):
            return self.encode(text) if special else list(self.hf.encode(text, add_special_tokens=False))
        ids: list[int] = []
        i = 0
        while i < len(text):
            j = min(i + piece, len(text))
            if j < len(text):
                cut = text.rfind(" ", i + 1, j)
                j = cut if cut > i else j
            ids.extend(self._fast.encode(text[i:j], add_special_tokens=special and i == 0).ids)
            i = j
        return ids

    def chat_pieces(self, messages: list) -> list[int]:
        """:meth:`chat` with the rendered template tokenised by :meth:`encode_pieces`
        (the template's text carries its special tokens, as ``apply_chat_template``)."""
        if getattr(self.hf, "chat_template", None):
            text = self.hf.apply_chat_template(_text_parts(messages), add_generation_prompt=True, tokenize=False)
            return self.encode_pieces(text, special=False)
        return self.encode_pieces("\n".join(_content(m) for m in messages))


class PieceTokenizer:
    """A :class:`Tokenizer` seen through :meth:`~Tokenizer.encode_pieces` and
    :meth:`~Tokenizer.chat_pieces` (what the routers tokenise with, on their prompt thread)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.path = tok, tok.path

    def encode(self, text: str) -> list[int]:
        return self.tok.encode_pieces(text)

    def chat(self, messages: list) -> list[int]:
        return self.tok.chat_pieces(messages)


def _text_parts(messages: list) -> list:
    return [{**m, "content": _content(m)} if isinstance(m, dict) and isinstance(m.get("content"), list)
            else m for m in messages]


def _content(m: Any) -> str:
    if not isinstance(m, dict):
        raise ValueError("each message must be an object with 'role' and 'content'")
    c = m.get("content", "")
    if isinstance(c, list):  # OpenAI content parts: keep the text ones
        return " ".join(str(p.get("text", "")) for p in c if isinstance(p, dict))
    return "" if c is None else str(c)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The model's tokenizer from a folder (``tokenizer.json`` etc.); ValueError if none."""
    try:
        from transformers import AutoTokenizer

        return Tokenizer(AutoTokenizer.from_pretrained(str(path)), str(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a tokenizer from {path}: {exc}") from None


def _ids(x: Any) -> list[int] | None:
    if isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in x):
        return x
    return None


def request_token_ids(body: dict, endpoint: str, tok: Tokenizer | None) -> list[list[int]]:
    """Token ids of each item of a request body (one item unless a batch); ValueError
    says what is wrong (the caller answers 400)."""
    def text_ids(t: Any) -> list[int]:
        if not isinstance(t, str):
            raise ValueError("prompt text must be a string")
        if tok is None:
            raise ValueError("no tokenizer loaded: send 'input_ids'")
        ids = tok.encode(t)
        if not ids:
            raise ValueError("the prompt has no tokens")
        return ids

    if endpoint.endswith("chat/completions"):
        msgs = body.get("messages")
        if not (isinstance(msgs, list) and msgs):
            raise ValueError("'messages' must be a non-empty list")
        if tok is None:
            raise ValueError("no tokenizer loaded: chat requests need one")
        ids = tok.chat(msgs)
        if not ids:
            raise ValueError("the messages have no tokens")
        return [ids]
    if endpoint.endswith("completions"):
        p = body.get("prompt")
        if isinstance(p, str):
            return [text_ids(p)]
        if _ids(p) is not None:
            return [p]
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            return [text_ids(x) for x in p]
        if isinstance(p, list) and p and all(_ids(x) is not None for x in p):
            return list(p)
        raise ValueError("'prompt' must be a string, a list of strings, or token ids")
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None and ids is not None:
        raise ValueError("give only one of 'text' and 'input_ids'")
    if ids is not None:
        if _ids(ids) is not None:
            return [ids]
        if isinstance(ids, list) and ids and all(_ids(x) is not None for x in ids):
            return list(ids)
        raise ValueError("'input_ids' must be a non-empty list of non-negative ints or of such lists")
    if isinstance(text, str):
        return [text_ids(text)]
    if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        return [text_ids(t) for t in text]
    raise ValueError("request needs 'text' (a string or list of strings) or 'input_ids'")


def read_prompt_ids(paths: Iterable[str | os.PathLike], tok: Tokenizer | None = None) -> dict[str, list[int]]:
    """JSON lines with ``id`` and ``input_ids`` (or ``prompt``, tokenised with ``tok``) ->
    {id: token ids}; ValueError names the file and line."""
    out: dict[str, list[int]] = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    rid = str(rec["id"])
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{n}: need a JSON object with 'id' ({exc})") from None
                if _ids(rec.get("input_ids")) is not None:
                    out[rid] = rec["input_ids"]
                elif isinstance(rec.get("prompt"), str):
                    if tok is None:
                        raise ValueError(f"{path}:{n}: prompt text needs --tokenizer")
                    out[rid] = tok.encode(rec["prompt"])
                else:
                    raise ValueError(f"{path}:{n}: need 'input_ids' or 'prompt'")
    return out


def join_prompt_ids(request_ids: Sequence[str], ids: dict[str, list[int]]) -> tuple[list[int], list[list[int]]]:
    """Rows of ``request_ids`` that have token ids (row indices, their ids)."""
    rows = [i for i, r in enumerate(request_ids) if str(r) in ids and ids[str(r)]]
    return rows, [ids[str(request_ids[i])] for i in rows]


def default_tokenizer_path(artifact: Any) -> str | None:
    """The tokenizer folder recorded at calibration (``extra.predictor.tokenizer``), if it exists."""
    info = (getattr(artifact, "extra", None) or {}).get("predictor") or {}
    path = info.get("tokenizer") if isinstance(info, dict) else None
    return path if path and Path(path).exists() else None


def fit_predictor(traces: Any, layers: Sequence[int], prompt_paths: Sequence[str | os.PathLike],
                  tokenizer: str | None = None, method: str = "ridge", alpha: float = 1.0,
                  dtype: str = "int8") -> tuple[Any, dict]:
    """Fit a :class:`~eldr_sglang.core.predictor.SignaturePredictor` on the trace records
    that have prompt token ids in ``prompt_paths``; (predictor, info for the artifact's extra)."""
    from .core.predictor import SignaturePredictor

    tok = load_tokenizer(tokenizer) if tokenizer else None
    ids = read_prompt_ids(prompt_paths, tok)
    rows, token_ids = join_prompt_ids(list(traces.request_ids), ids)
    if len(rows) < 2:
        raise ValueError(f"--predictor-prompts: only {len(rows)} of {len(traces)} trace records have prompts "
                         "(records and prompts are joined by request id)")
    counts = traces.prefill_counts[np.asarray(rows)][:, list(layers)]
    pred = SignaturePredictor(method, alpha, dtype).fit(token_ids, counts)
    info = {"method": method, "alpha": alpha, "dtype": dtype, "requests": len(rows),
            "trace_records": len(traces), "tokens_seen": int(len(pred.tokens_)), "bytes": pred.nbytes,
            "tokenizer": str(tokenizer) if tokenizer else None}
    return pred, info
