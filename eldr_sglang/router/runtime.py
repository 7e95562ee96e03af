"""What a serving router process changes as it runs: the draining flag, the worker
session and the signature return address (both set at start), and its background
tasks."""

from __future__ import annotations

import asyncio
from typing import Coroutine, Optional

import aiohttp


class Runtime:
    def __init__(self) -> None:
        self.draining = False
        self.session: Optional[aiohttp.ClientSession] = None
        self.return_address: Optional[str] = None  # tcp://host:port once the stream listens
        self.tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """Run ``coro`` in the background; cancelled by :meth:`cancel_tasks`."""
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def cancel_tasks(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
