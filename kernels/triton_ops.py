"""Host side of the fused ops: autograd Functions that launch :mod:`~hpcllm.kernels.triton_kernels`.

Each op takes tensors of any leading shape and works on the (rows, last dimension) matrix.
Outputs keep the input's dtype (the bias-dropout-add output takes the promoted dtype of its
inputs, as the torch reference does); weight and bias gradients are reduced in fp32 and cast to
the parameter's dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import triton

from hpcllm.kernels import reference
from hpcllm.kernels import triton_kernels as tk

# LayerNorm keeps a whole row in registers; wider rows run the torch reference.
LAYER_NORM_MAX_COLS = 16384
# Cross-entropy walks a row of the vocabulary in chunks of at most this many columns.
CE_MAX_BLOCK = 4096
# Rows per LayerNorm-backward program: the number of fp32 partial rows of dgamma and dbeta.
_LN_BWD_ROWS = 16

_poison = False


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Fill every buffer a kernel is to write with NaN first, so an element it skips shows."""
    global _poison
    previous, _poison = _poison, True
    try:
        yield
    finally:
        _poison = previous


def _new(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if _poison:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _tiles(n_rows: int, n_cols: int) -> tuple[int, int, tuple[int, int]]:
    """Return (BLOCK_R, BLOCK_C, grid) of 4096-element tiles for a pointwise kernel."""
    block_c = min(128, triton.next_power_of_2(n_cols))
    block_r = 4096 // block_c
    return block_r, block_c, (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))


def _row_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _bias_grad(part: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if part is None or bias is None else part.sum(dim=0).to(bias.dtype)


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = _rows(x)
        bias = None if bias is None else bias.contiguous()
        y = _new(x2.shape, x.dtype, x.device)
        block_r, block_c, grid = _tiles(*x2.shape)
        tk.bias_gelu_fwd[grid](
            x2,
            x2 if bias is None else bias,
            y,
            *x2.shape,
            HAS_BIAS=bias is not None,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            num_warps=4,
        )
        ctx.save_for_backward(x2, bias)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x2, bias = ctx.saved_tensors
        dy2 = dy.reshape(x2.shape).contiguous()
        dx = _new(x2.shape, x2.dtype, x2.device)
        block_r, block_c, grid = _tiles(*x2.shape)
        part = None if bias is None else _new((grid[0], x2.shape[1]), torch.float32, x2.device)
        tk.bias_gelu_bwd[grid](
            dy2,
            x2,
            x2 if bias is None else bias,
            dx,
            dx if part is None else part,
            *x2.shape,
            HAS_BIAS=bias is not None,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            num_warps=4,
        )
        return dx.view(dy.shape), _bias_grad(part, bias)


class _BiasDropoutAdd(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        residual: torch.Tensor,
        p: float,
        training: bool,
    ) -> torch.Tensor:
        x2 = _rows(x)
        bias = None if bias is None else bias.contiguous()
        out_dtype = torch.promote_types(
            x.dtype if bias is None else torch.promote_types(x.dtype, bias.dtype), residual.dtype
        )
        out = _new(x2.shape, out_dtype, x.device)
        ctx.dropout = training and p > 0
        # A seed from torch's CPU generator (no device sync) follows torch.manual_seed,
        # fork_rng and checkpoint's RNG-state restore; Philox then regenerates the mask from
        # (seed, element index) in backward, so no mask is stored.
        ctx.seed = int(torch.randint(2**31 - 1, ())) if ctx.dropout else 0
        ctx.p, ctx.scale = p, (1.0 / (1.0 - p) if p < 1 else 0.0)
        ctx.x_dtype, ctx.residual_dtype = x.dtype, residual.dtype
        ctx.save_for_backward(bias)
        block_r, block_c, grid = _tiles(*x2.shape)
        tk.bias_dropout_add_fwd[grid](
            x2,
            x2 if bias is None else bias,
            residual.reshape(x2.shape).contiguous(),
            out,
            *x2.shape,
            p,
            ctx.scale,
            ctx.seed,
            HAS_BIAS=bias is not None,
            DROPOUT=ctx.dropout,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            num_warps=4,
        )
        return out.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (bias,) = ctx.saved_tensors
        dy2 = _rows(dy)
        dx = _new(dy2.shape, ctx.x_dtype, dy.device)
        block_r, block_c, grid = _tiles(*dy2.shape)
        part = None if bias is None else _new((grid[0], dy2.shape[1]), torch.float32, dy.device)
        tk.bias_dropout_add_bwd[grid](
            dy2,
            dx,
            dx if part is None else part,
            *dy2.shape,
            ctx.p,
            ctx.scale,
            ctx.seed,
            HAS_BIAS=bias is not None,
            DROPOUT=ctx.dropout,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            num_warps=4,
        )
        return (dx.view(dy.shape), _bias_grad(part, bias), dy.to(ctx.residual_dtype), None, None)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
    ) -> torch.Tensor:
        x2 = _rows(x)
        n_rows, n_cols = x2.shape
        y = _new(x2.shape, x.dtype, x.device)
        mean = _new((n_rows,), torch.float32, x.device)
        rstd = _new((n_rows,), torch.float32, x.device)
        block = triton.next_power_of_2(n_cols)
        tk.layer_norm_fwd[(n_rows,)](
            x2,
            weight.contiguous(),
            bias.contiguous(),
            y,
            mean,
            rstd,
            n_cols,
            eps,
            BLOCK=block,
            num_warps=_row_warps(block),
        )
        ctx.save_for_backward(x2, weight, bias, mean, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, weight, bias, mean, rstd = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        dy2 = dy.reshape(x2.shape).contiguous()
        dx = _new(x2.shape, x2.dtype, x2.device)
        programs = triton.cdiv(n_rows, _LN_BWD_ROWS)
        dw_part = _new((programs, n_cols), torch.float32, x2.device)
        db_part = _new((programs, n_cols), torch.float32, x2.device)
        block = triton.next_power_of_2(n_cols)
        tk.layer_norm_bwd[(programs,)](
            dy2,
            x2,
            weight.contiguous(),
            mean,
            rstd,
            dx,
            dw_part,
            db_part,
            n_rows,
            n_cols,
            ROWS=_LN_BWD_ROWS,
            BLOCK=block,
            num_warps=_row_warps(block),
        )
        return (
            dx.view(dy.shape),
            dw_part.sum(dim=0).to(weight.dtype),
            db_part.sum(dim=0).to(bias.dtype),
            None,
        )


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int
    ) -> torch.Tensor:
        top, sumexp, target = vocab_ce_partials(logits, labels, 0, vocab_size)
        lse = top + sumexp.log()
        ctx.vocab_size = vocab_size
        ctx.save_for_backward(logits, labels, lse)
        return (lse - target).mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, labels, lse = ctx.saved_tensors
        return (
            vocab_ce_backward(logits, labels, lse, grad / labels.numel(), 0, ctx.vocab_size),
            None,
            None,
        )


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Return GeLU(x + bias) (tanh approximation) in x's dtype; backward gives dx and dbias."""
    if x.numel() == 0:
        return reference.bias_gelu(x, bias)
    return _BiasGelu.apply(x, bias)


def bias_dropout_add(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, training: bool
) -> torch.Tensor:
    """Return residual + dropout(x + bias), the mask regenerated in backward from its seed."""
    if x.numel() == 0:
        return reference.bias_dropout_add(x, bias, residual, p, training)
    return _BiasDropoutAdd.apply(x, bias, residual, p, training)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """Return LayerNorm over the last dimension in x's dtype (statistics in fp32)."""
    if x.numel() == 0 or x.shape[-1] > LAYER_NORM_MAX_COLS:
        return reference.layer_norm(x, weight, bias, eps)
    return _LayerNorm.apply(x, weight, bias, eps)


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None
) -> torch.Tensor:
    """Return the mean token cross-entropy (fp32) over the first ``vocab_size`` columns.

    The logits are read in their dtype, once forward and once backward; the gradient is
    written in their dtype, zero on padding columns.
    """
    if labels.numel() == 0:
        return reference.cross_entropy(logits, labels, vocab_size)
    rows = logits.reshape(-1, logits.shape[-1])
    vocab = logits.shape[-1] if vocab_size is None else vocab_size
    return _CrossEntropy.apply(rows, labels.reshape(-1), vocab)


def _ce_block(n_local: int) -> int:
    return min(triton.next_power_of_2(max(n_local, 1)), CE_MAX_BLOCK)


def _unit_stride(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def vocab_ce_partials(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return per-row fp32 (max, sum of exp(x - max), label's logit or 0) of a vocabulary slice.

    See :func:`hpcllm.kernels.vocab_ce_partials`.
    """
    if logits.numel() == 0:
        return reference.vocab_ce_partials(logits, labels, vocab_start, vocab_size)
    logits, labels = _unit_stride(logits), labels.contiguous()
    n_rows, n_local = logits.shape
    top, sumexp, target = (_new((n_rows,), torch.float32, logits.device) for _ in range(3))
    block = _ce_block(n_local)
    tk.ce_partials[(n_rows,)](
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
        num_warps=_row_warps(block),
    )
    return top, sumexp, target


def vocab_ce_backward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    grad: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
) -> torch.Tensor:
    """Return (exp(x - lse) - onehot(label)) * grad in the logits' dtype; 0 on padding.

    See :func:`hpcllm.kernels.vocab_ce_backward`.
    """
    if logits.numel() == 0:
        return reference.vocab_ce_backward(logits, labels, lse, grad, vocab_start, vocab_size)
    logits, labels = _unit_stride(logits), labels.contiguous()
    n_rows, n_local = logits.shape
    grad = grad.float().expand(n_rows) if grad.dim() == 0 else grad.float().contiguous()
    dx = _new((n_rows, n_local), logits.dtype, logits.device)
    block = _ce_block(n_local)
    tk.ce_backward[(n_rows,)](
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
        num_warps=_row_warps(block),
    )
    return dx
