"""The profiler window: ``train.profile_steps`` as the CUDA profiler's start and stop.

Nsight Systems run with ``--capture-range=cudaProfilerApi`` records only between
``cudaProfilerStart`` and ``cudaProfilerStop``. ``A:B`` captures steps A to B-1, counted from
0: the window opens when A steps are done and closes when B are. Off the GPU it does nothing,
but its bounds are still sync points, so an asynchronous segment never runs across them.
"""

from __future__ import annotations

import torch

from hpcllm.config import parse_profile_steps


class ProfilerWindow:
    """Starts and stops the CUDA profiler at ``train.profile_steps``' bounds."""

    def __init__(self, profile_steps: str | None, device: torch.device) -> None:
        self.bounds = parse_profile_steps(profile_steps) if profile_steps else None
        self.on_gpu = device.type == "cuda"

    def before_step(self, step: int) -> None:
        """Open the window when ``step`` steps done is its start."""
        if self.on_gpu and self.bounds is not None and step == self.bounds[0]:
            torch.cuda.profiler.start()

    def after_step(self, step: int) -> None:
        """Close the window when ``step`` steps done is its end."""
        if self.on_gpu and self.bounds is not None and step == self.bounds[1]:
            torch.cuda.profiler.stop()

    def next_due(self, step: int, last_step: int) -> int:
        """Return the next bound after ``step`` (the last step when none is left)."""
        later = [bound for bound in self.bounds or () if bound > step]
        return min([last_step, *later])
