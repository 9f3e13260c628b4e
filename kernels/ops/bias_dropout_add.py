"""``bias_dropout_add``: residual + dropout(x + bias), in one pass; the mask is not stored.

Forward draws one seed from torch's CPU generator (:func:`dropout_seed`); the kernels feed
(seed, element index) to Triton's Philox (``tl.rand``), so the backward regenerates the
forward's mask, writes dx and one fp32 partial row of dbias per program (persistent); the
residual's gradient is dy itself. Drawing on the CPU costs no device sync and makes the mask
follow ``torch.manual_seed``, ``fork_rng`` and activation checkpointing's RNG restore.
Custom ops::

    hpcllm::bias_dropout_add(x, bias?, residual, p, seed?) -> out
    hpcllm::bias_dropout_add_backward(dy, bias?, p, seed?, x_dtype) -> (dx, dbias)

``seed`` is a 0-d int64 CPU tensor, None for no dropout; dbias is empty without a bias. The
output takes the promoted dtype of the inputs, as the reference does. On the CPU without the
interpreter the mask comes from a CPU generator seeded with ``seed``: another mask than the
kernel's for the same seed, equally reproducible.
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


@kernel(do_not_specialize=["seed"])  # a new seed every call: no recompiles
def bias_dropout_add_fwd(
    x_ptr,
    b_ptr,
    r_ptr,
    out_ptr,
    n_rows,
    n_cols,
    p,
    scale,
    seed,
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    cols, offs, mask = tile(tl.program_id(0), tl.program_id(1), n_rows, n_cols, BLOCK_R, BLOCK_C)
    z = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    if DROPOUT:
        # The element's flat index is its Philox counter: backward regenerates the same mask.
        z = tl.where(tl.rand(seed, offs) >= p, z * scale, 0.0)
    out = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32) + z
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@kernel(do_not_specialize=["seed"])  # a new seed every call: no recompiles
def bias_dropout_add_bwd(
    dy_ptr,
    dx_ptr,
    part_ptr,
    n_rows,
    n_cols,
    p,
    scale,
    seed,
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Persistent, as bias-GeLU's backward; the mask is regenerated from (seed, index)."""
    pid_r, pid_c, programs = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for t in range(pid_r, tl.cdiv(n_rows, BLOCK_R), programs):
        cols, offs, mask = tile(t, pid_c, n_rows, n_cols, BLOCK_R, BLOCK_C)
        dz = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if DROPOUT:
            dz = tl.where(tl.rand(seed, offs) >= p, dz * scale, 0.0)
        tl.store(dx_ptr + offs, dz.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            acc += dz
    if HAS_BIAS:
        cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        tl.store(
            part_ptr + pid_r.to(tl.int64) * n_cols + cols, tl.sum(acc, axis=0), mask=cols < n_cols
        )


# ---------------------------------------------------------------- launchers


def _scale(p: float) -> float:
    return 1.0 / (1.0 - p) if p < 1 else 0.0


def _out_dtype(x: Tensor, bias: Tensor | None, residual: Tensor) -> torch.dtype:
    dtype = x.dtype if bias is None else torch.promote_types(x.dtype, bias.dtype)
    return torch.promote_types(dtype, residual.dtype)


def _seed(seed: Tensor | None) -> int | None:
    return None if seed is None else int(seed)


def launch_forward(
    x: Tensor, bias: Tensor | None, residual: Tensor, p: float, seed: Tensor | None
) -> Tensor:
    """Return residual + dropout(x + bias); no dropout where ``seed`` is None.

    Philox draws element i's number from (seed, i), so backward regenerates the mask.
    """
    x2 = launch.as_rows(x)
    bias = None if bias is None else bias.contiguous()
    out = launch.new(x2.shape, _out_dtype(x, bias, residual), x.device)
    block_r, block_c, row_tiles, col_tiles = launch.tiles(*x2.shape)
    seed_value = _seed(seed)
    bias_dropout_add_fwd[(row_tiles, col_tiles)](
        x2,
        x2 if bias is None else bias,
        residual.reshape(x2.shape).contiguous(),
        out,
        *x2.shape,
        p,
        _scale(p),
        0 if seed_value is None else seed_value,
        HAS_BIAS=bias is not None,
        DROPOUT=seed_value is not None,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        num_warps=launch.POINTWISE_WARPS,
    )
    return out.view(x.shape)


def launch_backward(
    dy: Tensor, bias: Tensor | None, p: float, seed: Tensor | None, x_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Return (dx in ``x_dtype``, dbias or empty without a bias); the residual's is dy."""
    dy2 = launch.as_rows(dy)
    dx = launch.new(dy2.shape, x_dtype, dy.device)
    block_r, block_c, row_tiles, col_tiles = launch.tiles(*dy2.shape)
    programs = launch.persistent_programs(dy.device, launch.POINTWISE_WARPS, row_tiles, col_tiles)
    part = None if bias is None else launch.new((programs, dy2.shape[1]), torch.float32, dy.device)
    seed_value = _seed(seed)
    bias_dropout_add_bwd[(programs, col_tiles)](
        dy2,
        dx,
        dx if part is None else part,
        *dy2.shape,
        p,
        _scale(p),
        0 if seed_value is None else seed_value,
        HAS_BIAS=bias is not None,
        DROPOUT=seed_value is not None,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        num_warps=launch.POINTWISE_WARPS,
    )
    return dx.view(dy.shape), launch.bias_grad(part, bias, dx)


# ---------------------------------------------------------------- reference


def reference(x: Tensor, bias: Tensor | None, residual: Tensor, p: float, training: bool) -> Tensor:
    """Return residual + dropout(x + bias)."""
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=p, training=training)


# ---------------------------------------------------------------- custom ops


def _cpu_keep(shape: torch.Size, p: float, seed: int) -> Tensor:
    """Return the CPU implementation's dropout mask: True where an element is kept."""
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) >= p


def _torch_forward(
    x: Tensor, bias: Tensor | None, residual: Tensor, p: float, seed: Tensor | None
) -> Tensor:
    z = x if bias is None else x + bias
    if seed is not None:
        z = torch.where(_cpu_keep(z.shape, p, int(seed)), z * _scale(p), 0.0)
    return (residual + z).to(_out_dtype(x, bias, residual))


def _fake_forward(
    x: Tensor, bias: Tensor | None, residual: Tensor, p: float, seed: Tensor | None
) -> Tensor:
    return x.new_empty(x.shape, dtype=_out_dtype(x, bias, residual))


def _torch_backward(
    dy: Tensor, bias: Tensor | None, p: float, seed: Tensor | None, x_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    dz = dy if seed is None else torch.where(_cpu_keep(dy.shape, p, int(seed)), dy * _scale(p), 0.0)
    if bias is None:
        return dz.to(x_dtype, copy=True), dy.new_empty(0, dtype=x_dtype)
    return dz.to(x_dtype, copy=True), dz.reshape(-1, dz.shape[-1]).sum(0).to(bias.dtype)


def _fake_backward(
    dy: Tensor, bias: Tensor | None, p: float, seed: Tensor | None, x_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    dbias = dy.new_empty(0, dtype=x_dtype) if bias is None else bias.new_empty(bias.shape)
    return dy.new_empty(dy.shape, dtype=x_dtype), dbias


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: Tensor) -> None:
    x, bias, residual, p, seed = inputs
    ctx.save_for_backward(bias, seed)
    ctx.p, ctx.x_dtype, ctx.residual_dtype = p, x.dtype, residual.dtype


def _backward(ctx: torch.autograd.function.FunctionCtx, dy: Tensor) -> tuple:
    bias, seed = ctx.saved_tensors
    dx, dbias = torch.ops.hpcllm.bias_dropout_add_backward(dy, bias, ctx.p, seed, ctx.x_dtype)
    return dx, None if bias is None else dbias, dy.to(ctx.residual_dtype), None, None


register(
    "bias_dropout_add_backward",
    "(Tensor dy, Tensor? bias, float p, Tensor? seed, ScalarType x_dtype) -> (Tensor, Tensor)",
    triton=launch_backward,
    torch_impl=_torch_backward,
    fake=_fake_backward,
)
register(
    "bias_dropout_add",
    "(Tensor x, Tensor? bias, Tensor residual, float p, Tensor? seed) -> Tensor",
    triton=launch_forward,
    torch_impl=_torch_forward,
    fake=_fake_forward,
    setup_context=_setup_context,
    backward=_backward,
)


# ---------------------------------------------------------------- the op


def dropout_seed(p: float, training: bool) -> Tensor | None:
    """Return a dropout seed from torch's CPU generator (0-d int64), or None if nothing drops."""
    if not training or p <= 0:
        return None
    return torch.randint(2**31 - 1, (), dtype=torch.int64)


def bias_dropout_add(
    x: Tensor, bias: Tensor | None, residual: Tensor, p: float, training: bool
) -> Tensor:
    """Return residual + dropout(x + bias); with p = 0 or not training, residual + x + bias."""
    return torch.ops.hpcllm.bias_dropout_add(x, bias, residual, p, dropout_seed(p, training))


def bench(shape: BenchShape) -> BenchCase:
    """Return the residual add: bf16 attention or MLP output, an fp32 bias and residual;
    timed at p = 0.1, checked at p = 0 (the masks come from different generators)."""
    x = shape.randn(shape.rows, shape.hidden, dtype=torch.bfloat16)
    bias = shape.randn(shape.hidden, scale=0.1)
    residual = shape.randn(shape.rows, shape.hidden)
    return BenchCase(
        "bias_dropout_add",
        lambda fn, checking: fn(x, bias, residual, 0.0 if checking else 0.1, True),
        [x, bias, residual],
        # x bf16 and residual fp32 in, fp32 out; backward reads dy (fp32), writes dx.
        fwd_bytes=(2 + 4 + 4) * shape.rows * shape.hidden,
        bwd_bytes=(4 + 2) * shape.rows * shape.hidden,
    )


OP = FusedOp("bias_dropout_add", fused=bias_dropout_add, reference=reference, bench=bench)
