"""Triton code written in an op's module, jitted when it first launches: Triton is imported then.

An op's module (:mod:`hpcllm.kernels.ops`) holds its kernels beside its reference and its
registration, and must import without Triton. So its kernels are plain functions marked with
:func:`kernel` (the device functions they call too), written under
``from __future__ import annotations`` (Triton reads the annotation ``"tl.constexpr"`` as the
type), calling ``tl`` imported from here. The first launch (``fwd[grid](...)``) jits the
kernel's module, :func:`jitted`: it imports Triton, binds ``triton.language`` as the module's
``tl`` and replaces each marked function there with ``triton.jit`` of it, the device
functions it imported from another module with that module's (jitted once, there). From then
on the module's names are Triton's own objects, which launch directly.

Whether a kernel compiles for the GPU or runs in Triton's interpreter (``TRITON_INTERPRET=1``)
is fixed when it is jitted, and Triton's own library (``tl.rand``) when Triton is first
imported: set the variable before either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

# What an op's kernels call ``tl``: None until :func:`jitted` binds ``triton.language`` in its
# place in their module (imported from here so that the name exists before then).
tl: Any = None


class Kernel:
    """A function of Triton code (a kernel, or a device function a kernel calls), to be jitted
    with ``options`` (``triton.jit``'s: ``do_not_specialize``) on first launch."""

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any]) -> None:
        self.fn, self.options = fn, options

    def __getitem__(self, grid: Any) -> Any:
        """Return the launcher of the jitted kernel on ``grid``, jitting its module first."""
        return _jit_namespace(self.fn.__globals__)[self.fn.__name__][grid]


def kernel(fn: Callable[..., Any] | None = None, *, do_not_specialize: Iterable[str] = ()) -> Any:
    """Return ``fn`` marked as Triton code of its module (see the module's docstring); used
    as ``@kernel`` or ``@kernel(do_not_specialize=["seed"])``."""
    options = {"do_not_specialize": list(do_not_specialize)} if do_not_specialize else {}
    if fn is None:
        return lambda f: Kernel(f, options)
    return Kernel(fn, options)


def jitted(module: ModuleType) -> ModuleType:
    """Return ``module`` with its Triton code jitted (once): ``tl`` bound, each marked function
    replaced by ``triton.jit`` of it. Launching a kernel does this; tests that compile a kernel
    themselves call it."""
    _jit_namespace(vars(module))
    return module


def _jit_namespace(namespace: dict[str, Any]) -> dict[str, Any]:
    """Return a module's globals with its Triton code jitted (see :func:`jitted`)."""
    if any(isinstance(value, Kernel) for value in namespace.values()):
        import triton
        import triton.language

        # tl first: jitting reads nothing, but compiling and interpreting look it up here.
        namespace["tl"] = triton.language
        for name, value in list(namespace.items()):
            if not isinstance(value, Kernel):
                continue
            home = value.fn.__globals__
            if home is namespace:
                namespace[name] = triton.jit(value.fn, **value.options)
            else:  # a device function imported from another module: jitted there, once
                namespace[name] = _jit_namespace(home)[value.fn.__name__]
    return namespace
