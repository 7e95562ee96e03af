"""The decode batch a server runs, for the router's load poll (``GET /eldr/batch`` on
``--eldr-metrics-port``).

Per decode step, on the device and without a host sync: an exponential moving
average of which experts the step activated (``usage[layer, expert]``: the share of
recent steps that used the expert; ``1 - usage`` is the probability that the live
batch leaves it unused, what the router's state-aware price needs), and a ring of
the last ``window`` steps' distinct experts (summed over MoE layers). On the host:
each step's batch size, KV tokens and forward time (host time of the forward call on
CPU, where the forward is synchronous; CUDA events on a GPU, read when the report
is served). The router fits its step-time law per server from these samples
(``eldr_sglang.router.signals.engine_reports``).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Optional

import torch

DECAY = 1.0 / 32  # an expert's usage forgets a step after ~32 steps
WINDOW = 256  # step samples kept


class BatchReport:
    """Usage EMA and step samples of one decode server (see the module docstring)."""

    def __init__(self, num_layers: int, num_experts: int, device: torch.device | str,
                 window: int = WINDOW, decay: float = DECAY) -> None:
        self.usage = torch.zeros((num_layers, num_experts), dtype=torch.float32, device=device)
        self.unique = torch.zeros(window, dtype=torch.int64, device=device)
        self.window, self.decay = window, decay
        self.batch = [0] * window
        self.kv_tokens = [0] * window
        self.seconds: list[float] = [math.nan] * window
        self.events: list[Optional[tuple]] = [None] * window  # GPU: (start, end) CUDA events
        self.steps = 0
        self.last_step = time.monotonic()
        self.lock = threading.Lock()  # the report is read from the metrics server's thread

    def timer(self):
        """A started timer for one forward: a host clock, or a CUDA event pair on a GPU."""
        if self.usage.is_cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return start
        return time.perf_counter()

    def step(self, active: torch.Tensor, unique: torch.Tensor, batch: int, kv_tokens: int, timer) -> None:
        """One decode step: ``active`` [layers, experts] bool, ``unique`` a device scalar."""
        with self.lock:
            i = self.steps % self.window
            self.usage.mul_(1.0 - self.decay).add_(active.to(torch.float32), alpha=self.decay)
            self.unique[i].copy_(unique, non_blocking=True)
            self.batch[i], self.kv_tokens[i] = int(batch), int(kv_tokens)
            if isinstance(timer, float):
                self.seconds[i], self.events[i] = time.perf_counter() - timer, None
            else:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.seconds[i], self.events[i] = math.nan, (timer, end)
            self.steps += 1
            self.last_step = time.monotonic()

    def snapshot(self, last: Optional[int] = None) -> dict:
        """JSON-able: steps so far, seconds since the last one (``idle_s``: a server that
        stopped stepping runs no batch), the usage EMA [layers][experts] and the last
        samples, oldest first (a GPU sample whose end event has not completed yet is left out)."""
        with self.lock:
            n = min(self.steps, self.window, last or self.window)
            order = [(self.steps - n + j) % self.window for j in range(n)]
            usage = self.usage.detach().cpu()
            unique = self.unique.detach().cpu().tolist()
            samples = []
            for i in order:
                seconds = self.seconds[i]
                ev = self.events[i]
                if ev is not None:
                    if not ev[1].query():
                        continue
                    seconds = ev[0].elapsed_time(ev[1]) / 1e3
                samples.append({"batch_size": self.batch[i], "unique_experts": int(unique[i]),
                                "kv_tokens": self.kv_tokens[i], "seconds": round(seconds, 6)})
            return {"steps": self.steps, "idle_s": round(time.monotonic() - self.last_step, 3),
                    "decay": self.decay, "batch_size": self.batch[order[-1]] if order else 0,
                    "usage": [[round(float(x), 5) for x in row] for row in usage], "samples": samples}
