"""Fused operators (imported as ``hpcllm.kernels``), one dispatch point per op.

The model calls these functions and never an implementation. Each runs its Triton kernel
(:mod:`~hpcllm.kernels.triton_ops`) when fused kernels are enabled (:func:`set_enabled`) and its
tensor is on a CUDA device, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``,
for tests); otherwise it runs the torch reference (:mod:`~hpcllm.kernels.reference`), which is
also the kernels' test oracle. Triton is imported only when a kernel first runs, so this
package imports without it.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from hpcllm.errors import UserError
from hpcllm.kernels import reference

_enabled = False


@functools.cache
def triton_available() -> bool:
    """Return whether Triton imports."""
    try:
        import triton  # noqa: F401
    except Exception:  # missing, or an install that fails on import: either way, no kernels
        return False
    return True


def interpreting() -> bool:
    """Return whether ``TRITON_INTERPRET`` asks for Triton's interpreter (kernels on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_fused(setting: str, device: torch.device) -> bool:
    """Return whether fused kernels run for ``model.fused_kernels`` on ``device``.

    ``auto`` fuses on CUDA GPUs that Triton supports (compute capability 8.0 and up) when
    Triton imports; ``on`` raises a UserError where it cannot fuse instead of silently running
    the references.
    """
    if setting == "off":
        return False
    if setting == "auto":
        return (
            device.type == "cuda"
            and triton_available()
            and torch.cuda.get_device_capability(device) >= (8, 0)
        )
    if setting != "on":
        raise UserError(f"model.fused_kernels must be auto, on or off, got {setting!r}")
    if not triton_available():
        raise UserError(
            "model.fused_kernels: on needs Triton, which does not import here "
            "(pip install triton); use auto or off"
        )
    if device.type != "cuda" and not interpreting():
        raise UserError(
            f"model.fused_kernels: on needs a CUDA device, not {device.type} (or "
            "TRITON_INTERPRET=1 to run the kernels in Triton's interpreter); "
            "use auto or off"
        )
    return True


def set_enabled(flag: bool) -> None:
    """Make every op run its Triton kernel (where its tensors allow) or its torch reference."""
    global _enabled
    if flag and not triton_available():
        raise UserError(
            "fused kernels need Triton, which does not import here (pip install triton)"
        )
    _enabled = flag


def enabled() -> bool:
    """Return whether fused kernels are enabled."""
    return _enabled


def _fused(x: torch.Tensor) -> bool:
    return _enabled and (x.is_cuda or (x.device.type == "cpu" and interpreting()))


def _ops() -> ModuleType:
    from hpcllm.kernels import triton_ops

    return triton_ops


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Return GeLU(x + bias), tanh approximation (GPT-2's ``gelu_new``).

    Fused, the output is in x's dtype (under autocast the matmul's, which the next matmul
    would cast it to anyway).
    """
    if _fused(x):
        return _ops().bias_gelu(x, bias)
    return reference.bias_gelu(x, bias)


def bias_dropout_add(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, training: bool
) -> torch.Tensor:
    """Return residual + dropout(x + bias); with p = 0 or not training, residual + x + bias."""
    if _fused(x):
        return _ops().bias_dropout_add(x, bias, residual, p, training)
    return reference.bias_dropout_add(x, bias, residual, p, training)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """Return LayerNorm over the last dimension (fused: in x's dtype, statistics in fp32)."""
    if _fused(x):
        return _ops().layer_norm(x, weight, bias, eps)
    return reference.layer_norm(x, weight, bias, eps)


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None
) -> torch.Tensor:
    """Return the mean token cross-entropy, computed in fp32 whatever the logits' dtype.

    With ``vocab_size``, columns at or past it are padding and excluded: passing the padded
    logits this way saves the copy that slicing them would cost in backward.
    """
    if _fused(logits):
        return _ops().cross_entropy(logits, labels, vocab_size)
    return reference.cross_entropy(logits, labels, vocab_size)


def vocab_ce_partials(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return per-row fp32 ``(max, sumexp, target)`` of a vocabulary slice of the logits.

    ``logits`` (rows, local) holds columns ``[vocab_start, vocab_start + local)`` of the
    vocabulary; columns at or past ``vocab_size`` are padding and excluded. ``max`` is the
    slice's largest logit (-inf if it has no real column), ``sumexp`` the sum of
    exp(x - max) over the slice, ``target`` the label's logit if the slice holds the label,
    else 0. One pass over the logits. Across the tensor-parallel group::

        M = all_reduce_max(max)
        total, target = all_reduce_sum(stack([sumexp * exp(max - M), target]))
        lse = M + log(total);  loss = lse - target
    """
    if _fused(logits):
        return _ops().vocab_ce_partials(logits, labels, vocab_start, vocab_size)
    return reference.vocab_ce_partials(logits, labels, vocab_start, vocab_size)


def vocab_ce_backward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    grad: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
) -> torch.Tensor:
    """Return the loss gradient of a vocabulary slice of the logits, in their dtype.

    That is (exp(x - lse) - onehot(label)) * grad per row, zero on padding columns; ``lse``
    is the per-row log-sum-exp over the whole vocabulary (see :func:`vocab_ce_partials`),
    ``grad`` the per-row loss gradient, shape (rows,) or a scalar (for a mean: g / rows).
    """
    if _fused(logits):
        return _ops().vocab_ce_backward(logits, labels, lse, grad, vocab_start, vocab_size)
    return reference.vocab_ce_backward(logits, labels, lse, grad, vocab_start, vocab_size)
