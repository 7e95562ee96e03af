"""``eldr-selfcheck URL``: is ELDR's expert capture working on this live server?

Sends a few prompts twice, first cold (a random prefix no cache holds), then again
(a prefix-cache hit), and checks each request's signature:

* non-empty: every prompt token counted top-k times in every published layer;
* stable: the warm signature (cached tokens' ids from the KV-slot table, the rest
  recomputed) equals the cold one, up to one near-tie swap per recomputed token;
* consistent with SGLang's own ``return_routed_experts`` when the server runs
  with ``--enable-return-routed-experts`` (plain servers; exact equality).

A plain (co-located) server returns signatures in ``meta_info`` on request. A
PD prefill server publishes them to the address a request carries: the check
listens on a local TCP port, sends each prompt with bootstrap fields of its own
(no decode server takes the KV; the request is aborted once its signature came),
which needs late binding (``--disaggregation-decode-allocation-policy
prefill_complete``) so that the prefill runs before a decode server binds.

Prints one line and exits 0 (OK) or 1 (FAIL, with the reason).
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

import numpy as np

from eldr_sglang.core.counts_codec import unpack_counts
from eldr_sglang.core.wire import META_KEY, RETURN_ADDRESS_KEY, split_line

TEXT = ("Quarterly results: revenue grew in the cloud segment while hardware sales declined; "
        "the board approved a dividend and a share buyback programme for the coming year.")


class CheckFailed(Exception):
    """The one-line reason the check failed."""


@dataclass
class Signature:
    layers: list[int]
    counts: np.ndarray  # [layers, experts]
    prompt_tokens: int
    cached_tokens: int
    routed_experts: np.ndarray | None = None  # SGLang's own ids [tokens, num_layers, top_k], when returned


def http_json(url: str, body: dict | None = None, timeout: float = 60.0, api_key: str | None = None) -> dict:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        raise CheckFailed(f"{url} answered HTTP {exc.code}: {exc.read()[:200].decode(errors='replace')}") from None
    except (OSError, ValueError) as exc:
        raise CheckFailed(f"{url} unreachable or not JSON: {exc}") from None


def server_facts(info: dict) -> dict:
    """The few ``/server_info`` fields the check needs."""
    return {"mode": str(info.get("disaggregation_mode") or "null"),
            "bootstrap_port": info.get("disaggregation_bootstrap_port"),
            "routed_experts": bool(info.get("enable_return_routed_experts")),
            "late_binding": info.get("disaggregation_decode_allocation_policy") == "prefill_complete"}


def prompts(n: int, seed: int | None = None) -> list[str]:
    """``n`` prompts no server has cached (a random prefix each)."""
    rng = random.Random(seed)
    return [f"[selfcheck {rng.getrandbits(48):012x}] {i}. {TEXT}" for i in range(n)]


def decode_routed(meta: dict) -> np.ndarray | None:
    raw = meta.get("routed_experts")
    return None if raw is None else np.frombuffer(base64.b64decode(raw), dtype=np.int32)


def as_signature(msg: dict, routed: np.ndarray | None = None) -> Signature:
    counts = msg["counts"]
    counts = unpack_counts(counts) if isinstance(counts, (dict, str)) else np.asarray(counts)
    return Signature(list(msg["layers"]), np.asarray(counts, dtype=np.int64), int(msg["prompt_tokens"]),
                     int(msg.get("cached_tokens") or 0), routed)


class PlainServer:
    """Signatures in ``meta_info`` (``custom_params.eldr_signature``)."""

    def __init__(self, url: str, routed_experts: bool, timeout: float, api_key: str | None) -> None:
        self.url, self.routed, self.timeout, self.api_key = url, routed_experts, timeout, api_key

    def signature(self, prompt: str) -> Signature:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0,
                                                    "custom_params": {META_KEY: True}}}
        if self.routed:
            body["return_routed_experts"] = True
        meta = http_json(self.url + "/generate", body, self.timeout, self.api_key).get("meta_info", {})
        msgs = meta.get(META_KEY)
        if not msgs:
            raise CheckFailed("no signature in meta_info: is the server started with --eldr-layers, "
                              "--eldr-calibration or --eldr-publish?")
        return as_signature(msgs[0], decode_routed(meta) if self.routed else None)

    def close(self) -> None:
        pass


class PrefillServer:
    """A PD prefill server: signatures published to this check's own TCP port."""

    def __init__(self, url: str, bootstrap_port: int, timeout: float, api_key: str | None) -> None:
        self.url, self.bootstrap_port, self.timeout, self.api_key = url, bootstrap_port, timeout, api_key
        self.host = urllib.parse.urlsplit(url).hostname or "127.0.0.1"
        self.sock = socket.create_server(("0.0.0.0", 0))
        self.port = self.sock.getsockname()[1]
        self.messages: dict[int, dict] = {}
        self.cond = threading.Condition()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        for line in conn.makefile("rb"):
            if line.strip():
                msg = json.loads(split_line(line)[1])  # a signing engine's MAC is not checked here
                with self.cond:
                    self.messages[msg.get("bootstrap_room")] = msg
                    self.cond.notify_all()

    def return_address(self) -> str:
        with socket.create_connection((self.host, urllib.parse.urlsplit(self.url).port or 80), timeout=5) as s:
            return f"tcp://{s.getsockname()[0]}:{self.port}"  # our address as the server sees it

    def signature(self, prompt: str) -> Signature:
        room = random.getrandbits(62) + 1
        rid = f"eldr-selfcheck-{room}"
        body = {"text": prompt, "rid": rid, "bootstrap_host": self.host, "bootstrap_port": self.bootstrap_port,
                "bootstrap_room": room, "sampling_params": {"max_new_tokens": 1, "temperature": 0,
                                                            "custom_params": {RETURN_ADDRESS_KEY: self.return_address()}}}
        threading.Thread(target=self._post, args=(body,), daemon=True).start()
        deadline = time.monotonic() + self.timeout
        with self.cond:
            while room not in self.messages:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
        self._abort(rid)
        if room not in self.messages:
            raise CheckFailed(f"no signature published within {self.timeout:.0f} s: a PD prefill server needs "
                              "--eldr-publish and late binding (--disaggregation-decode-allocation-policy "
                              "prefill_complete) to run a prefill no decode server takes")
        return as_signature(self.messages.pop(room))

    def _post(self, body: dict) -> None:
        try:
            http_json(self.url + "/generate", body, self.timeout * 2, self.api_key)
        except CheckFailed:
            pass  # no decode server takes the KV: the aborted request ends with an error

    def _abort(self, rid: str) -> None:
        try:
            http_json(self.url + "/abort_request", {"rid": rid}, 10, self.api_key)
        except CheckFailed:
            pass

    def close(self) -> None:
        self.sock.close()


def check_one(cold: Signature, warm: Signature) -> str | None:
    """The reason a cold/warm pair is wrong, or None."""
    for name, sig in (("cold", cold), ("warm", warm)):
        per_layer = sig.counts.sum(axis=1)
        if sig.prompt_tokens <= 0 or not len(per_layer) or per_layer.min() <= 0:
            return f"{name} signature empty (layers {sig.layers}: {per_layer.tolist()} ids)"
        if len(set(per_layer.tolist())) != 1 or per_layer[0] % sig.prompt_tokens:
            return (f"{name} signature does not count every one of the {sig.prompt_tokens} prompt tokens "
                    f"top-k times per layer (ids per layer: {per_layer.tolist()})")
    if warm.layers != cold.layers or warm.prompt_tokens != cold.prompt_tokens:
        return f"warm and cold signatures differ in layers or tokens ({warm.layers} vs {cold.layers})"
    recomputed = max(1, warm.prompt_tokens - warm.cached_tokens)
    diff = np.abs(warm.counts - cold.counts).sum(axis=1)
    if diff.max() > 2 * recomputed:
        return (f"warm signature (prefix hit, {warm.cached_tokens} cached tokens) differs from the cold one "
                f"by {diff.tolist()} ids per layer, more than near-tie swaps of {recomputed} recomputed tokens")
    for name, sig in (("cold", cold), ("warm", warm)):
        if sig.routed_experts is not None:
            reason = check_routed(sig)
            if reason:
                return f"{name}: {reason}"
    return None


def check_routed(sig: Signature) -> str | None:
    """The signature equals the counts of SGLang's own routed-experts record."""
    top_k = int(sig.counts.sum(axis=1)[0]) // sig.prompt_tokens
    per_token = sig.routed_experts.size // sig.prompt_tokens
    if per_token == 0 or per_token % top_k or sig.routed_experts.size % sig.prompt_tokens:
        return f"return_routed_experts has {sig.routed_experts.size} ids for {sig.prompt_tokens} tokens"
    routed = sig.routed_experts.reshape(sig.prompt_tokens, per_token // top_k, top_k)
    for col, layer in enumerate(sig.layers):
        expected = np.bincount(routed[:, layer].flatten(), minlength=sig.counts.shape[1])
        if not np.array_equal(expected, sig.counts[col]):
            return (f"layer {layer} differs from SGLang's return_routed_experts "
                    f"(L1 {int(np.abs(expected - sig.counts[col]).sum())})")
    return None


def run_check(url: str, n_prompts: int = 3, timeout: float = 60.0, api_key: str | None = None,
              seed: int | None = None) -> str:
    """The OK line; CheckFailed with the reason otherwise."""
    info = http_json(url + "/server_info", timeout=timeout, api_key=api_key)
    if isinstance(info.get("prefill"), list) and isinstance(info.get("decode"), list):
        # the ELDR router's /server_info: its workers' answers, by role
        raise CheckFailed("this is a router, not an engine: run the check against one of its prefill servers "
                          "(PD) or a co-located server (its /server_info lists "
                          f"{len(info['prefill'])} prefill and {len(info['decode'])} decode servers)")
    facts = server_facts(info)
    if facts["mode"] == "decode":
        raise CheckFailed("a decode server computes no signatures; check its prefill servers "
                          "(decode statistics: scrape its --eldr-metrics-port)")
    if facts["mode"] == "prefill":
        if not facts["bootstrap_port"]:
            raise CheckFailed("PD prefill server without a bootstrap port in /server_info")
        server = PrefillServer(url, int(facts["bootstrap_port"]), timeout, api_key)
    else:
        server = PlainServer(url, facts["routed_experts"], timeout, api_key)
    hits = []
    try:
        for prompt in prompts(n_prompts, seed):
            cold = server.signature(prompt)
            warm = server.signature(prompt)
            reason = check_one(cold, warm)
            if reason:
                raise CheckFailed(reason)
            hits.append(warm.cached_tokens)
    finally:
        server.close()
    layers = cold.layers
    routed = ", equal to SGLang's return_routed_experts" if cold.routed_experts is not None else ""
    hit = (f"warm == cold with {min(hits)}-{max(hits)} cached tokens" if min(hits) > 0
           else "warm == cold, but no prefix hit (radix cache off?)")
    return (f"{n_prompts} prompts x 2 on a {facts['mode'] if facts['mode'] != 'null' else 'plain'} server: "
            f"signatures of layers {layers} non-empty, {hit}{routed}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="eldr-selfcheck", description=__doc__.splitlines()[0])
    p.add_argument("url", help="the server's HTTP address, e.g. http://prefill-0:30000")
    p.add_argument("--prompts", type=int, default=3, help="prompts, each sent twice (default 3)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request (default 60)")
    p.add_argument("--api-key", default=None, help="the server's --api-key, if set")
    args = p.parse_args(argv)
    url = args.url.rstrip("/")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        p.error(f"URL must be http(s)://host:port, got {args.url!r}")
    if args.prompts < 1 or args.timeout <= 0:
        p.error("--prompts must be >= 1 and --timeout > 0")
    try:
        line = "OK: " + run_check(url, args.prompts, args.timeout, args.api_key)
        code = 0
    except CheckFailed as exc:
        line, code = f"FAIL: {exc}", 1
    print(f"eldr-selfcheck: {line}")
    return code


if __name__ == "__main__":
    sys.exit(main())
