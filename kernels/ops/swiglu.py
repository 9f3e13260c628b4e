"""``swiglu``: SiLU(gate) · up, the SwiGLU MLP's activation (Shazeer, 2020), in one pass.

Forward: tiles of the (rows, columns) matrices, in the promoted dtype of gate and up. Backward
recomputes SiLU from the gate and writes both gradients. Custom ops::

    hpcllm::swiglu(gate, up) -> y
    hpcllm::swiglu_backward(dy, gate, up) -> (dgate, dup)

On the CPU without the interpreter: the same formulas in torch, in fp32.
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
def swiglu_fwd(g_ptr, u_ptr, y_ptr, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """y = SiLU(g) · u = g · sigmoid(g) · u."""
    _, offs, mask = tile(tl.program_id(0), tl.program_id(1), n_rows, n_cols, BLOCK_R, BLOCK_C)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), mask=mask)


@kernel
def swiglu_bwd(
    dy_ptr,
    g_ptr,
    u_ptr,
    dg_ptr,
    du_ptr,
    n_rows,
    n_cols,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """dg = dy · u · σ(g) (1 + g (1 - σ(g))), du = dy · g σ(g); SiLU recomputed from g."""
    _, offs, mask = tile(tl.program_id(0), tl.program_id(1), n_rows, n_cols, BLOCK_R, BLOCK_C)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(
        dg_ptr + offs, (dy * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty), mask=mask
    )
    tl.store(du_ptr + offs, (dy * g * s).to(du_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- launchers


def launch_forward(gate: Tensor, up: Tensor) -> Tensor:
    """Return SiLU(gate) · up in their promoted dtype."""
    g2, u2 = launch.as_rows(gate), launch.as_rows(up)
    y = launch.new(g2.shape, torch.promote_types(gate.dtype, up.dtype), gate.device)
    block_r, block_c, row_tiles, col_tiles = launch.tiles(*g2.shape)
    swiglu_fwd[(row_tiles, col_tiles)](
        g2, u2, y, *g2.shape, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=launch.POINTWISE_WARPS,
    )  # fmt: skip
    return y.view(gate.shape)


def launch_backward(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """Return (dgate in gate's dtype, dup in up's) of :func:`launch_forward`."""
    g2, u2 = launch.as_rows(gate), launch.as_rows(up)
    dy2 = dy.reshape(g2.shape).contiguous()
    dg = launch.new(g2.shape, gate.dtype, gate.device)
    du = launch.new(g2.shape, up.dtype, up.device)
    block_r, block_c, row_tiles, col_tiles = launch.tiles(*g2.shape)
    swiglu_bwd[(row_tiles, col_tiles)](
        dy2, g2, u2, dg, du, *g2.shape, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=launch.POINTWISE_WARPS,
    )  # fmt: skip
    return dg.view(gate.shape), du.view(up.shape)


# ---------------------------------------------------------------- reference


def reference(gate: Tensor, up: Tensor) -> Tensor:
    """Return SiLU(gate) · up, the SwiGLU MLP's activation (Shazeer, 2020)."""
    return F.silu(gate) * up


# ---------------------------------------------------------------- custom ops


def _torch_forward(gate: Tensor, up: Tensor) -> Tensor:
    g = gate.float()
    return (F.silu(g) * up.float()).to(torch.promote_types(gate.dtype, up.dtype))


def _fake_forward(gate: Tensor, up: Tensor) -> Tensor:
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


def _torch_backward(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    g, u, d = gate.float(), up.float(), dy.float()
    s = torch.sigmoid(g)
    return (d * u * s * (1 + g * (1 - s))).to(gate.dtype), (d * g * s).to(up.dtype)


def _fake_backward(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: Tensor):
    ctx.save_for_backward(*inputs)


def _backward(ctx: torch.autograd.function.FunctionCtx, dy: Tensor) -> tuple:
    return torch.ops.hpcllm.swiglu_backward(dy, *ctx.saved_tensors)


register(
    "swiglu_backward",
    "(Tensor dy, Tensor gate, Tensor up) -> (Tensor, Tensor)",
    triton=launch_backward,
    torch_impl=_torch_backward,
    fake=_fake_backward,
)
register(
    "swiglu",
    "(Tensor gate, Tensor up) -> Tensor",
    triton=launch_forward,
    torch_impl=_torch_forward,
    fake=_fake_forward,
    setup_context=_setup_context,
    backward=_backward,
)


# ---------------------------------------------------------------- the op


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """Return SiLU(gate) · up, the SwiGLU MLP's activation, in their promoted dtype."""
    return torch.ops.hpcllm.swiglu(gate, up)


def _same_shape(gate: Tensor, up: Tensor) -> bool:
    return gate.numel() > 0 and gate.shape == up.shape


def bench(shape: BenchShape) -> BenchCase:
    """Return Llama's MLP activation: bf16 gate and up at the MLP's width."""
    gate = shape.randn(shape.rows, shape.ffn, dtype=torch.bfloat16)
    up = shape.randn(shape.rows, shape.ffn, dtype=torch.bfloat16)
    return BenchCase(
        "swiglu",
        lambda fn, _: fn(gate, up),
        [gate, up],
        fwd_bytes=3 * 2 * shape.rows * shape.ffn,  # read gate and up, write y
        bwd_bytes=5 * 2 * shape.rows * shape.ffn,  # read dy, gate, up; write dgate, dup
    )


OP = FusedOp("swiglu", fused=swiglu, reference=reference, supported=_same_shape, bench=bench)
