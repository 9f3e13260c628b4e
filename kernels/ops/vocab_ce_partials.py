"""``vocab_ce_partials``: per-row (max, sum of exp, label's logit) of a vocabulary slice.

The forward half of a cross-entropy whose vocabulary is split across tensor-parallel ranks
(docs/kernels.md): one pass over a rank's slice of the logits, a running max and a sum
rescaled whenever it grows (online softmax), the label's logit picked up on the way; the
caller combines the ranks' partials with two all-reduces. The single-GPU cross-entropy is this
with ``vocab_start = 0``. Rows of any length are walked in chunks of at most
:data:`CE_MAX_BLOCK` columns. Custom op (no backward: :mod:`.vocab_ce_backward` is the
gradient)::

    hpcllm::vocab_ce_partials(logits, labels, vocab_start, vocab_size) -> (max, sumexp, target)

On the CPU without the interpreter: the reference.
"""

# ruff: noqa: ANN001, ANN201 - Triton reads a kernel's annotations (tl.constexpr); no others.

from __future__ import annotations

import torch
from torch import Tensor

from hpcllm.kernels import launch
from hpcllm.kernels.jit import kernel, tl
from hpcllm.kernels.registry import FusedOp, register

# Cross-entropy walks a row of the vocabulary in chunks of at most this many columns.
CE_MAX_BLOCK = 4096

# ---------------------------------------------------------------- device code


@kernel
def ce_partials(
    x_ptr,
    labels_ptr,
    max_ptr,
    sumexp_ptr,
    target_ptr,
    row_stride,
    n_local,
    vocab_start,
    vocab_size,
    BLOCK: tl.constexpr,
):
    """Per row of a vocabulary slice: max, sum of exp(x - max), and the label's logit.

    One pass over the row keeps a running max and a sum rescaled whenever the max grows
    (per lane; the lanes are merged at the end). Columns at or past ``vocab_size`` are padding
    and take no part. A slice with no real column gives max -inf and sum 0.
    """
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * row_stride
    local = tl.load(labels_ptr + row) - vocab_start
    top = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    # The label's logit is picked up on the way (a masked scalar load would be the direct
    # route, but the interpreter rejects those); rows whose label is elsewhere get 0.
    hit = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_local, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        real = (cols < n_local) & (vocab_start + cols < vocab_size)
        x = tl.load(base + cols, mask=real, other=float("-inf")).to(tl.float32)
        hit += tl.where((cols == local) & real, x, 0.0)
        new_top = tl.maximum(top, x)
        # Lanes that have seen only padding keep max -inf; shift them by 0, not by -inf.
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        acc = acc * tl.exp(top - shift) + tl.exp(x - shift)
        top = new_top
    row_max = tl.max(top, axis=0)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    tl.store(max_ptr + row, row_max)
    tl.store(sumexp_ptr + row, tl.sum(acc * tl.exp(top - shift), axis=0))
    tl.store(target_ptr + row, tl.sum(hit, axis=0))


# ---------------------------------------------------------------- launcher


def column_block(n_local: int) -> int:
    """Return the columns a cross-entropy program takes at a time from a row of ``n_local``."""
    return min(launch.next_power_of_2(max(n_local, 1)), CE_MAX_BLOCK)


def unit_stride(logits: Tensor) -> Tensor:
    """Return ``logits`` with unit column stride (a view's row stride is kept)."""
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def launch_forward(
    logits: Tensor, labels: Tensor, vocab_start: int, vocab_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Return per-row fp32 (max, sum of exp(x - max), label's logit or 0) of a vocabulary
    slice (rows, local)."""
    logits, labels = unit_stride(logits), labels.contiguous()
    n_rows, n_local = logits.shape
    top, sumexp, target = (launch.new((n_rows,), torch.float32, logits.device) for _ in range(3))
    block = column_block(n_local)
    ce_partials[(n_rows,)](
        logits,
        labels,
        top,
        sumexp,
        target,
        logits.stride(0),
        n_local,
        vocab_start,
        vocab_size,
        BLOCK=block,
        num_warps=launch.row_warps(block),
    )
    return top, sumexp, target


# ---------------------------------------------------------------- reference


def slice_masks(
    logits: Tensor, labels: Tensor, vocab_start: int, vocab_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Return (padding columns, label's column in the slice or 0, whether the slice holds it)."""
    local = logits.shape[-1]
    padding = torch.arange(vocab_start, vocab_start + local, device=logits.device) >= vocab_size
    inside = (labels >= vocab_start) & (labels < vocab_start + local)
    return padding, (labels - vocab_start).masked_fill(~inside, 0), inside


def reference(
    logits: Tensor, labels: Tensor, vocab_start: int, vocab_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Return per-row (max, sum of exp(x - max), label's logit or 0) of a vocabulary slice."""
    padding, local_labels, inside = slice_masks(logits, labels, vocab_start, vocab_size)
    x = logits.float().masked_fill(padding, float("-inf"))
    top = x.max(dim=-1).values
    sumexp = (x - top.masked_fill(top == float("-inf"), 0.0).unsqueeze(-1)).exp().sum(dim=-1)
    target = x.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
    return top, sumexp, target


# ---------------------------------------------------------------- custom op


def _fake(logits: Tensor, labels: Tensor, vocab_start: int, vocab_size: int) -> tuple[Tensor, ...]:
    return tuple(logits.new_empty(logits.shape[0], dtype=torch.float32) for _ in range(3))


register(
    "vocab_ce_partials",
    "(Tensor logits, Tensor labels, SymInt vocab_start, SymInt vocab_size) -> "
    "(Tensor, Tensor, Tensor)",
    triton=launch_forward,
    torch_impl=reference,
    fake=_fake,
)


# ---------------------------------------------------------------- the op


def vocab_ce_partials(
    logits: Tensor, labels: Tensor, vocab_start: int, vocab_size: int
) -> tuple[Tensor, Tensor, Tensor]:
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
    top, sumexp, target = torch.ops.hpcllm.vocab_ce_partials(
        logits, labels, vocab_start, vocab_size
    )
    return top, sumexp, target


# A reduction over the vocabulary that inductor has no neighbour to fuse with: auto keeps the
# kernel inside compiled graphs (docs/kernels.md).
OP = FusedOp(
    "vocab_ce_partials",
    fused=vocab_ce_partials,
    reference=reference,
    differentiable=False,
    in_compiled_graphs=True,
)
