"""``vocab_ce_backward``: the loss gradient of a vocabulary slice of the logits.

(exp(x − lse) − onehot(label)) · grad per row, in the logits' dtype, zero on padding columns:
the backward of a cross-entropy over a vocabulary split across tensor-parallel ranks, and of
the single-GPU :mod:`.cross_entropy` (``vocab_start = 0``). It keeps the logits (bf16) and the
log-sum-exp (4 bytes a row) instead of an fp32 softmax. Custom op::

    hpcllm::vocab_ce_backward(logits, labels, lse, grad, vocab_start, vocab_size) -> dlogits

On the CPU without the interpreter: the reference.
"""

# ruff: noqa: ANN001, ANN201 - Triton reads a kernel's annotations (tl.constexpr); no others.

from __future__ import annotations

import torch
from torch import Tensor

from hpcllm.kernels import launch
from hpcllm.kernels.jit import kernel, tl
from hpcllm.kernels.ops.vocab_ce_partials import column_block, slice_masks, unit_stride
from hpcllm.kernels.registry import FusedOp, register

# ---------------------------------------------------------------- device code


@kernel
def ce_backward(
    x_ptr,
    labels_ptr,
    lse_ptr,
    g_ptr,
    dx_ptr,
    row_stride,
    g_stride,
    n_local,
    vocab_start,
    vocab_size,
    BLOCK: tl.constexpr,
):
    """Write (exp(x - lse) - onehot(label)) * g for one row of a vocabulary slice; 0 on padding."""
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row * g_stride).to(tl.float32)
    local = tl.load(labels_ptr + row) - vocab_start
    for start in range(0, n_local, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_local
        real = inside & (vocab_start + cols < vocab_size)
        x = tl.load(x_ptr + row * row_stride + cols, mask=real, other=float("-inf"))
        grad = tl.exp(x.to(tl.float32) - lse) - tl.where(cols == local, 1.0, 0.0)
        grad = tl.where(real, grad * g, 0.0)
        tl.store(dx_ptr + row * n_local + cols, grad.to(dx_ptr.dtype.element_ty), mask=inside)


# ---------------------------------------------------------------- launcher


def launch_forward(
    logits: Tensor,
    labels: Tensor,
    lse: Tensor,
    grad: Tensor,
    vocab_start: int,
    vocab_size: int,
) -> Tensor:
    """Return (exp(x - lse) - onehot(label)) * grad in the logits' dtype; 0 on padding."""
    logits, labels = unit_stride(logits), labels.contiguous()
    n_rows, n_local = logits.shape
    grad = grad.float().expand(n_rows) if grad.dim() == 0 else grad.float().contiguous()
    dx = launch.new((n_rows, n_local), logits.dtype, logits.device)
    block = column_block(n_local)
    ce_backward[(n_rows,)](
        logits,
        labels,
        lse.float().contiguous(),
        grad,
        dx,
        logits.stride(0),
        grad.stride(0),
        n_local,
        vocab_start,
        vocab_size,
        BLOCK=block,
        num_warps=launch.row_warps(block),
    )
    return dx


# ---------------------------------------------------------------- reference


def reference(
    logits: Tensor,
    labels: Tensor,
    lse: Tensor,
    grad: Tensor,
    vocab_start: int,
    vocab_size: int,
) -> Tensor:
    """Return (exp(x - lse) - onehot(label)) * grad in the logits' dtype; 0 on padding."""
    padding, local_labels, inside = slice_masks(logits, labels, vocab_start, vocab_size)
    d = (logits.float() - lse.unsqueeze(-1)).exp().masked_fill(padding, 0.0)
    d.scatter_add_(-1, local_labels.unsqueeze(-1), -inside.float().unsqueeze(-1))
    return (d * grad.float().reshape(-1, 1)).to(logits.dtype)


# ---------------------------------------------------------------- custom op


def _fake(
    logits: Tensor, labels: Tensor, lse: Tensor, grad: Tensor, vocab_start: int, vocab_size: int
) -> Tensor:
    return logits.new_empty(logits.shape)


# Its name ends in _backward: a run is not noted as an op of its own (cross-entropy's backward
# runs it; a tensor-parallel run's dispatch notes it where it calls it).
register(
    "vocab_ce_backward",
    "(Tensor logits, Tensor labels, Tensor lse, Tensor grad, SymInt vocab_start, "
    "SymInt vocab_size) -> Tensor",
    triton=launch_forward,
    torch_impl=reference,
    fake=_fake,
)


# ---------------------------------------------------------------- the op


def vocab_ce_backward(
    logits: Tensor,
    labels: Tensor,
    lse: Tensor,
    grad: Tensor,
    vocab_start: int,
    vocab_size: int,
) -> Tensor:
    """Return the loss gradient of a vocabulary slice of the logits, in their dtype.

    That is (exp(x - lse) - onehot(label)) * grad per row, zero on padding columns; ``lse``
    is the per-row log-sum-exp over the whole vocabulary (see
    :func:`hpcllm.kernels.vocab_ce_partials`), ``grad`` the per-row loss gradient, shape
    (rows,) or a scalar (for a mean: g / rows).
    """
    return torch.ops.hpcllm.vocab_ce_backward(logits, labels, lse, grad, vocab_start, vocab_size)


OP = FusedOp(
    "vocab_ce_backward",
    fused=vocab_ce_backward,
    reference=reference,
    differentiable=False,
    in_compiled_graphs=True,
)
