"""``rms_norm``: RMSNorm over the last dimension (Llama's norm), one row per program.

Forward: the fp32 sum of squares of a row in registers, the normalised row rounded to x's
dtype (as the reference rounds it) times the weight, in the promoted dtype of x and the
weight; 1/rms saved. Backward (persistent, as LayerNorm's): dx and one fp32 partial row of dγ
per program. Rows wider than a program keeps in registers run the reference. Custom ops::

    hpcllm::rms_norm(x, weight, eps) -> (y, rstd)
    hpcllm::rms_norm_backward(dy, x, weight, rstd) -> (dx, dweight)

On the CPU without the interpreter: the same formulas in torch.
"""

# ruff: noqa: ANN001, ANN201 - Triton reads a kernel's annotations (tl.constexpr); no others.

from __future__ import annotations

import math

import torch
from torch import Tensor

from hpcllm.kernels import launch
from hpcllm.kernels.jit import kernel, tl
from hpcllm.kernels.registry import BenchCase, BenchShape, FusedOp, register

# ---------------------------------------------------------------- device code


@kernel
def rms_norm_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr):
    """One row per program: rstd = 1/sqrt(mean(x²) + eps) in fp32; y = w · (x·rstd rounded to
    x's dtype), as the reference rounds the normalised row before the weight."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    raw = tl.load(x_ptr + row * n_cols + cols, mask=inside, other=0.0)
    x = raw.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = (x * rstd).to(raw.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=inside)
    tl.store(rstd_ptr + row, rstd)


@kernel
def rms_norm_bwd(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, n_rows, n_cols, BLOCK: tl.constexpr
):
    """Persistent: program i takes rows i, i + P, ... and writes one partial row of dw.

    With n = x·rstd: dx = rstd (w dy - n mean(n w dy)), dw = Σ dy n (n rounded as forward)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for row in range(pid, n_rows, programs):
        start = tl.cast(row, tl.int64) * n_cols  # row: a Python int in the interpreter
        raw = tl.load(x_ptr + start + cols, mask=inside, other=0.0)
        x = raw.to(tl.float32)
        dy = tl.load(dy_ptr + start + cols, mask=inside, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        n = x * rstd
        wdy = w * dy
        dx = rstd * (wdy - n * (tl.sum(n * wdy, axis=0) / n_cols))
        tl.store(dx_ptr + start + cols, dx.to(dx_ptr.dtype.element_ty), mask=inside)
        dw += dy * n.to(raw.dtype).to(tl.float32)
    tl.store(dw_part_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=inside)


# ---------------------------------------------------------------- launchers


def launch_forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Return (RMSNorm(x) in the promoted dtype of x and the weight, fp32 1/rms per row)."""
    x2 = launch.as_rows(x)
    n_rows, n_cols = x2.shape
    y = launch.new(x2.shape, torch.promote_types(x.dtype, weight.dtype), x.device)
    rstd = launch.new((n_rows,), torch.float32, x.device)
    block = launch.next_power_of_2(n_cols)
    rms_norm_fwd[(n_rows,)](
        x2, weight.contiguous(), y, rstd, n_cols, eps, BLOCK=block,
        num_warps=launch.row_warps(block),
    )  # fmt: skip
    return y.view(x.shape), rstd


def launch_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """Return (dx in x's dtype, dweight in the weight's) of :func:`launch_forward`."""
    x2 = launch.as_rows(x)
    n_rows, n_cols = x2.shape
    dy2 = dy.reshape(x2.shape).contiguous()
    dx = launch.new(x2.shape, x2.dtype, x2.device)
    block = launch.next_power_of_2(n_cols)
    warps = launch.row_warps(block)
    programs = launch.persistent_programs(x.device, warps, n_rows)
    dw_part = launch.new((programs, n_cols), torch.float32, x2.device)
    rms_norm_bwd[(programs,)](
        dy2, x2, weight.contiguous(), rstd, dx, dw_part, n_rows, n_cols, BLOCK=block,
        num_warps=warps,
    )  # fmt: skip
    return dx.view(x.shape), dw_part.sum(dim=0).to(weight.dtype)


# ---------------------------------------------------------------- reference


def reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Return RMSNorm over the last dimension: weight · (x / sqrt(mean(x²) + eps)), the
    statistics in fp32, the normalised row rounded to x's dtype before the weight."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


# ---------------------------------------------------------------- custom ops


def _torch_forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1) + eps)
    y = weight * (x32 * rstd.unsqueeze(-1)).to(x.dtype)
    return y, rstd.reshape(-1)


def _fake_forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    dtype = torch.promote_types(x.dtype, weight.dtype)
    rows = math.prod(x.shape[:-1])
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(rows, dtype=torch.float32)


def _torch_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    x32, dy32 = x.float(), dy.float()
    r = rstd.reshape(*x.shape[:-1], 1)
    n = x32 * r
    wdy = weight.float() * dy32
    dx = r * (wdy - n * (n * wdy).mean(-1, keepdim=True))
    dw = (dy32 * n.to(x.dtype).float()).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


def _fake_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple):
    x, weight, _ = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx: torch.autograd.function.FunctionCtx, dy: Tensor, _: Tensor) -> tuple:
    return (*torch.ops.hpcllm.rms_norm_backward(dy, *ctx.saved_tensors), None)


register(
    "rms_norm_backward",
    "(Tensor dy, Tensor x, Tensor weight, Tensor rstd) -> (Tensor, Tensor)",
    triton=launch_backward,
    torch_impl=_torch_backward,
    fake=_fake_backward,
)
register(
    "rms_norm",
    "(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)",
    triton=launch_forward,
    torch_impl=_torch_forward,
    fake=_fake_forward,
    setup_context=_setup_context,
    backward=_backward,
)


# ---------------------------------------------------------------- the op


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Return RMSNorm over the last dimension: weight · x / sqrt(mean(x²) + eps), statistics
    in fp32, in the promoted dtype of x and the weight (Llama's norm).

    Rows wider than the kernel keeps in registers run the reference.
    """
    return torch.ops.hpcllm.rms_norm(x, weight, eps)[0]


def bench(shape: BenchShape) -> BenchCase:
    """Return Llama's norm of the fp32 residual stream."""
    x, w = shape.randn(shape.rows, shape.hidden), shape.randn(shape.hidden)
    return BenchCase(
        "rms_norm",
        lambda fn, _: fn(x, w, 1e-5),
        [x, w],
        fwd_bytes=2 * 4 * shape.rows * shape.hidden,
        bwd_bytes=3 * 4 * shape.rows * shape.hidden,
    )


OP = FusedOp(
    "rms_norm", fused=rms_norm, reference=reference, supported=launch.row_fits, bench=bench
)
