"""How long a callable takes on a device: the one clock of ``model.fused_kernels: auto``
(:mod:`~hpcllm.kernels.choice`), ``hpcllm bench kernels`` and ``hpcllm bench step``.

A figure is the median milliseconds of ``iters`` runs after ``warmup`` untimed ones (which
compile, autotune and fill the allocator's cache). On a GPU each run is timed with CUDA
events, after a write of a buffer larger than any L2 cache, so that every run starts cold, as
an op does in a training step, where the other ops' data went through the cache in between.
The runs are queued back to back and the device is waited for once, at the end, so an
interval is the device's time unless the host falls behind. On the CPU, perf_counter around
each run. Auto and bench kernels take the clock as a parameter, so that a test hands them one
fake clock and checks that they give the same time for the same op and shape.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

WARMUP = 10  # untimed runs before the timed ones: auto's, bench kernels'
ITERS = 20  # timed runs whose median is auto's figure (bench kernels: its --iters)
L2_FLUSH_BYTES = 256 << 20  # more than any GPU's L2 cache (50 MB on an H100 and an H200)


class Clock:
    """Times callables on a device: the median of ``iters`` runs after ``warmup`` (on a GPU:
    CUDA events, each run after an L2 flush where ``flush_l2``; on the CPU: perf_counter)."""

    def __init__(self, warmup: int = WARMUP, iters: int = ITERS, flush_l2: bool = True) -> None:
        self.warmup, self.iters, self.flush_l2 = warmup, iters, flush_l2

    def median_ms(self, fn: Callable[[], object], device: torch.device) -> float:
        """Return the median milliseconds of ``fn`` on ``device``: ``iters`` runs after
        ``warmup`` untimed ones."""
        for _ in range(self.warmup):
            fn()
        return statistics.median(self.runs_ms(fn, device, self.iters))

    def runs_ms(self, fn: Callable[[], object], device: torch.device, runs: int) -> list[float]:
        """Return the milliseconds of each of ``runs`` calls of ``fn`` on ``device``, back to
        back, none untimed."""
        if device.type != "cuda":
            times = []
            for _ in range(runs):
                began = time.perf_counter()
                fn()
                times.append((time.perf_counter() - began) * 1e3)
            return times
        with torch.cuda.device(device):
            flush = (
                torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
                if self.flush_l2
                else None
            )
            events = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(runs)
            ]
            for start, end in events:
                if flush is not None:  # outside the interval
                    flush.zero_()
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in events]
