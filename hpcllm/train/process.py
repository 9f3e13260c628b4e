"""The process-wide settings a run changes, each one undone by :meth:`ProcessSettings.restore`.

A trainer changes more than its own objects: signal handlers, torch's thread count, the
fused-kernel switch, the float32 matmul precision and the random generators (the default
ones and the tensor-parallel stream). Each change goes through one :class:`ProcessSettings`,
which remembers what it replaced, so a process that trains and then does something else (a
test, a benchmark, a notebook) gets its state back.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import torch

from hpcllm import kernels
from hpcllm.parallel.random import set_tp_stream_state, tp_stream_state
from hpcllm.train import checkpoint


class ProcessSettings:
    """Changes to process-wide state, undone in reverse order by :meth:`restore`."""

    def __init__(self) -> None:
        self._undo: list[tuple[str, Callable[[], None]]] = []

    def handle_signals(self, handler: Callable[[int, Any], None], *signals: signal.Signals) -> None:
        """Install ``handler`` for ``signals``."""
        previous = {s: signal.signal(s, handler) for s in signals}

        def undo() -> None:
            for sig, old in previous.items():
                signal.signal(sig, old)

        self._undo.append(("signals", undo))

    def keep_rng_state(self, device: torch.device) -> None:
        """Remember every random generator's state, to put it back on restore."""
        state, stream = checkpoint.rng_state(device), tp_stream_state()

        def undo() -> None:
            checkpoint.set_rng_state(state, device)
            set_tp_stream_state(stream)

        self._undo.append(("rng", undo))

    def torch_threads(self, count: int) -> None:
        """Run torch's CPU operators on ``count`` threads."""
        previous = torch.get_num_threads()
        torch.set_num_threads(count)
        self._undo.append(("threads", lambda: torch.set_num_threads(previous)))

    def fused_kernels(
        self, enabled: bool, choose: bool = False, compiled_reference: bool = False
    ) -> None:
        """Switch the fused kernels on or off (:func:`hpcllm.kernels.set_enabled`).

        With ``choose`` each op runs whichever of its Triton kernel and eager torch
        reference is faster at each shape (timed at its first call); with
        ``compiled_reference`` an op inside a compiled graph is left to inductor.
        """
        previous = kernels.enabled(), kernels.choosing(), kernels.compiled_reference()
        kernels.set_enabled(enabled, choose=choose, compiled_reference=compiled_reference)
        self._undo.append(
            (
                "kernels",
                lambda: kernels.set_enabled(
                    previous[0], choose=previous[1], compiled_reference=previous[2]
                ),
            )
        )

    def float32_matmul_precision(self, precision: str) -> None:
        """Set torch's float32 matmul precision (``high`` lets fp32 GEMMs use TF32)."""
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(precision)
        self._undo.append(("tf32", lambda: torch.set_float32_matmul_precision(previous)))

    def restore(self, only: str | None = None) -> None:
        """Undo every change (or those of one kind, e.g. ``"signals"``), the latest first.

        What is undone is forgotten, so a second call does nothing.
        """
        keep = []
        for kind, undo in reversed(self._undo):
            if only is None or kind == only:
                undo()
            else:
                keep.append((kind, undo))
        self._undo = keep[::-1]
