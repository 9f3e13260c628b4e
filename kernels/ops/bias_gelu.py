"""``bias_gelu``: GeLU(x + bias), tanh approximation (GPT-2's MLP activation), in one pass.

Forward: tiles of the (rows, columns) matrix, the bias added and GeLU taken in fp32, written
in x's dtype. Backward (persistent): recomputes GeLU' from x and the bias, writes dx and one
fp32 partial row of dbias per program, which the host adds up. Custom ops::

    hpcllm::bias_gelu(x, bias?) -> y
    hpcllm::bias_gelu_backward(dy, x, bias?) -> (dx, dbias)    (dbias empty without a bias)

On the CPU without the interpreter: the reference, and aten's ``gelu_backward``.
"""

# ruff: noqa: ANN001, ANN201 - Triton reads a kernel's annotations (tl.constexpr); no others.

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from hpcllm.kernels import launch
from hpcllm.kernels.jit import kernel, tl
from hpcllm.kernels.launch import tile
from hpcllm.kernels.registry import BenchCase, BenchShape, FusedOp, register

# ---------------------------------------------------------------- device code


@kernel
def _gelu_sigmoid(z):
    """Return sigmoid(2u), u = sqrt(2/pi)(z + 0.044715 z^3): GeLU_tanh(z) = z * sigmoid(2u).

    The constants are literals: Triton 3.9's interpreter breaks on a global constexpr times a
    block. Clamping 2u leaves sigmoid exactly 0 or 1 in fp32 and keeps exp finite.
    """
    two_u = 1.5957691216057308 * (z + 0.044715 * z * z * z)
    return tl.sigmoid(tl.minimum(tl.maximum(two_u, -80.0), 80.0))


@kernel
def bias_gelu_fwd(
    x_ptr,
    b_ptr,
    y_ptr,
    n_rows,
    n_cols,
    HAS_BIAS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    cols, offs, mask = tile(tl.program_id(0), tl.program_id(1), n_rows, n_cols, BLOCK_R, BLOCK_C)
    z = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    y = z * _gelu_sigmoid(z)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@kernel
def bias_gelu_bwd(
    dy_ptr,
    x_ptr,
    b_ptr,
    dx_ptr,
    part_ptr,
    n_rows,
    n_cols,
    HAS_BIAS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Persistent: program (r, c) takes row tiles r, r + R, r + 2R, ... of column tile c."""
    pid_r, pid_c, programs = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for t in range(pid_r, tl.cdiv(n_rows, BLOCK_R), programs):
        cols, offs, mask = tile(t, pid_c, n_rows, n_cols, BLOCK_R, BLOCK_C)
        z = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = _gelu_sigmoid(z)
        # d/dz [z * sigmoid(2u)] = s + 2 z s (1 - s) u'(z),
        # 2u' = 2 sqrt(2/pi) (1 + 3 * 0.044715 z^2); masked lanes have dy = 0.
        dz = dy * (s + z * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * z * z))
        tl.store(dx_ptr + offs, dz.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            acc += dz
    if HAS_BIAS:
        cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        tl.store(
            part_ptr + pid_r.to(tl.int64) * n_cols + cols, tl.sum(acc, axis=0), mask=cols < n_cols
        )


# ---------------------------------------------------------------- launchers


def launch_forward(x: Tensor, bias: Tensor | None) -> Tensor:
    """Return GeLU(x + bias) (tanh approximation) in x's dtype."""
    x2 = launch.as_rows(x)
    bias = None if bias is None else bias.contiguous()
    y = launch.new(x2.shape, x.dtype, x.device)
    block_r, block_c, row_tiles, col_tiles = launch.tiles(*x2.shape)
    bias_gelu_fwd[(row_tiles, col_tiles)](
        x2,
        x2 if bias is None else bias,
        y,
        *x2.shape,
        HAS_BIAS=bias is not None,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        num_warps=launch.POINTWISE_WARPS,
    )
    return y.view(x.shape)


def launch_backward(dy: Tensor, x: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """Return (dx in x's dtype, dbias in bias's dtype or empty without a bias)."""
    x2 = launch.as_rows(x)
    bias = None if bias is None else bias.contiguous()
    dy2 = dy.reshape(x2.shape).contiguous()
    dx = launch.new(x2.shape, x2.dtype, x2.device)
    block_r, block_c, row_tiles, col_tiles = launch.tiles(*x2.shape)
    programs = launch.persistent_programs(x.device, launch.POINTWISE_WARPS, row_tiles, col_tiles)
    part = None if bias is None else launch.new((programs, x2.shape[1]), torch.float32, x2.device)
    bias_gelu_bwd[(programs, col_tiles)](
        dy2,
        x2,
        x2 if bias is None else bias,
        dx,
        dx if part is None else part,
        *x2.shape,
        HAS_BIAS=bias is not None,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        num_warps=launch.POINTWISE_WARPS,
    )
    return dx.view(x.shape), launch.bias_grad(part, bias, dx)


# ---------------------------------------------------------------- reference


def reference(x: Tensor, bias: Tensor | None) -> Tensor:
    """Return GeLU(x + bias), tanh approximation (GPT-2's ``gelu_new``)."""
    return F.gelu(x if bias is None else x + bias, approximate="tanh")


# ---------------------------------------------------------------- custom ops


def _torch_forward(x: Tensor, bias: Tensor | None) -> Tensor:
    return reference(x, bias).to(x.dtype)


def _fake_forward(x: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(x.shape)


def _torch_backward(dy: Tensor, x: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    z = x if bias is None else x + bias
    dz = torch.ops.aten.gelu_backward(dy.to(z.dtype), z, approximate="tanh")
    if bias is None:
        return dz.to(x.dtype), x.new_empty(0)
    return dz.to(x.dtype), dz.reshape(-1, dz.shape[-1]).sum(0).to(bias.dtype)


def _fake_backward(dy: Tensor, x: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), x.new_empty(0) if bias is None else bias.new_empty(bias.shape)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: Tensor):
    ctx.save_for_backward(*inputs)


def _backward(ctx: torch.autograd.function.FunctionCtx, dy: Tensor) -> tuple:
    x, bias = ctx.saved_tensors
    dx, dbias = torch.ops.hpcllm.bias_gelu_backward(dy, x, bias)
    return dx, None if bias is None else dbias


register(
    "bias_gelu_backward",
    "(Tensor dy, Tensor x, Tensor? bias) -> (Tensor, Tensor)",
    triton=launch_backward,
    torch_impl=_torch_backward,
    fake=_fake_backward,
)
register(
    "bias_gelu",
    "(Tensor x, Tensor? bias) -> Tensor",
    triton=launch_forward,
    torch_impl=_torch_forward,
    fake=_fake_forward,
    setup_context=_setup_context,
    backward=_backward,
)


# ---------------------------------------------------------------- the op


def bias_gelu(x: Tensor, bias: Tensor | None) -> Tensor:
    """Return GeLU(x + bias), tanh approximation (GPT-2's ``gelu_new``).

    Fused, the output is in x's dtype (under autocast the matmul's, which the next matmul
    would cast it to anyway).
    """
    return torch.ops.hpcllm.bias_gelu(x, bias)


def bench(shape: BenchShape) -> BenchCase:
    """Return the MLP's activation: bf16 matmul output at the MLP's width, an fp32 bias."""
    fc = shape.randn(shape.rows, shape.ffn, dtype=torch.bfloat16)
    bias = shape.randn(shape.ffn, scale=0.1)
    return BenchCase(
        "bias_gelu",
        lambda fn, _: fn(fc, bias),
        [fc, bias],
        fwd_bytes=2 * 2 * shape.rows * shape.ffn,
        bwd_bytes=3 * 2 * shape.rows * shape.ffn,
    )


OP = FusedOp("bias_gelu", fused=bias_gelu, reference=reference, bench=bench)
