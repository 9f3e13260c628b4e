"""The linear every layer runs, whose weight gradient a zero-bubble backward can defer.

zb-h1 (Qi et al., 2023) splits each backward in two: B computes the input gradient, which
the previous stage waits for, and W the weight gradients, which nobody waits for and which
fill the pipeline's bubbles. Layers call :func:`linear`; under :func:`deferrable_weight_grads`
it runs as an autograd function that, inside :func:`defer_weight_grads`, parks its weight
gradient's inputs instead of computing it. :func:`weight_grads` computes the parked ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F


class _WeightGradients:
    """Where zero-bubble pipelines park linear layers' weight gradients between B and W."""

    def __init__(self) -> None:
        self.deferrable = False  # forwards record what a deferred weight gradient needs
        self.queue: list[tuple[Any, ...]] | None = None  # backwards defer into it when set


# Process-wide on purpose, not a ContextVar: on a GPU autograd runs backward functions on its
# own device threads, which would not see a context variable set by the thread that called
# backward. The context managers below set and restore it around each use. It lives here, with
# the layers that read it, so the model reaches it without importing the pipeline package
# (docs/architecture.md, "Process state").
_WGRAD = _WeightGradients()


@contextlib.contextmanager
def deferrable_weight_grads(enabled: bool = True) -> Iterator[None]:
    """Run linear layers inside as autograd functions whose weight gradient can be deferred."""
    previous, _WGRAD.deferrable = _WGRAD.deferrable, enabled
    try:
        yield
    finally:
        _WGRAD.deferrable = previous


@contextlib.contextmanager
def defer_weight_grads() -> Iterator[list[tuple[Any, ...]]]:
    """Backward passes inside compute linear layers' input gradients only (zero-bubble B).

    The weight gradients' inputs collect in the yielded list; :func:`weight_grads` computes
    them later (W). Only layers run under :func:`deferrable_weight_grads` defer.
    """
    queue: list[tuple[Any, ...]] = []
    previous, _WGRAD.queue = _WGRAD.queue, queue
    try:
        yield queue
    finally:
        _WGRAD.queue = previous


def weight_grads(deferred: list[tuple[Any, ...]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Return (parameter, gradient) pairs for weight gradients parked by a deferred backward."""
    out = []
    for weight, bias, x, grad in deferred:
        flat_grad = grad.reshape(-1, grad.shape[-1])
        flat_x = x.reshape(-1, x.shape[-1]).to(grad.dtype)
        out.append((weight, flat_grad.t().matmul(flat_x).to(weight.dtype)))
        if bias is not None:
            out.append((bias, flat_grad.sum(dim=0).to(bias.dtype)))
    return out


def weight_grad_or_defer(
    weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Return (weight grad, bias grad) of a linear layer, or (None, None) when deferring them."""
    if _WGRAD.queue is not None:
        _WGRAD.queue.append((weight, bias, x, grad))
        return None, None
    grads = [g for _, g in weight_grads([(weight, bias, x, grad)])]
    return grads[0], grads[1] if bias is not None else None


class _Linear(torch.autograd.Function):
    """F.linear whose weight gradient a zero-bubble backward can defer to its W."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        # The parameters themselves, for W: under activation recomputation the saved weight
        # comes back as a recomputed alias, not the parameter its gradient belongs to.
        ctx.weight, ctx.bias = weight, bias
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_input = grad.matmul(weight.to(grad.dtype)).to(x.dtype)
        grad_weight, grad_bias = weight_grad_or_defer(ctx.weight, ctx.bias, x, grad)
        return grad_input, grad_weight, grad_bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or under :func:`deferrable_weight_grads` one whose weight grad can wait."""
    if _WGRAD.deferrable and torch.is_grad_enabled():
        return _Linear.apply(x, weight, bias)
    return F.linear(x, weight, bias)
