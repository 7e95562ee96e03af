"""The ``tcp`` signature transport (a router's ``--signature-port``): JSON lines
(``sha256=<hex> `` first when signed) on one kept-open connection, no answers. The
router never writes, so a readable socket means it closed the connection: the next
send reconnects. The listener is an asyncio server of
:class:`~eldr_sglang.router.signals.stream.SignatureStream` connections (the port's
connection rules)."""

from __future__ import annotations

import asyncio
import select
import socket
from typing import Any, Optional

from eldr_sglang.core import wire
from eldr_sglang.transports.registry import Destination, register_transport


class TcpSender:
    def __init__(self, dest: Destination, timeout: float, key: Optional[bytes]) -> None:
        self.dest, self.timeout, self.key = dest, timeout, key
        self.sock: Optional[socket.socket] = None
        self.poll = None  # select.poll() on sock (set with it): sees the router closing it
        self.connects = 0

    def send(self, batch: list[dict]) -> None:
        # poll, not select: no limit on the descriptor number in a busy server process
        if self.sock is not None and self.poll.poll(0):
            self.close()
        if self.sock is None:
            sock = socket.create_connection((self.dest.host, self.dest.port), timeout=self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.poll = select.poll()
            self.poll.register(sock, select.POLLIN)
            self.sock = sock
            self.connects += 1
        self.sock.sendall(wire.stream_lines(batch, self.key))

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class TcpListener:
    def __init__(self, intake: Any) -> None:
        self.intake = intake
        self.server: Optional[asyncio.AbstractServer] = None
        self.port: Optional[int] = None

    async def start(self, host: str, port: int) -> int:
        from eldr_sglang.router.signals.stream import SignatureStream

        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: SignatureStream(self.intake), host, port)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    def address(self, host: str) -> str:
        return f"tcp://{host}:{self.port}"

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def wait_closed(self) -> None:
        if self.server is not None:
            await self.server.wait_closed()


register_transport("tcp", TcpSender, TcpListener, example="tcp://host:port")
