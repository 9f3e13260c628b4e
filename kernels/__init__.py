"""Fused operators (imported as ``hpcllm.kernels``), one dispatch point per op.

The model calls these functions and never an implementation. Each op is a module of
:mod:`~hpcllm.kernels.ops` (its kernels, launchers, reference, custom ops, public function
and bench case) listed in :data:`OPS`; the package exports its public function
(``hpcllm.kernels.rotary``), which runs the implementation :func:`_call` picks. Where fused
kernels are enabled (:func:`set_enabled`) and the tensor is on a CUDA device, or on the CPU
under Triton's interpreter (``TRITON_INTERPRET=1``, for tests), an op calls its torch custom op
(namespace ``hpcllm``: its Triton kernels, which torch.compile traces through); otherwise it
calls its torch reference (plain torch that inductor fuses itself, and the kernels' test
oracle). Enabled with ``choose`` (``model.fused_kernels: auto``), the first
call of an op at each signature times the Triton op against the eager reference and runs
the faster from then on (:mod:`~hpcllm.kernels.choice`). Inside a torch.compile trace, ``auto``
(``compiled_reference``) gives inductor the reference to fuse with its neighbours (the
cross-entropy ops excepted: :data:`TRITON_IN_COMPILED_GRAPHS`), where ``on`` traces the Triton
op. :func:`implementations_used` says what ran. Triton is imported only when a kernel first
runs, so this package imports without it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hpcllm.errors import UserError
from hpcllm.kernels.choice import Chooser
from hpcllm.kernels.interpreter import interpreting
from hpcllm.kernels.ops import OPS
from hpcllm.kernels.registry import TRITON_RAN, FusedOp
from hpcllm.kernels.timing import Clock

_enabled = False
_chooser: Chooser | None = None  # set where auto times the implementations
_compiled_reference = False  # inside a compiled graph, the reference for inductor to fuse
_by_name = {op.name: op for op in OPS}  # what _pick runs of each op
# Ops whose Triton kernel auto keeps inside compiled graphs: a reduction over the vocabulary
# that inductor has no neighbour to fuse with, where the kernel beat inductor's code 1.7x
# forward + backward on an H200 (docs/kernels.md).
TRITON_IN_COMPILED_GRAPHS = frozenset(op.name for op in OPS if op.in_compiled_graphs)
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
    clock: Clock | None = None,
    compiled_reference: bool = False,
) -> None:
    """Make every op run its Triton kernel (where its tensors allow) or its torch reference.

    With ``choose`` (``model.fused_kernels: auto``) each op runs whichever of its Triton op and
    its eager reference ``clock`` times faster, per signature (:mod:`~hpcllm.kernels.choice`;
    None: a :class:`~hpcllm.kernels.timing.Clock` of its defaults);
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
    _chooser = Chooser(clock) if flag and choose else None
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
    """Return what auto timed: (op, *signature) → (Triton ms, eager torch ms)."""
    return {} if _chooser is None else dict(_chooser.timings)


def implementations_used() -> dict[str, str]:
    """Return op → "triton" or "torch": what ran last for each op called since the reset.

    Inside compiled graphs only Triton kernels are noted (where they run): the torch
    references there are the compiler's own code.
    """
    return {**_used, **dict.fromkeys(TRITON_RAN, "triton")}


def reset_implementations_used() -> None:
    """Forget what :func:`implementations_used` reports."""
    _used.clear()
    TRITON_RAN.clear()


_BIAS_OPS = ("bias_gelu", "bias_dropout_add")
# Whether a graph that leaves the bias ops to inductor still hands their biases to them, as
# before the GEMM epilogue took them (for scripts/step_levers.py's "before" side alone).
BIAS_OUTSIDE_GEMM_WHEN_COMPILED = False


def fused(x: torch.Tensor) -> bool:
    """Return whether the ops that take a matmul's bias run fused kernels on ``x``'s device.

    Where they do not, a caller passes a bias to its matmul instead of to the op (one
    ``addmm`` rather than a matmul and an add), as plain PyTorch would: also inside a graph
    torch.compile traces under ``auto``, which leaves these ops to inductor, so that cuBLAS
    adds the bias in the GEMM's epilogue (measured on an H100: docs/benchmarks.md).
    """
    if not BIAS_OUTSIDE_GEMM_WHEN_COMPILED and all(map(_left_to_inductor, _BIAS_OPS)):
        return False
    return _runs_fused(x)


def _runs_fused(x: torch.Tensor) -> bool:
    """Return whether enabled kernels run on ``x``'s device."""
    return _enabled and (x.is_cuda or (x.device.type == "cpu" and interpreting()))


def _left_to_inductor(op: str) -> bool:
    """Return whether ``op``, traced by torch.compile under ``auto``, runs its reference."""
    return (
        _compiled_reference
        and op not in TRITON_IN_COMPILED_GRAPHS
        and torch.compiler.is_compiling()
    )


def _pick(op: str, x: torch.Tensor, args: tuple[Any, ...], supported: bool = True) -> Callable:
    """Return the implementation of ``op`` to run on ``args``, and note which it is."""
    if not (supported and _runs_fused(x)) or _left_to_inductor(op):
        impl, fn = "torch", _by_name[op].reference
    elif _chooser is None or torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        impl, fn = "triton", _by_name[op].fused
    else:
        impl = _chooser.choose(op, _by_name[op].fused, args)
        fn = _by_name[op].fused if impl == "triton" else _chooser.torch_impl(op, x.device)
    if not torch.compiler.is_compiling():  # a traced write would guard every compiled graph
        _used[op] = impl
        if impl == "torch":
            TRITON_RAN.discard(op)
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


def _public(op: FusedOp) -> Callable[..., Any]:
    """Return ``op``'s public function: its module's signature and docstring, running what
    :func:`_call` picks on the arguments in order, defaults filled in (as the chooser's
    signature and the reference take them)."""
    signature = inspect.signature(op.fused)
    count = len(signature.parameters)

    @functools.wraps(op.fused)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        if kwargs or len(args) != count:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            args = bound.args
        return _call(op.name, args[0], args, op.supported(*args))

    return dispatch


# Each op's public function, named for it: hpcllm.kernels.bias_gelu, ..., hpcllm.kernels.rotary.
globals().update({op.name: _public(op) for op in OPS})
