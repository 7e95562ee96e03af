"""Send signature messages to the router from a daemon thread.

The scheduler only does ``queue.put_nowait`` (microseconds); the thread
sends whatever is queued (counts packed as base64 arrays) over one kept-open
connection to the router:

* ``http://router:8000/eldr/signature``: one ``POST`` (a JSON list) per batch;
* ``tcp://router:PORT`` (the router's ``--signature-port``): newline-delimited
  JSON, no answers -- the cheapest hop for the router, which waits for it.

A router that is down costs dropped messages (counted, logged once a minute),
never a blocked scheduler: the router then falls back to least-loaded routing
for those requests.
"""

from __future__ import annotations

import http.client
import logging
import queue
import select
import socket
import threading
import time
import urllib.parse

import orjson

logger = logging.getLogger("eldr_sglang.publish")

_RECONNECT = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


class SignaturePublisher:
    def __init__(self, url: str, timeout: float = 2.0, max_batch: int = 64, max_queue: int = 10_000):
        self.url = url
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https", "tcp") or not parts.hostname or (
                parts.scheme == "tcp" and not parts.port):
            raise ValueError(f"publish URL must be http(s)://host:port/path or tcp://host:port, got {url!r}")
        self._scheme, self._host = parts.scheme, parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._conn: http.client.HTTPConnection | None = None
        self._sock: socket.socket | None = None
        self._poll = None  # select.poll() on _sock (set with it): sees the router closing it
        self.connections = 0  # connections opened (stays 1 while the router keeps it open)
        self.timeout = timeout
        self.max_batch = max_batch
        self.queue: queue.Queue[dict] = queue.Queue(max_queue)
        self.sent = 0
        self.dropped = 0
        self.errors = 0
        self._last_error_log = 0.0
        self._thread = threading.Thread(target=self._run, name="eldr-publisher", daemon=True)
        self._thread.start()

    def submit(self, message: dict) -> None:
        try:
            self.queue.put_nowait(message)
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            batch = [self.queue.get()]
            while len(batch) < self.max_batch:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            self._post(batch)

    # ------------------------------------------------------------ transports
    def _send_http(self, batch: list[dict]) -> None:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=self.timeout)
            self.connections += 1
        self._conn.request("POST", self._path, body=orjson.dumps(batch),
                           headers={"Content-Type": "application/json"})
        resp = self._conn.getresponse()
        resp.read()
        if resp.status >= 400:
            raise RuntimeError(f"router answered HTTP {resp.status}")

    def _send_tcp(self, batch: list[dict]) -> None:
        sock = self._sock
        # the router never writes: a readable socket means it closed or reset the connection
        # (poll, not select: no limit on the descriptor number in a busy server process)
        if sock is not None and self._poll.poll(0):
            self._close()
            sock = None
        if sock is None:
            sock = self._sock = socket.create_connection((self._host, self._port), timeout=self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._poll = select.poll()
            self._poll.register(sock, select.POLLIN)
            self.connections += 1
        sock.sendall(b"".join(orjson.dumps(m) + b"\n" for m in batch))

    def _post(self, batch: list[dict]) -> None:
        send = self._send_tcp if self._scheme == "tcp" else self._send_http
        try:
            try:
                send(batch)
            except _RECONNECT:
                self._close()  # the router closed the idle kept-open connection: one retry
                send(batch)
            self.sent += len(batch)
        except Exception as exc:
            self._close()
            self.errors += 1
            self.dropped += len(batch)
            now = time.monotonic()
            if now - self._last_error_log > 60:
                self._last_error_log = now
                logger.warning("eldr-sglang: could not publish %d signature(s) to %s: %s",
                               len(batch), self.url, exc)

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
