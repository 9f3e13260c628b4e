"""``rotary``: q or k (batch, seq, heads, head_dim) rotated by its tokens' positions (RoPE).

Each half of a head pairs with the other (Hugging Face's Llama convention); a token at
position p turns pair i by the angle p × inv_freq[i], computed in fp32 in the kernel (no cos
or sin tables read), Llama 3.1's scaled frequencies included. Positions are any per token:
``offset`` + 0 … s − 1 (a KV cache's next tokens), or a tensor of shape (s,), the same for
every sequence, or (b, s), per sequence (a context-parallel rank's two chunks, positions that
restart at each document of a packed sample). Backward is the rotation back: the same kernel
with the sine negated. Custom op::

    hpcllm::rotary(x, inv_freq, positions?, offset, sign) -> y     (its backward: sign negated)

``positions`` None means ``offset`` + 0 … s − 1. On the CPU without the interpreter: the
reference.
"""

# ruff: noqa: ANN001, ANN201 - Triton reads a kernel's annotations (tl.constexpr); no others.

from __future__ import annotations

import torch
from torch import Tensor

from hpcllm.kernels import launch
from hpcllm.kernels.jit import kernel, tl
from hpcllm.kernels.registry import BenchCase, BenchShape, FusedOp, register

# ---------------------------------------------------------------- device code


@kernel
def rotary_fwd(
    x_ptr,
    f_ptr,
    p_ptr,
    y_ptr,
    n_rows,
    heads,
    seq,
    offset,
    p_stride_b,
    p_stride_s,
    sign,
    HAS_POSITIONS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Rows of a (b, s, heads, d) tensor, d = 2·HALF: each half of a head pairs with the other
    (Hugging Face's convention). Row r is token t = r // heads, sequence t // s, place t mod s;
    its position is ``p_ptr``'s at (sequence, place) with ``HAS_POSITIONS``, else
    place + offset, and its angles position × inv_freq in fp32. y1 = x1 cos - x2 sin·sign,
    y2 = x2 cos + x1 sin·sign: sign -1 rotates back (the backward)."""
    rows = tl.cast(tl.program_id(0), tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < HALF)
    token = rows // heads
    if HAS_POSITIONS:
        place = (token // seq) * p_stride_b + (token % seq) * p_stride_s
        position = tl.load(p_ptr + place, mask=rows < n_rows, other=0).to(tl.float32)
    else:
        position = (token % seq + offset).to(tl.float32)
    freq = tl.load(f_ptr + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    angle = position[:, None] * freq[None, :]
    cos, sin = tl.cos(angle), tl.sin(angle) * sign
    first = rows[:, None] * (2 * HALF) + cols[None, :]
    x1 = tl.load(x_ptr + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + first, (x1 * cos - x2 * sin).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + first + HALF, (x2 * cos + x1 * sin).to(y_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- launcher


def launch_forward(
    x: Tensor, inv_freq: Tensor, positions: Tensor | None, offset: int, sign: float
) -> Tensor:
    """Return x (b, s, heads, d) rotated by position × inv_freq (``sign`` -1: back), in x's
    dtype; positions ``positions`` (broadcast to (b, s), on x's device), or from ``offset``
    where None."""
    b, s, heads, d = x.shape
    x2 = x.contiguous().view(-1, d)
    y = launch.new(x2.shape, x.dtype, x.device)
    half = d // 2
    block_h = launch.next_power_of_2(half)
    block_r = max(1, launch.TILE // (2 * block_h))
    # A view, not a copy: (s,) positions are (b, s) ones with a batch stride of 0.
    p = x2 if positions is None else positions.expand(b, s)
    p_stride_b, p_stride_s = (0, 0) if positions is None else p.stride()
    rotary_fwd[(launch.cdiv(x2.shape[0], block_r),)](
        x2, inv_freq.float().contiguous(), p, y, x2.shape[0], heads, s, offset, p_stride_b,
        p_stride_s, sign, HAS_POSITIONS=positions is not None, HALF=half, BLOCK_R=block_r,
        BLOCK_H=block_h, num_warps=launch.POINTWISE_WARPS,
    )  # fmt: skip
    return y.view(x.shape)


# ---------------------------------------------------------------- reference


def rope_angles(inv_freq: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """Return the cosines and sines (*positions.shape, head_dim) of ``positions``:
    position × inv_freq in fp32, each frequency for both halves of a head."""
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq.float()
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def takes_positions(x: Tensor, positions: Tensor) -> bool:
    """Return whether ``positions`` gives each token of x (b, s, ...) one: shape (s,), or
    (b, s) (or (1, s)), on x's device."""
    return (
        positions.dim() in (1, 2)
        and positions.shape[-1] == x.shape[1]
        and (positions.dim() == 1 or positions.shape[0] in (1, x.shape[0]))
        and positions.device == x.device
    )


def reference(
    x: Tensor, inv_freq: Tensor, positions: int | Tensor = 0, sign: float = 1.0
) -> Tensor:
    """Return x (b, s, heads, head_dim) rotated by its positions' angles: each half of a head
    pairs with the other (Hugging Face's Llama convention). ``positions``: an int offset
    (positions offset … offset + s - 1) or a tensor (s,) or (b, s). ``sign`` -1 rotates
    back."""
    if not isinstance(positions, Tensor):
        positions = torch.arange(
            positions, positions + x.shape[1], device=inv_freq.device, dtype=torch.float32
        )
    elif not takes_positions(x, positions):
        raise ValueError(
            f"rotary positions must be (s,) or (b, s) on x's device for x of shape "
            f"{tuple(x.shape)}, got {tuple(positions.shape)} on {positions.device}"
        )
    cos, sin = rope_angles(inv_freq, positions)
    # (..., s, 1, head_dim): one angle per token, the same for every head.
    cos, sin = cos.to(x.dtype).unsqueeze(-2), sin.to(x.dtype).unsqueeze(-2)
    if sign != 1.0:
        sin = sin * sign
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


# ---------------------------------------------------------------- custom op


def _torch_impl(
    x: Tensor, inv_freq: Tensor, positions: Tensor | None, offset: int, sign: float
) -> Tensor:
    return reference(x, inv_freq, offset if positions is None else positions, sign).contiguous()


def _fake(
    x: Tensor, inv_freq: Tensor, positions: Tensor | None, offset: int, sign: float
) -> Tensor:
    return x.new_empty(x.shape)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: Tensor):
    _, inv_freq, positions, offset, sign = inputs
    ctx.save_for_backward(inv_freq, positions)
    ctx.offset, ctx.sign = offset, sign


def _backward(ctx: torch.autograd.function.FunctionCtx, dy: Tensor) -> tuple:
    # A rotation's transpose is the rotation back: the same op with the sine negated.
    inv_freq, positions = ctx.saved_tensors
    dx = torch.ops.hpcllm.rotary(dy, inv_freq, positions, ctx.offset, -ctx.sign)
    return dx, None, None, None, None


register(
    "rotary",
    "(Tensor x, Tensor inv_freq, Tensor? positions, SymInt offset, float sign) -> Tensor",
    triton=launch_forward,
    torch_impl=_torch_impl,
    fake=_fake,
    setup_context=_setup_context,
    backward=_backward,
)


# ---------------------------------------------------------------- the op


def rotary(x: Tensor, inv_freq: Tensor, positions: int | Tensor = 0) -> Tensor:
    """Return x (batch, seq, heads, head_dim) rotated by the angles position × ``inv_freq``
    (head_dim / 2 frequencies, Llama 3.1's scaled ones included): each half of a head pairs
    with the other. ``positions``: an int offset (positions offset … offset + seq - 1), or an
    integer tensor on x's device, (seq,) for every sequence alike or (batch, seq) per
    sequence. In x's dtype; the angles in fp32."""
    if isinstance(positions, Tensor):
        return torch.ops.hpcllm.rotary(x, inv_freq, positions, 0, 1.0)
    return torch.ops.hpcllm.rotary(x, inv_freq, None, positions, 1.0)


def _supported(x: Tensor, inv_freq: Tensor, positions: int | Tensor = 0) -> bool:
    fits = x.numel() > 0 and x.dim() == 4 and x.shape[-1] == 2 * inv_freq.numel()
    return fits and (not isinstance(positions, Tensor) or takes_positions(x, positions))


def bench(shape: BenchShape) -> BenchCase:
    """Return q (bf16) at the model's heads, rotated from position 0."""
    head_dim = shape.head_size
    q = shape.randn(shape.batch, shape.seq, shape.heads, head_dim, dtype=torch.bfloat16)
    # The op rotates by position × inv_freq whatever the frequencies are: drawn, like the
    # other inputs, in [0, 1), the range of a model's.
    inv_freq = torch.rand(head_dim // 2, generator=shape.generator, device=shape.device)
    return BenchCase(
        "rotary",
        lambda fn, _: fn(q, inv_freq, 0),
        [q],
        fwd_bytes=2 * 2 * shape.rows * shape.heads * head_dim,
        bwd_bytes=2 * 2 * shape.rows * shape.heads * head_dim,
    )


OP = FusedOp("rotary", fused=rotary, reference=reference, supported=_supported, bench=bench)
