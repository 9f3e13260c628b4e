"""``layer_norm``: LayerNorm over the last dimension, one row per program.

Forward: a row in registers, two-pass mean and variance in fp32 (no cancellation from
E[x²] − E[x]²), the output in x's dtype; the mean and 1/std are saved. Backward (persistent):
programs walk the rows with a stride, each writing dx and one fp32 partial row of dγ and dβ,
which the host adds up. Rows wider than a program keeps in registers run the reference
(:func:`hpcllm.kernels.launch.row_fits`). Custom ops::

    hpcllm::layer_norm(x, weight, bias, eps) -> (y, mean, rstd)
    hpcllm::layer_norm_backward(dy, x, weight, bias, mean, rstd) -> (dx, dweight, dbias)

On the CPU without the interpreter: aten's ``native_layer_norm`` and its backward.
"""

# ruff: noqa: ANN001, ANN201 - Triton reads a kernel's annotations (tl.constexpr); no others.

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from hpcllm.kernels import launch
from hpcllm.kernels.jit import kernel, tl
from hpcllm.kernels.registry import BenchCase, BenchShape, FusedOp, register

# ---------------------------------------------------------------- device code


@kernel
def layer_norm_fwd(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    # Two passes over the row in registers: no cancellation from E[x^2] - E[x]^2.
    centred = tl.where(inside, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(
        y_ptr + row * n_cols + cols,
        (centred * rstd * w + b).to(y_ptr.dtype.element_ty),
        mask=inside,
    )
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@kernel
def layer_norm_bwd(
    dy_ptr,
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dw_part_ptr,
    db_part_ptr,
    n_rows,
    n_cols,
    BLOCK: tl.constexpr,
):
    """Persistent: program i takes rows i, i + P, i + 2P, ... and writes one partial row."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    for row in range(pid, n_rows, programs):
        start = tl.cast(row, tl.int64) * n_cols  # row: a Python int in the interpreter
        x = tl.load(x_ptr + start + cols, mask=inside, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + start + cols, mask=inside, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + row)
        rstd = tl.load(rstd_ptr + row)
        xhat = tl.where(inside, (x - mean) * rstd, 0.0)
        wdy = w * dy
        # dx = rstd (w dy - mean(w dy) - xhat mean(xhat w dy))
        dx = rstd * (
            wdy - tl.sum(wdy, axis=0) / n_cols - xhat * (tl.sum(xhat * wdy, axis=0) / n_cols)
        )
        tl.store(dx_ptr + start + cols, dx.to(dx_ptr.dtype.element_ty), mask=inside)
        dw += dy * xhat
        db += dy
    tl.store(dw_part_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=inside)
    tl.store(db_part_ptr + pid.to(tl.int64) * n_cols + cols, db, mask=inside)


# ---------------------------------------------------------------- launchers


def launch_forward(
    x: Tensor, weight: Tensor, bias: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Return (LayerNorm(x) in x's dtype, fp32 mean per row, fp32 1/std per row)."""
    x2 = launch.as_rows(x)
    n_rows, n_cols = x2.shape
    y = launch.new(x2.shape, x.dtype, x.device)
    mean = launch.new((n_rows,), torch.float32, x.device)
    rstd = launch.new((n_rows,), torch.float32, x.device)
    block = launch.next_power_of_2(n_cols)
    layer_norm_fwd[(n_rows,)](
        x2,
        weight.contiguous(),
        bias.contiguous(),
        y,
        mean,
        rstd,
        n_cols,
        eps,
        BLOCK=block,
        num_warps=launch.row_warps(block),
    )
    return y.view(x.shape), mean, rstd


def launch_backward(
    dy: Tensor, x: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Return (dx, dweight, dbias) of :func:`launch_forward`."""
    x2 = launch.as_rows(x)
    n_rows, n_cols = x2.shape
    dy2 = dy.reshape(x2.shape).contiguous()
    dx = launch.new(x2.shape, x2.dtype, x2.device)
    block = launch.next_power_of_2(n_cols)
    warps = launch.row_warps(block)
    programs = launch.persistent_programs(x.device, warps, n_rows)
    dw_part = launch.new((programs, n_cols), torch.float32, x2.device)
    db_part = launch.new((programs, n_cols), torch.float32, x2.device)
    layer_norm_bwd[(programs,)](
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


# ---------------------------------------------------------------- reference


def reference(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """Return LayerNorm over the last dimension."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


# ---------------------------------------------------------------- custom ops


def _torch_forward(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, ...]:
    y, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return y.to(x.dtype), mean.float().reshape(-1), rstd.float().reshape(-1)


def _fake_forward(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, ...]:
    rows = math.prod(x.shape[:-1])
    return (
        x.new_empty(x.shape),
        x.new_empty(rows, dtype=torch.float32),
        x.new_empty(rows, dtype=torch.float32),
    )


def _torch_backward(
    dy: Tensor, x: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, ...]:
    stats = (*x.shape[:-1], 1)
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        dy.to(x.dtype),
        x,
        [x.shape[-1]],
        mean.reshape(stats),
        rstd.reshape(stats),
        weight,
        bias,
        [True, True, True],
    )
    return dx, dw.to(weight.dtype), db.to(bias.dtype)


def _fake_backward(
    dy: Tensor, x: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, ...]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape), bias.new_empty(bias.shape)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple):
    x, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, bias, mean, rstd)


def _backward(ctx: torch.autograd.function.FunctionCtx, dy: Tensor, *_: Tensor) -> tuple:
    return (*torch.ops.hpcllm.layer_norm_backward(dy, *ctx.saved_tensors), None)


register(
    "layer_norm_backward",
    "(Tensor dy, Tensor x, Tensor weight, Tensor bias, Tensor mean, Tensor rstd) -> "
    "(Tensor, Tensor, Tensor)",
    triton=launch_backward,
    torch_impl=_torch_backward,
    fake=_fake_backward,
)
register(
    "layer_norm",
    "(Tensor x, Tensor weight, Tensor bias, float eps) -> (Tensor, Tensor, Tensor)",
    triton=launch_forward,
    torch_impl=_torch_forward,
    fake=_fake_forward,
    setup_context=_setup_context,
    backward=_backward,
)


# ---------------------------------------------------------------- the op


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """Return LayerNorm over the last dimension (fused: in x's dtype, statistics in fp32).

    Rows wider than the kernel keeps in registers run the reference.
    """
    return torch.ops.hpcllm.layer_norm(x, weight, bias, eps)[0]


def bench(shape: BenchShape) -> BenchCase:
    """Return GPT-2's norm of the fp32 residual stream."""
    x = shape.randn(shape.rows, shape.hidden)
    w, b = shape.randn(shape.hidden), shape.randn(shape.hidden)
    return BenchCase(
        "layer_norm",
        lambda fn, _: fn(x, w, b, 1e-5),
        [x, w, b],
        fwd_bytes=2 * 4 * shape.rows * shape.hidden,
        bwd_bytes=3 * 4 * shape.rows * shape.hidden,
    )


OP = FusedOp(
    "layer_norm", fused=layer_norm, reference=reference, supported=launch.row_fits, bench=bench
)
