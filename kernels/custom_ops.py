"""The fused ops as torch custom ops (namespace ``hpcllm``), so torch.compile traces through them.

Each differentiable op is a forward op and a backward op, joined by ``register_autograd``, so
AOTAutograd traces backward as well; ``register_fake`` gives every op its output shapes and
dtypes. The ops::

    hpcllm::bias_gelu(x, bias?) -> y
    hpcllm::bias_gelu_backward(dy, x, bias?) -> (dx, dbias)
    hpcllm::bias_dropout_add(x, bias?, residual, p, seed?) -> out
    hpcllm::bias_dropout_add_backward(dy, bias?, p, seed?, x_dtype) -> (dx, dbias)
    hpcllm::layer_norm(x, weight, bias, eps) -> (y, mean, rstd)
    hpcllm::layer_norm_backward(dy, x, weight, bias, mean, rstd) -> (dx, dweight, dbias)
    hpcllm::cross_entropy(logits, labels, vocab_size) -> (loss, lse)
    hpcllm::vocab_ce_partials(logits, labels, vocab_start, vocab_size) -> (max, sumexp, target)
    hpcllm::vocab_ce_backward(logits, labels, lse, grad, vocab_start, vocab_size) -> dlogits
    hpcllm::rms_norm(x, weight, eps) -> (y, rstd)
    hpcllm::rms_norm_backward(dy, x, weight, rstd) -> (dx, dweight)
    hpcllm::swiglu(gate, up) -> y
    hpcllm::swiglu_backward(dy, gate, up) -> (dgate, dup)
    hpcllm::rotary(x, inv_freq, offset, sign) -> y      (its backward: sign negated)

A backward op returns an empty ``dbias`` where there is no bias (a custom op cannot return
None). Dropout is functional: ``seed`` is a 0-d int64 CPU tensor drawn outside the op from
torch's CPU generator (:func:`bias_dropout_add` here draws it), so ``torch.manual_seed``,
``fork_rng`` and activation checkpointing's RNG restore reproduce the mask, and reading it costs
no device sync; None means no dropout. Backward regenerates the mask from the seed.

Implementations: on CUDA the Triton kernels (:mod:`~hpcllm.kernels.triton_ops`, imported when
first run). On the CPU, the Triton kernels too when ``TRITON_INTERPRET`` is set (decided per
call: that is how the tests run the kernels without a GPU), else torch (aten's own primitives:
``gelu_backward``, ``native_layer_norm[_backward]``, the references). Off CUDA the dropout
mask comes from a CPU generator seeded with ``seed``, not from Triton's Philox: a different mask
than the kernel's for the same seed, equally reproducible. The public functions at the bottom
take the dispatch's arguments (:mod:`hpcllm.kernels`) and call the ops.
"""

import math
from typing import Any

import torch
from torch import Tensor

from hpcllm.kernels import reference
from hpcllm.kernels.interpreter import interpreting

# Ops whose Triton kernels ran since the last reset: noted where they run, not where they
# are dispatched, so that calls inside a compiled graph count too.
TRITON_RAN: set[str] = set()


class _Launchers:
    """:mod:`~hpcllm.kernels.triton_ops`, noting in TRITON_RAN each op whose launcher is used."""

    def __getattr__(self, name: str) -> Any:
        from hpcllm.kernels import triton_ops

        if not name.endswith("_backward"):  # a forward's op runs its backward alike
            TRITON_RAN.add(name)
        return getattr(triton_ops, name)


def _triton() -> Any:
    return _Launchers()


def _on_cpu() -> Any:
    """Return the Triton launchers where the CPU runs them (the interpreter), else None."""
    return _triton() if interpreting() else None


def _row_count(x: Tensor) -> int:
    return math.prod(x.shape[:-1])


def _no_bias(like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    return like.new_empty(0, dtype=dtype)


# ---------------------------------------------------------------- bias + GeLU


@torch.library.custom_op(
    "hpcllm::bias_gelu",
    mutates_args=(),
    device_types="cuda",
    schema="(Tensor x, Tensor? bias) -> Tensor",
)
def _bias_gelu(x: Tensor, bias: Tensor | None) -> Tensor:
    return _triton().bias_gelu(x, bias)


@_bias_gelu.register_kernel("cpu")
def _(x: Tensor, bias: Tensor | None) -> Tensor:
    if ops := _on_cpu():
        return ops.bias_gelu(x, bias)
    return reference.bias_gelu(x, bias).to(x.dtype)


@_bias_gelu.register_fake
def _(x: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op(
    "hpcllm::bias_gelu_backward",
    mutates_args=(),
    device_types="cuda",
    schema="(Tensor dy, Tensor x, Tensor? bias) -> (Tensor, Tensor)",
)
def _bias_gelu_backward(dy: Tensor, x: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    return _triton().bias_gelu_backward(dy, x, bias)


@_bias_gelu_backward.register_kernel("cpu")
def _(dy: Tensor, x: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    if ops := _on_cpu():
        return ops.bias_gelu_backward(dy, x, bias)
    z = x if bias is None else x + bias
    dz = torch.ops.aten.gelu_backward(dy.to(z.dtype), z, approximate="tanh")
    if bias is None:
        return dz.to(x.dtype), _no_bias(x)
    return dz.to(x.dtype), dz.reshape(-1, dz.shape[-1]).sum(0).to(bias.dtype)


@_bias_gelu_backward.register_fake
def _(dy: Tensor, x: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), _no_bias(x) if bias is None else bias.new_empty(bias.shape)


def _bias_gelu_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: Tensor):
    ctx.save_for_backward(*inputs)


def _bias_gelu_grad(ctx: torch.autograd.function.FunctionCtx, dy: Tensor) -> tuple:
    x, bias = ctx.saved_tensors
    dx, dbias = torch.ops.hpcllm.bias_gelu_backward(dy, x, bias)
    return dx, None if bias is None else dbias


_bias_gelu.register_autograd(_bias_gelu_grad, setup_context=_bias_gelu_setup)


# ---------------------------------------------------------------- bias + dropout + residual


def _out_dtype(x: Tensor, bias: Tensor | None, residual: Tensor) -> torch.dtype:
    dtype = x.dtype if bias is None else torch.promote_types(x.dtype, bias.dtype)
    return torch.promote_types(dtype, residual.dtype)


def _seed(seed: Tensor | None) -> int | None:
    return None if seed is None else int(seed)


def _cpu_keep(shape: torch.Size, p: float, seed: int) -> Tensor:
    """Return the CPU implementation's dropout mask: True where an element is kept."""
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) >= p


def _scale(p: float) -> float:
    return 1.0 / (1.0 - p) if p < 1 else 0.0


@torch.library.custom_op(
    "hpcllm::bias_dropout_add",
    mutates_args=(),
    device_types="cuda",
    schema="(Tensor x, Tensor? bias, Tensor residual, float p, Tensor? seed) -> Tensor",
)
def _bias_dropout_add(
    x: Tensor, bias: Tensor | None, residual: Tensor, p: float, seed: Tensor | None
) -> Tensor:
    return _triton().bias_dropout_add(x, bias, residual, p, _seed(seed))


@_bias_dropout_add.register_kernel("cpu")
def _(x: Tensor, bias: Tensor | None, residual: Tensor, p: float, seed: Tensor | None) -> Tensor:
    if ops := _on_cpu():
        return ops.bias_dropout_add(x, bias, residual, p, _seed(seed))
    z = x if bias is None else x + bias
    if seed is not None:
        z = torch.where(_cpu_keep(z.shape, p, int(seed)), z * _scale(p), 0.0)
    return (residual + z).to(_out_dtype(x, bias, residual))


@_bias_dropout_add.register_fake
def _(x: Tensor, bias: Tensor | None, residual: Tensor, p: float, seed: Tensor | None) -> Tensor:
    return x.new_empty(x.shape, dtype=_out_dtype(x, bias, residual))


@torch.library.custom_op(
    "hpcllm::bias_dropout_add_backward",
    mutates_args=(),
    device_types="cuda",
    schema="(Tensor dy, Tensor? bias, float p, Tensor? seed, ScalarType x_dtype) -> "
    "(Tensor, Tensor)",
)
def _bias_dropout_add_backward(
    dy: Tensor, bias: Tensor | None, p: float, seed: Tensor | None, x_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    return _triton().bias_dropout_add_backward(dy, bias, p, _seed(seed), x_dtype)


@_bias_dropout_add_backward.register_kernel("cpu")
def _(
    dy: Tensor, bias: Tensor | None, p: float, seed: Tensor | None, x_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    if ops := _on_cpu():
        return ops.bias_dropout_add_backward(dy, bias, p, _seed(seed), x_dtype)
    dz = dy if seed is None else torch.where(_cpu_keep(dy.shape, p, int(seed)), dy * _scale(p), 0.0)
    if bias is None:
        return dz.to(x_dtype, copy=True), _no_bias(dy, x_dtype)
    return dz.to(x_dtype, copy=True), dz.reshape(-1, dz.shape[-1]).sum(0).to(bias.dtype)


@_bias_dropout_add_backward.register_fake
def _(
    dy: Tensor, bias: Tensor | None, p: float, seed: Tensor | None, x_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    dbias = _no_bias(dy, x_dtype) if bias is None else bias.new_empty(bias.shape)
    return dy.new_empty(dy.shape, dtype=x_dtype), dbias


def _bias_dropout_add_setup(
    ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: Tensor
) -> None:
    x, bias, residual, p, seed = inputs
    ctx.save_for_backward(bias, seed)
    ctx.p, ctx.x_dtype, ctx.residual_dtype = p, x.dtype, residual.dtype


def _bias_dropout_add_grad(ctx: torch.autograd.function.FunctionCtx, dy: Tensor) -> tuple:
    bias, seed = ctx.saved_tensors
    dx, dbias = torch.ops.hpcllm.bias_dropout_add_backward(dy, bias, ctx.p, seed, ctx.x_dtype)
    return dx, None if bias is None else dbias, dy.to(ctx.residual_dtype), None, None


_bias_dropout_add.register_autograd(_bias_dropout_add_grad, setup_context=_bias_dropout_add_setup)


# ---------------------------------------------------------------- LayerNorm


@torch.library.custom_op(
    "hpcllm::layer_norm",
    mutates_args=(),
    device_types="cuda",
    schema="(Tensor x, Tensor weight, Tensor bias, float eps) -> (Tensor, Tensor, Tensor)",
)
def _layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, ...]:
    return _triton().layer_norm(x, weight, bias, eps)


@_layer_norm.register_kernel("cpu")
def _(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, ...]:
    if ops := _on_cpu():
        return ops.layer_norm(x, weight, bias, eps)
    y, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return y.to(x.dtype), mean.float().reshape(-1), rstd.float().reshape(-1)


@_layer_norm.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, ...]:
    rows = _row_count(x)
    return (
        x.new_empty(x.shape),
        x.new_empty(rows, dtype=torch.float32),
        x.new_empty(rows, dtype=torch.float32),
    )


@torch.library.custom_op(
    "hpcllm::layer_norm_backward",
    mutates_args=(),
    device_types="cuda",
    schema="(Tensor dy, Tensor x, Tensor weight, Tensor bias, Tensor mean, Tensor rstd) -> "
    "(Tensor, Tensor, Tensor)",
)
def _layer_norm_backward(
    dy: Tensor, x: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, ...]:
    return _triton().layer_norm_backward(dy, x, weight, bias, mean, rstd)


@_layer_norm_backward.register_kernel("cpu")
def _(
    dy: Tensor, x: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, ...]:
    if ops := _on_cpu():
        return ops.layer_norm_backward(dy, x, weight, bias, mean, rstd)
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


@_layer_norm_backward.register_fake
def _(
    dy: Tensor, x: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, ...]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape), bias.new_empty(bias.shape)


def _layer_norm_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple):
    x, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, bias, mean, rstd)


def _layer_norm_grad(ctx: torch.autograd.function.FunctionCtx, dy: Tensor, *_: Tensor) -> tuple:
    return (*torch.ops.hpcllm.layer_norm_backward(dy, *ctx.saved_tensors), None)


_layer_norm.register_autograd(_layer_norm_grad, setup_context=_layer_norm_setup)


# ---------------------------------------------------------------- cross-entropy


@torch.library.custom_op(
    "hpcllm::vocab_ce_partials",
    mutates_args=(),
    device_types="cuda",
    schema="(Tensor logits, Tensor labels, SymInt vocab_start, SymInt vocab_size) -> "
    "(Tensor, Tensor, Tensor)",
)
def _vocab_ce_partials(
    logits: Tensor, labels: Tensor, vocab_start: int, vocab_size: int
) -> tuple[Tensor, ...]:
    return _triton().vocab_ce_partials(logits, labels, vocab_start, vocab_size)


@_vocab_ce_partials.register_kernel("cpu")
def _(logits: Tensor, labels: Tensor, vocab_start: int, vocab_size: int) -> tuple[Tensor, ...]:
    ops = _on_cpu() or reference
    return ops.vocab_ce_partials(logits, labels, vocab_start, vocab_size)


@_vocab_ce_partials.register_fake
def _(logits: Tensor, labels: Tensor, vocab_start: int, vocab_size: int) -> tuple[Tensor, ...]:
    return tuple(logits.new_empty(logits.shape[0], dtype=torch.float32) for _ in range(3))


@torch.library.custom_op(
    "hpcllm::vocab_ce_backward",
    mutates_args=(),
    device_types="cuda",
    schema="(Tensor logits, Tensor labels, Tensor lse, Tensor grad, SymInt vocab_start, "
    "SymInt vocab_size) -> Tensor",
)
def _vocab_ce_backward(
    logits: Tensor, labels: Tensor, lse: Tensor, grad: Tensor, vocab_start: int, vocab_size: int
) -> Tensor:
    return _triton().vocab_ce_backward(logits, labels, lse, grad, vocab_start, vocab_size)


@_vocab_ce_backward.register_kernel("cpu")
def _(
    logits: Tensor, labels: Tensor, lse: Tensor, grad: Tensor, vocab_start: int, vocab_size: int
) -> Tensor:
    ops = _on_cpu() or reference
    return ops.vocab_ce_backward(logits, labels, lse, grad, vocab_start, vocab_size)


@_vocab_ce_backward.register_fake
def _(
    logits: Tensor, labels: Tensor, lse: Tensor, grad: Tensor, vocab_start: int, vocab_size: int
) -> Tensor:
    return logits.new_empty(logits.shape)


@torch.library.custom_op(
    "hpcllm::cross_entropy",
    mutates_args=(),
    device_types="cuda",
    schema="(Tensor logits, Tensor labels, SymInt vocab_size) -> (Tensor, Tensor)",
)
def _cross_entropy(logits: Tensor, labels: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    return _triton().cross_entropy(logits, labels, vocab_size)


@_cross_entropy.register_kernel("cpu")
def _(logits: Tensor, labels: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    if ops := _on_cpu():
        return ops.cross_entropy(logits, labels, vocab_size)
    top, sumexp, target = reference.vocab_ce_partials(logits, labels, 0, vocab_size)
    lse = top + sumexp.log()
    return (lse - target).mean(), lse


@_cross_entropy.register_fake
def _(logits: Tensor, labels: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    return logits.new_empty((), dtype=torch.float32), logits.new_empty(
        logits.shape[0], dtype=torch.float32
    )


def _cross_entropy_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple):
    logits, labels, vocab_size = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(logits, labels, output[1])
    ctx.vocab_size = vocab_size


def _cross_entropy_grad(ctx: torch.autograd.function.FunctionCtx, grad: Tensor, _: Tensor):
    logits, labels, lse = ctx.saved_tensors
    dlogits = torch.ops.hpcllm.vocab_ce_backward(
        logits, labels, lse, grad / labels.numel(), 0, ctx.vocab_size
    )
    return dlogits, None, None


_cross_entropy.register_autograd(_cross_entropy_grad, setup_context=_cross_entropy_setup)


# ---------------------------------------------------------------- RMSNorm


@torch.library.custom_op(
    "hpcllm::rms_norm",
    mutates_args=(),
    device_types="cuda",
    schema="(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)",
)
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return _triton().rms_norm(x, weight, eps)


@_rms_norm.register_kernel("cpu")
def _(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    if ops := _on_cpu():
        return ops.rms_norm(x, weight, eps)
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1) + eps)
    y = weight * (x32 * rstd.unsqueeze(-1)).to(x.dtype)
    return y, rstd.reshape(-1)


@_rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    dtype = torch.promote_types(x.dtype, weight.dtype)
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(_row_count(x), dtype=torch.float32)


@torch.library.custom_op(
    "hpcllm::rms_norm_backward",
    mutates_args=(),
    device_types="cuda",
    schema="(Tensor dy, Tensor x, Tensor weight, Tensor rstd) -> (Tensor, Tensor)",
)
def _rms_norm_backward(
    dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor]:
    return _triton().rms_norm_backward(dy, x, weight, rstd)


@_rms_norm_backward.register_kernel("cpu")
def _(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    if ops := _on_cpu():
        return ops.rms_norm_backward(dy, x, weight, rstd)
    x32, dy32 = x.float(), dy.float()
    r = rstd.reshape(*x.shape[:-1], 1)
    n = x32 * r
    wdy = weight.float() * dy32
    dx = r * (wdy - n * (n * wdy).mean(-1, keepdim=True))
    dw = (dy32 * n.to(x.dtype).float()).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


@_rms_norm_backward.register_fake
def _(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_norm_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple):
    x, weight, _ = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_grad(ctx: torch.autograd.function.FunctionCtx, dy: Tensor, _: Tensor) -> tuple:
    return (*torch.ops.hpcllm.rms_norm_backward(dy, *ctx.saved_tensors), None)


_rms_norm.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


# ---------------------------------------------------------------- SwiGLU


@torch.library.custom_op(
    "hpcllm::swiglu",
    mutates_args=(),
    device_types="cuda",
    schema="(Tensor gate, Tensor up) -> Tensor",
)
def _swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return _triton().swiglu(gate, up)


@_swiglu.register_kernel("cpu")
def _(gate: Tensor, up: Tensor) -> Tensor:
    if ops := _on_cpu():
        return ops.swiglu(gate, up)
    g = gate.float()
    return (torch.nn.functional.silu(g) * up.float()).to(torch.promote_types(gate.dtype, up.dtype))


@_swiglu.register_fake
def _(gate: Tensor, up: Tensor) -> Tensor:
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


@torch.library.custom_op(
    "hpcllm::swiglu_backward",
    mutates_args=(),
    device_types="cuda",
    schema="(Tensor dy, Tensor gate, Tensor up) -> (Tensor, Tensor)",
)
def _swiglu_backward(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return _triton().swiglu_backward(dy, gate, up)


@_swiglu_backward.register_kernel("cpu")
def _(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    if ops := _on_cpu():
        return ops.swiglu_backward(dy, gate, up)
    g, u, d = gate.float(), up.float(), dy.float()
    s = torch.sigmoid(g)
    return (d * u * s * (1 + g * (1 - s))).to(gate.dtype), (d * g * s).to(up.dtype)


@_swiglu_backward.register_fake
def _(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _swiglu_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: Tensor):
    ctx.save_for_backward(*inputs)


def _swiglu_grad(ctx: torch.autograd.function.FunctionCtx, dy: Tensor) -> tuple:
    return torch.ops.hpcllm.swiglu_backward(dy, *ctx.saved_tensors)


_swiglu.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)


# ---------------------------------------------------------------- rotary positions


@torch.library.custom_op(
    "hpcllm::rotary",
    mutates_args=(),
    device_types="cuda",
    schema="(Tensor x, Tensor inv_freq, SymInt offset, float sign) -> Tensor",
)
def _rotary(x: Tensor, inv_freq: Tensor, offset: int, sign: float) -> Tensor:
    return _triton().rotary(x, inv_freq, offset, sign)


@_rotary.register_kernel("cpu")
def _(x: Tensor, inv_freq: Tensor, offset: int, sign: float) -> Tensor:
    if ops := _on_cpu():
        return ops.rotary(x, inv_freq, offset, sign)
    return reference.rotary(x, inv_freq, offset, sign).contiguous()


@_rotary.register_fake
def _(x: Tensor, inv_freq: Tensor, offset: int, sign: float) -> Tensor:
    return x.new_empty(x.shape)


def _rotary_setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: Tensor):
    _, inv_freq, offset, sign = inputs
    ctx.save_for_backward(inv_freq)
    ctx.offset, ctx.sign = offset, sign


def _rotary_grad(ctx: torch.autograd.function.FunctionCtx, dy: Tensor) -> tuple:
    # A rotation's transpose is the rotation back: the same op with the sine negated.
    (inv_freq,) = ctx.saved_tensors
    return torch.ops.hpcllm.rotary(dy, inv_freq, ctx.offset, -ctx.sign), None, None, None


_rotary.register_autograd(_rotary_grad, setup_context=_rotary_setup)


# ---------------------------------------------------------------- the dispatch's entry points


def bias_gelu(x: Tensor, bias: Tensor | None) -> Tensor:
    """Return ``hpcllm::bias_gelu``: GeLU(x + bias), tanh approximation, in x's dtype."""
    return torch.ops.hpcllm.bias_gelu(x, bias)


def dropout_seed(p: float, training: bool) -> Tensor | None:
    """Return a dropout seed from torch's CPU generator (0-d int64), or None if nothing drops."""
    if not training or p <= 0:
        return None
    return torch.randint(2**31 - 1, (), dtype=torch.int64)


def bias_dropout_add(
    x: Tensor, bias: Tensor | None, residual: Tensor, p: float, training: bool
) -> Tensor:
    """Return ``hpcllm::bias_dropout_add``: residual + dropout(x + bias), seed drawn here."""
    return torch.ops.hpcllm.bias_dropout_add(x, bias, residual, p, dropout_seed(p, training))


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """Return ``hpcllm::layer_norm``'s output: LayerNorm in x's dtype, statistics in fp32."""
    return torch.ops.hpcllm.layer_norm(x, weight, bias, eps)[0]


def cross_entropy(logits: Tensor, labels: Tensor, vocab_size: int | None = None) -> Tensor:
    """Return ``hpcllm::cross_entropy``'s mean loss (fp32) over the first ``vocab_size`` columns.

    The logits are flattened to rows as a view: padded logits' rows keep their stride.
    """
    rows = logits.reshape(-1, logits.shape[-1])
    vocab = logits.shape[-1] if vocab_size is None else vocab_size
    return torch.ops.hpcllm.cross_entropy(rows, labels.reshape(-1), vocab)[0]


def vocab_ce_partials(
    logits: Tensor, labels: Tensor, vocab_start: int, vocab_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Return ``hpcllm::vocab_ce_partials`` (see :func:`hpcllm.kernels.vocab_ce_partials`)."""
    top, sumexp, target = torch.ops.hpcllm.vocab_ce_partials(
        logits, labels, vocab_start, vocab_size
    )
    return top, sumexp, target


def vocab_ce_backward(
    logits: Tensor,
    labels: Tensor,
    lse: Tensor,
    grad: Tensor,
    vocab_start: int,
    vocab_size: int,
) -> Tensor:
    """Return ``hpcllm::vocab_ce_backward`` (see :func:`hpcllm.kernels.vocab_ce_backward`)."""
    return torch.ops.hpcllm.vocab_ce_backward(logits, labels, lse, grad, vocab_start, vocab_size)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Return ``hpcllm::rms_norm``'s output: RMSNorm, statistics in fp32."""
    return torch.ops.hpcllm.rms_norm(x, weight, eps)[0]


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """Return ``hpcllm::swiglu``: SiLU(gate) · up."""
    return torch.ops.hpcllm.swiglu(gate, up)


def rotary(x: Tensor, inv_freq: Tensor, offset: int = 0) -> Tensor:
    """Return ``hpcllm::rotary``: x (b, s, heads, d) rotated by its positions' angles."""
    return torch.ops.hpcllm.rotary(x, inv_freq, offset, 1.0)
