"""The process-wide settings a run changes, each one undone by :meth:`ProcessSettings.restore`.

A trainer changes more than its own objects: signal handlers, torch's thread count, the
fused-kernel switch, the float32 matmul precision and the random generators' states. Each
change goes through one :class:`ProcessSettings`, which remembers what it replaced, so a
process that trains and then does something else (a test, a benchmark, a notebook) gets its
state back.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import torch

from hpcllm import kernels
from hpcllm.train import checkpoint


class ProcessSettings:
    """Changes to process-wide state, undone in reverse order by :meth:`restore`."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def handle_signals(self, handler: Callable[[int, Any], None], *signals: signal.Signals) -> None:
        """Install ``handler`` for ``signals``."""
        previous = {s: signal.signal(s, handler) for s in signals}
        self._undo.append(lambda: [signal.signal(s, h) for s, h in previous.items()])

    def keep_rng_state(self, device: torch.device) -> None:
        """Remember every random generator's state, to put it back on restore."""
        state = checkpoint.rng_state(device)
        self._undo.append(lambda: checkpoint.set_rng_state(state, device))

    def torch_threads(self, count: int) -> None:
        """Run torch's CPU operators on ``count`` threads."""
        previous = torch.get_num_threads()
        torch.set_num_threads(count)
        self._undo.append(lambda: torch.set_num_threads(previous))

    def fused_kernels(self, enabled: bool) -> None:
        """Switch the fused kernels on or off (:func:`hpcllm.kernels.set_enabled`)."""
        previous = kernels.enabled()
        kernels.set_enabled(enabled)
        self._undo.append(lambda: kernels.set_enabled(previous))

    def float32_matmul_precision(self, precision: str) -> None:
        """Set torch's float32 matmul precision (``high`` lets fp32 GEMMs use TF32)."""
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(precision)
        self._undo.append(lambda: torch.set_float32_matmul_precision(previous))

    def restore(self) -> None:
        """Undo every change, the latest first; a second call does nothing."""
        while self._undo:
            self._undo.pop()()
