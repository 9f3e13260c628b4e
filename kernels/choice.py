"""Which implementation of an op runs under ``model.fused_kernels: auto``: the faster, measured.

The Triton kernels cannot win everywhere (a shape too small to fill the GPU, an op torch does
in one kernel already). So the first call of an op at a given signature (argument shapes,
dtypes, devices and the other arguments) outside compiled graphs times forward + backward of
the Triton custom op and of the eager torch reference (what ``off`` runs there), on copies of
its arguments, and the faster one runs at that signature from then on: ``auto`` is, op by op,
the better of ``on`` and ``off`` (nearly: for the two bias ops the reference timed adds the
bias, which ``off`` leaves to the matmul's epilogue). Inside compiled graphs ``auto`` leaves
the ops to inductor without timing them (:func:`hpcllm.kernels.set_enabled`). Until 2026-11
the alternative was the reference under ``torch.compile``, each op its own compiled function:
alone on the GPU it often beat the Triton op, but called op by op from an eager step its
guards and launches cost the host more than they saved, and a gpt2-124m eager step ran slower
under ``auto`` than with the kernels off (64.3 against 55.6 ms/step on an H100:
docs/kernels.md). It times with a :class:`~hpcllm.kernels.timing.Clock`, the clock of
``hpcllm bench kernels`` (the median of CUDA-event timings after warm-ups, each run after an
L2 flush), which is a parameter, so that a
test checks the choosing with a fake one.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from hpcllm.kernels import reference
from hpcllm.kernels.ops import DIFFERENTIABLE  # the ops timed with their backward
from hpcllm.kernels.timing import Clock


def signature(args: tuple[Any, ...]) -> tuple[Hashable, ...]:
    """Return what identifies a call for the cache: each tensor's shape, dtype and device."""
    return tuple(
        (tuple(a.shape), a.dtype, a.device.type) if isinstance(a, torch.Tensor) else a for a in args
    )


def _copies(args: tuple[Any, ...], differentiable: bool) -> tuple[list[Any], list[torch.Tensor]]:
    """Return (copies of the arguments, the copies to differentiate)."""
    copies = [
        a.detach().clone().requires_grad_(differentiable and a.is_floating_point())
        if isinstance(a, torch.Tensor)
        else a
        for a in args
    ]
    return copies, [a for a in copies if isinstance(a, torch.Tensor) and a.requires_grad]


def _forward_backward(op: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> Callable[[], Any]:
    """Return a call of ``fn`` on copies of ``args``, with backward where ``op`` has one."""
    differentiable = op in DIFFERENTIABLE
    copies, leaves = _copies(args, differentiable)

    def run() -> Any:
        out = fn(*copies)
        if differentiable:
            return torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)
        return out

    return run


class Chooser:
    """Picks, per op and signature, the faster of the Triton op and the eager reference."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock or Clock()
        self.choices: dict[tuple[Hashable, ...], str] = {}
        # (op, *signature) -> (Triton ms, torch ms) as timed, for reports
        self.timings: dict[tuple[Hashable, ...], tuple[float, float]] = {}
        self._torch: dict[tuple[str, str], Callable[..., Any]] = {}

    def torch_impl(self, op: str, device: torch.device) -> Callable[..., Any]:
        """Return the torch implementation ``op`` runs on ``device`` where torch is chosen.

        The eager reference, what ``model.fused_kernels: off`` runs (the module docstring says
        why not a compiled one).
        """
        return self._torch.setdefault((op, device.type), getattr(reference, op))

    def choose(self, op: str, triton_op: Callable[..., Any], args: tuple[Any, ...]) -> str:
        """Return "triton" or "torch" for ``op`` on ``args``, timing both at a new signature."""
        key = (op, *signature(args))
        if key not in self.choices:
            self.timings[key] = self._measure(op, triton_op, args)
            triton_ms, torch_ms = self.timings[key]
            self.choices[key] = "triton" if triton_ms <= torch_ms else "torch"
        return self.choices[key]

    def _measure(
        self, op: str, triton_op: Callable[..., Any], args: tuple[Any, ...]
    ) -> tuple[float, float]:
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        # The timing runs leave the caller's random streams and autograd state as they were:
        # no draw shifts a later dropout mask, and an enclosing activation checkpoint's
        # saved-tensor hooks do not see these graphs.
        with (
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        ):
            triton_ms = self.clock.median_ms(_forward_backward(op, triton_op, args), device)
            torch_run = _forward_backward(op, self.torch_impl(op, device), args)
            torch_ms = self.clock.median_ms(torch_run, device)
        return triton_ms, torch_ms
