"""Host side of the fused ops: functions that launch :mod:`~hpcllm.kernels.triton_kernels`.

These are the CUDA (and, under ``TRITON_INTERPRET=1``, CPU) implementations of the custom ops
in :mod:`~hpcllm.kernels.custom_ops`; autograd lives there. Each function takes tensors of any
leading shape and works on the (rows, last dimension) matrix. Outputs keep the input's dtype
(the bias-dropout-add output takes the promoted dtype of its inputs, as the torch reference
does); weight and bias gradients are reduced in fp32 and cast to the parameter's dtype.

Launch shapes, chosen for Hopper (an H100 has 132 SMs, up to 64 resident warps each):

- Pointwise forward kernels: tiles of 4096 elements, as wide as 1024 columns (a power of two
  that divides the row where one does: 768 → 256, 3072 → 1024), so a warp reads long
  contiguous runs; 4 warps each.
- Backward kernels that reduce over rows (bias, LayerNorm weight and bias) are persistent:
  about ``_RESIDENT_WARPS`` warps' worth of programs per SM, each walking the rows with a
  stride, so the fp32 partial-sum buffer has a few rows per SM (gpt2-124m's 4h = 3072: 352
  partial rows, 4 MB, next to 100 MB of activations) and one small torch sum finishes it.
- Under the interpreter a persistent grid has :data:`INTERPRETER_PROGRAMS` programs (per
  column tile), so the tests' programs walk several rows each.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import triton

from hpcllm.kernels import triton_kernels as tk

# Cross-entropy walks a row of the vocabulary in chunks of at most this many columns.
CE_MAX_BLOCK = 4096
# Programs per column tile of a persistent grid under Triton's interpreter.
INTERPRETER_PROGRAMS = 3
# Elements per pointwise tile and the widest column block.
_TILE = 4096
_MAX_BLOCK_C = 1024
# Warps a persistent backward keeps resident per SM (half of Hopper's 64): enough loads in
# flight to cover memory latency while each program still walks many rows.
_RESIDENT_WARPS = 32
_POINTWISE_WARPS = 4

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


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Return the CUDA device's SM count (132 on an H100 SXM)."""
    return _cuda_sms(torch.cuda.current_device() if device.index is None else device.index)


def _col_block(n_cols: int) -> int:
    """Return the column block: the widest power of two up to 1024 that divides the row."""
    block = _MAX_BLOCK_C
    while block >= 128 and n_cols % block:
        block //= 2
    return block if block >= 128 else min(_MAX_BLOCK_C, triton.next_power_of_2(n_cols))


def _tiles(n_rows: int, n_cols: int) -> tuple[int, int, int, int]:
    """Return (BLOCK_R, BLOCK_C, row tiles, column tiles) of a pointwise kernel's tiling."""
    block_c = _col_block(n_cols)
    block_r = max(1, _TILE // block_c)
    return block_r, block_c, triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c)


def _persistent_programs(device: torch.device, warps: int, work: int, columns: int = 1) -> int:
    """Return how many programs per column tile a persistent kernel launches (≤ ``work``)."""
    if device.type != "cuda":
        return max(1, min(work, INTERPRETER_PROGRAMS))
    resident = sm_count(device) * max(1, _RESIDENT_WARPS // warps)
    return max(1, min(work, triton.cdiv(resident, columns)))


def _row_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _bias_grad(part: torch.Tensor | None, bias: torch.Tensor | None, like: torch.Tensor):
    """Return the summed bias gradient, or an empty tensor where there is no bias."""
    if bias is None or part is None:
        return like.new_empty(0)
    return part.sum(dim=0).to(bias.dtype)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Return GeLU(x + bias) (tanh approximation) in x's dtype."""
    x2 = _rows(x)
    bias = None if bias is None else bias.contiguous()
    y = _new(x2.shape, x.dtype, x.device)
    block_r, block_c, row_tiles, col_tiles = _tiles(*x2.shape)
    tk.bias_gelu_fwd[(row_tiles, col_tiles)](
        x2,
        x2 if bias is None else bias,
        y,
        *x2.shape,
        HAS_BIAS=bias is not None,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        num_warps=_POINTWISE_WARPS,
    )
    return y.view(x.shape)


def bias_gelu_backward(
    dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (dx in x's dtype, dbias in bias's dtype or empty without a bias)."""
    x2 = _rows(x)
    bias = None if bias is None else bias.contiguous()
    dy2 = dy.reshape(x2.shape).contiguous()
    dx = _new(x2.shape, x2.dtype, x2.device)
    block_r, block_c, row_tiles, col_tiles = _tiles(*x2.shape)
    programs = _persistent_programs(x.device, _POINTWISE_WARPS, row_tiles, col_tiles)
    part = None if bias is None else _new((programs, x2.shape[1]), torch.float32, x2.device)
    tk.bias_gelu_bwd[(programs, col_tiles)](
        dy2,
        x2,
        x2 if bias is None else bias,
        dx,
        dx if part is None else part,
        *x2.shape,
        HAS_BIAS=bias is not None,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        num_warps=_POINTWISE_WARPS,
    )
    return dx.view(x.shape), _bias_grad(part, bias, dx)


def _dropout_scale(p: float) -> float:
    return 1.0 / (1.0 - p) if p < 1 else 0.0


def bias_dropout_add(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    seed: int | None,
) -> torch.Tensor:
    """Return residual + dropout(x + bias); no dropout where ``seed`` is None.

    Philox draws element i's number from (seed, i), so backward regenerates the mask.
    """
    x2 = _rows(x)
    bias = None if bias is None else bias.contiguous()
    out_dtype = torch.promote_types(
        x.dtype if bias is None else torch.promote_types(x.dtype, bias.dtype), residual.dtype
    )
    out = _new(x2.shape, out_dtype, x.device)
    block_r, block_c, row_tiles, col_tiles = _tiles(*x2.shape)
    tk.bias_dropout_add_fwd[(row_tiles, col_tiles)](
        x2,
        x2 if bias is None else bias,
        residual.reshape(x2.shape).contiguous(),
        out,
        *x2.shape,
        p,
        _dropout_scale(p),
        0 if seed is None else seed,
        HAS_BIAS=bias is not None,
        DROPOUT=seed is not None,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        num_warps=_POINTWISE_WARPS,
    )
    return out.view(x.shape)


def bias_dropout_add_backward(
    dy: torch.Tensor,
    bias: torch.Tensor | None,
    p: float,
    seed: int | None,
    x_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (dx in ``x_dtype``, dbias or empty without a bias); the residual's is dy."""
    dy2 = _rows(dy)
    dx = _new(dy2.shape, x_dtype, dy.device)
    block_r, block_c, row_tiles, col_tiles = _tiles(*dy2.shape)
    programs = _persistent_programs(dy.device, _POINTWISE_WARPS, row_tiles, col_tiles)
    part = None if bias is None else _new((programs, dy2.shape[1]), torch.float32, dy.device)
    tk.bias_dropout_add_bwd[(programs, col_tiles)](
        dy2,
        dx,
        dx if part is None else part,
        *dy2.shape,
        p,
        _dropout_scale(p),
        0 if seed is None else seed,
        HAS_BIAS=bias is not None,
        DROPOUT=seed is not None,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        num_warps=_POINTWISE_WARPS,
    )
    return dx.view(dy.shape), _bias_grad(part, bias, dx)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (LayerNorm(x) in x's dtype, fp32 mean per row, fp32 1/std per row)."""
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
    return y.view(x.shape), mean, rstd


def layer_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (dx, dweight, dbias) of :func:`layer_norm`."""
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    dy2 = dy.reshape(x2.shape).contiguous()
    dx = _new(x2.shape, x2.dtype, x2.device)
    block = triton.next_power_of_2(n_cols)
    warps = _row_warps(block)
    programs = _persistent_programs(x.device, warps, n_rows)
    dw_part = _new((programs, n_cols), torch.float32, x2.device)
    db_part = _new((programs, n_cols), torch.float32, x2.device)
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
        BLOCK=block,
        num_warps=warps,
    )
    return (
        dx.view(x.shape),
        dw_part.sum(dim=0).to(weight.dtype),
        db_part.sum(dim=0).to(bias.dtype),
    )


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (mean cross-entropy, per-row log-sum-exp), fp32, of (rows, columns) logits."""
    top, sumexp, target = vocab_ce_partials(logits, labels, 0, vocab_size)
    lse = top + sumexp.log()
    return (lse - target).mean(), lse


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


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (RMSNorm(x) in the promoted dtype of x and the weight, fp32 1/rms per row)."""
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    y = _new(x2.shape, torch.promote_types(x.dtype, weight.dtype), x.device)
    rstd = _new((n_rows,), torch.float32, x.device)
    block = triton.next_power_of_2(n_cols)
    tk.rms_norm_fwd[(n_rows,)](
        x2, weight.contiguous(), y, rstd, n_cols, eps, BLOCK=block, num_warps=_row_warps(block)
    )
    return y.view(x.shape), rstd


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (dx in x's dtype, dweight in the weight's) of :func:`rms_norm`."""
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    dy2 = dy.reshape(x2.shape).contiguous()
    dx = _new(x2.shape, x2.dtype, x2.device)
    block = triton.next_power_of_2(n_cols)
    warps = _row_warps(block)
    programs = _persistent_programs(x.device, warps, n_rows)
    dw_part = _new((programs, n_cols), torch.float32, x2.device)
    tk.rms_norm_bwd[(programs,)](
        dy2, x2, weight.contiguous(), rstd, dx, dw_part, n_rows, n_cols, BLOCK=block,
        num_warps=warps,
    )  # fmt: skip
    return dx.view(x.shape), dw_part.sum(dim=0).to(weight.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Return SiLU(gate) · up in their promoted dtype."""
    g2, u2 = _rows(gate), _rows(up)
    y = _new(g2.shape, torch.promote_types(gate.dtype, up.dtype), gate.device)
    block_r, block_c, row_tiles, col_tiles = _tiles(*g2.shape)
    tk.swiglu_fwd[(row_tiles, col_tiles)](
        g2, u2, y, *g2.shape, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=_POINTWISE_WARPS
    )
    return y.view(gate.shape)


def swiglu_backward(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (dgate in gate's dtype, dup in up's) of :func:`swiglu`."""
    g2, u2 = _rows(gate), _rows(up)
    dy2 = dy.reshape(g2.shape).contiguous()
    dg = _new(g2.shape, gate.dtype, gate.device)
    du = _new(g2.shape, up.dtype, up.device)
    block_r, block_c, row_tiles, col_tiles = _tiles(*g2.shape)
    tk.swiglu_bwd[(row_tiles, col_tiles)](
        dy2, g2, u2, dg, du, *g2.shape, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=_POINTWISE_WARPS,
    )  # fmt: skip
    return dg.view(gate.shape), du.view(up.shape)


def rotary(x: torch.Tensor, inv_freq: torch.Tensor, offset: int, sign: float) -> torch.Tensor:
    """Return x (b, s, heads, d) rotated by position × inv_freq (``sign`` -1: back), in x's
    dtype; positions start at ``offset``."""
    b, s, heads, d = x.shape
    x2 = x.contiguous().view(-1, d)
    y = _new(x2.shape, x.dtype, x.device)
    half = d // 2
    block_h = triton.next_power_of_2(half)
    block_r = max(1, _TILE // (2 * block_h))
    tk.rotary_fwd[(triton.cdiv(x2.shape[0], block_r),)](
        x2, inv_freq.float().contiguous(), y, x2.shape[0], heads, s, offset, sign, HALF=half,
        BLOCK_R=block_r, BLOCK_H=block_h, num_warps=_POINTWISE_WARPS,
    )  # fmt: skip
    return y.view(x.shape)
