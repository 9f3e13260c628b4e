"""Fused operators (imported as ``hpcllm.kernels``), one dispatch point per op.

The model calls these functions and never an implementation. Where fused kernels are enabled
(:func:`set_enabled`) and the tensor is on a CUDA device, or on the CPU under Triton's
interpreter (``TRITON_INTERPRET=1``, for tests), an op calls its torch custom op
(:mod:`~hpcllm.kernels.custom_ops`, namespace ``hpcllm``: the Triton kernels of
:mod:`~hpcllm.kernels.triton_ops`, which torch.compile traces through); otherwise it calls its
torch reference (:mod:`~hpcllm.kernels.reference`, plain torch that inductor fuses itself, and
the kernels' test oracle). Enabled with ``choose`` (``model.fused_kernels: auto``), the first
call of an op at each signature times the Triton op against the compiled reference and runs
the faster from then on (:mod:`~hpcllm.kernels.choice`). Inside a torch.compile trace, ``auto``
(``compiled_reference``) gives inductor the reference to fuse with its neighbours (the
cross-entropy ops excepted: :data:`TRITON_IN_COMPILED_GRAPHS`), where ``on`` traces the Triton
op. :func:`implementations_used` says what ran. Triton is imported only when a kernel first
runs, so this package imports without it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hpcllm.errors import UserError
from hpcllm.kernels import custom_ops, reference
from hpcllm.kernels.choice import Chooser, Timer, wall_clock_ms
from hpcllm.kernels.interpreter import interpreting

# LayerNorm's kernel keeps a whole row in registers; wider rows run the torch reference.
LAYER_NORM_MAX_COLS = 16384

_enabled = False
_chooser: Chooser | None = None  # set where auto times the implementations
_compiled_reference = False  # inside a compiled graph, the reference for inductor to fuse
# Ops whose Triton kernel auto keeps inside compiled graphs: a reduction over the vocabulary
# that inductor has no neighbour to fuse with, where the kernel beat inductor's code 1.7x
# forward + backward on an H200 (docs/kernels.md).
TRITON_IN_COMPILED_GRAPHS = frozenset({"cross_entropy", "vocab_ce_partials", "vocab_ce_backward"})
_used: dict[str, str] = {}


@functools.cache
def triton_available() -> bool:
    """Return whether Triton imports."""
    try:
        import triton  # noqa: F401
    except Exception:  # missing, or an install that fails on import: either way, no kernels
        return False
    return True


def resolve_fused(setting: str, device: torch.device) -> bool:
    """Return whether fused kernels run for ``model.fused_kernels`` on ``device``.

    ``auto`` fuses on CUDA GPUs that Triton supports (compute capability 8.0 and up) when
    Triton imports; ``on`` raises a UserError where it cannot fuse instead of silently running
    the references.
    """
    if setting == "off":
        return False
    if setting == "auto":
        return (
            device.type == "cuda"
            and triton_available()
            and torch.cuda.get_device_capability(device) >= (8, 0)
        )
    if setting != "on":
        raise UserError(f"model.fused_kernels must be auto, on or off, got {setting!r}")
    if not triton_available():
        raise UserError(
            "model.fused_kernels: on needs Triton, which does not import here "
            "(pip install triton); use auto or off"
        )
    if device.type != "cuda" and not interpreting():
        raise UserError(
            f"model.fused_kernels: on needs a CUDA device, not {device.type} (or "
            "TRITON_INTERPRET=1 to run the kernels in Triton's interpreter); "
            "use auto or off"
        )
    return True


def set_enabled(
    flag: bool,
    choose: bool = False,
    timer: Timer = wall_clock_ms,
    compiled_reference: bool = False,
) -> None:
    """Make every op run its Triton kernel (where its tensors allow) or its torch reference.

    With ``choose`` (``model.fused_kernels: auto``) each op runs whichever of its Triton op and
    its compiled reference ``timer`` finds faster, per signature (:mod:`~hpcllm.kernels.choice`);
    every call forgets earlier choices. With ``compiled_reference`` (``auto`` too) an op traced
    by torch.compile is the reference, which inductor fuses into the ops around it (except
    those of :data:`TRITON_IN_COMPILED_GRAPHS`): measured on
    an H200, gpt2-124m's compiled blocks ran 1.9 times slower with the Triton ops traced in
    (docs/kernels.md).
    """
    global _enabled, _chooser, _compiled_reference
    if flag and not triton_available():
        raise UserError(
            "fused kernels need Triton, which does not import here (pip install triton)"
        )
    _enabled = flag
    _chooser = Chooser(timer) if flag and choose else None
    _compiled_reference = flag and compiled_reference


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the torch references inside, keeping the switch's choices for afterwards."""
    global _enabled
    previous, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = previous


def enabled() -> bool:
    """Return whether fused kernels are enabled."""
    return _enabled


def choosing() -> bool:
    """Return whether enabled kernels run only where timed faster (``set_enabled(choose=)``)."""
    return _chooser is not None


def compiled_reference() -> bool:
    """Return whether ops traced by torch.compile run their reference (``auto``)."""
    return _compiled_reference


def choices() -> dict[tuple[Any, ...], str]:
    """Return the choices made so far: (op, *signature) → "triton" or "torch"."""
    return {} if _chooser is None else dict(_chooser.choices)


def choice_timings() -> dict[tuple[Any, ...], tuple[float, float]]:
    """Return what auto timed: (op, *signature) → (Triton ms, compiled torch ms)."""
    return {} if _chooser is None else dict(_chooser.timings)


def implementations_used() -> dict[str, str]:
    """Return op → "triton" or "torch": what ran last for each op called since the reset.

    Inside compiled graphs only Triton kernels are noted (where they run): the torch
    references there are the compiler's own code.
    """
    return {**_used, **dict.fromkeys(custom_ops.TRITON_RAN, "triton")}


def reset_implementations_used() -> None:
    """Forget what :func:`implementations_used` reports."""
    _used.clear()
    custom_ops.TRITON_RAN.clear()


def fused(x: torch.Tensor) -> bool:
    """Return whether the ops run fused kernels on ``x``'s device.

    Where they do not, a caller passes a bias to its matmul instead of to the op (one
    ``addmm`` rather than a matmul and an add), as plain PyTorch would.
    """
    return _enabled and (x.is_cuda or (x.device.type == "cpu" and interpreting()))


def _pick(op: str, x: torch.Tensor, args: tuple[Any, ...], supported: bool = True) -> Callable:
    """Return the implementation of ``op`` to run on ``args``, and note which it is."""
    left_to_inductor = (
        _compiled_reference
        and op not in TRITON_IN_COMPILED_GRAPHS
        and torch.compiler.is_compiling()
    )
    if not (supported and fused(x)) or left_to_inductor:
        impl, fn = "torch", getattr(reference, op)
    elif _chooser is None or torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        impl, fn = "triton", getattr(custom_ops, op)
    else:
        impl = _chooser.choose(op, getattr(custom_ops, op), args)
        fn = getattr(custom_ops, op) if impl == "triton" else _chooser.torch_impl(op, x.device)
    if not torch.compiler.is_compiling():  # a traced write would guard every compiled graph
        _used[op] = impl
        if impl == "torch":
            custom_ops.TRITON_RAN.discard(op)
    return fn


def in_range(x: torch.Tensor) -> bool:
    """Return whether an op on ``x`` is marked with an NVTX range: on a GPU, outside compiled
    graphs (a range cannot be traced; Nsight shows a compiled graph's kernels by name)."""
    return x.is_cuda and not torch.compiler.is_compiling()


def _call(op: str, x: torch.Tensor, args: tuple[Any, ...], supported: bool = True) -> Any:
    """Run the implementation of ``op`` :func:`_pick` chooses, in an NVTX range ``hpcllm.OP``
    for Nsight Systems where :func:`in_range` says so."""
    fn = _pick(op, x, args, supported)
    if not in_range(x):
        return fn(*args)
    with torch.cuda.nvtx.range(f"hpcllm.{op}"):
        return fn(*args)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Return GeLU(x + bias), tanh approximation (GPT-2's ``gelu_new``).

    Fused, the output is in x's dtype (under autocast the matmul's, which the next matmul
    would cast it to anyway).
    """
    args = (x, bias)
    return _call("bias_gelu", x, args, x.numel() > 0)


def bias_dropout_add(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, training: bool
) -> torch.Tensor:
    """Return residual + dropout(x + bias); with p = 0 or not training, residual + x + bias."""
    args = (x, bias, residual, p, training)
    return _call("bias_dropout_add", x, args, x.numel() > 0)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """Return LayerNorm over the last dimension (fused: in x's dtype, statistics in fp32).

    Rows wider than the kernel keeps in registers run the reference.
    """
    args = (x, weight, bias, eps)
    supported = x.numel() > 0 and x.shape[-1] <= LAYER_NORM_MAX_COLS
    return _call("layer_norm", x, args, supported)


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None
) -> torch.Tensor:
    """Return the mean token cross-entropy, computed in fp32 whatever the logits' dtype.

    With ``vocab_size``, columns at or past it are padding and excluded: passing the padded
    logits this way saves the copy that slicing them would cost in backward.
    """
    args = (logits, labels, vocab_size)
    return _call("cross_entropy", logits, args, labels.numel() > 0)


def vocab_ce_partials(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    args = (logits, labels, vocab_start, vocab_size)
    return _call("vocab_ce_partials", logits, args, logits.numel() > 0)


def vocab_ce_backward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    grad: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
) -> torch.Tensor:
    """Return the loss gradient of a vocabulary slice of the logits, in their dtype.

    That is (exp(x - lse) - onehot(label)) * grad per row, zero on padding columns; ``lse``
    is the per-row log-sum-exp over the whole vocabulary (see :func:`vocab_ce_partials`),
    ``grad`` the per-row loss gradient, shape (rows,) or a scalar (for a mean: g / rows).
    """
    args = (logits, labels, lse, grad, vocab_start, vocab_size)
    return _call("vocab_ce_backward", logits, args, logits.numel() > 0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Return RMSNorm over the last dimension: weight · x / sqrt(mean(x²) + eps), statistics
    in fp32, in the promoted dtype of x and the weight (Llama's norm).

    Rows wider than the kernel keeps in registers run the reference.
    """
    args = (x, weight, eps)
    supported = x.numel() > 0 and x.shape[-1] <= LAYER_NORM_MAX_COLS
    return _call("rms_norm", x, args, supported)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Return SiLU(gate) · up, the SwiGLU MLP's activation, in their promoted dtype."""
    args = (gate, up)
    return _call("swiglu", gate, args, gate.numel() > 0 and gate.shape == up.shape)


def rotary(x: torch.Tensor, inv_freq: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Return x (batch, seq, heads, head_dim) rotated by the angles position × ``inv_freq``
    (head_dim / 2 frequencies, Llama 3.1's scaled ones included), positions from ``offset``:
    each half of a head pairs with the other. In x's dtype; the angles in fp32."""
    args = (x, inv_freq, offset)
    supported = x.numel() > 0 and x.dim() == 4 and x.shape[-1] == 2 * inv_freq.numel()
    return _call("rotary", x, args, supported)
