"""What an op's module supplies (:class:`FusedOp`), and its custom ops' one registration.

Each fused op is a module of :mod:`hpcllm.kernels.ops` ending in ``OP = FusedOp(...)``: its
public function (the signature and docstring :mod:`hpcllm.kernels` exports, calling the op's
``hpcllm`` custom op), its torch reference, which arguments the custom op takes, and the case
``hpcllm bench kernels`` times. The package's dispatch, the auto chooser and the bench read
these and nothing else of an op.

:func:`register` registers one ``hpcllm::NAME`` custom op from the op's parts: its Triton
launcher runs on CUDA, and on the CPU under Triton's interpreter (``TRITON_INTERPRET``,
decided per call: that is how the tests run the kernels without a GPU); its torch
implementation runs on the CPU otherwise; its fake gives the outputs' shapes and dtypes, so
torch.compile traces through the op; and a differentiable op's autograd formula
(``setup_context`` and ``backward``, which calls the op's backward custom op) lets
AOTAutograd trace backward as well.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hpcllm.kernels.interpreter import interpreting

# Ops whose Triton kernels ran since the last reset: noted where they run, not where they are
# dispatched, so that calls inside a compiled graph count too.
TRITON_RAN: set[str] = set()


@dataclass(frozen=True)
class BenchShape:
    """The sizes ``hpcllm bench kernels`` times an op at (a model's, at a micro-batch of
    ``batch`` sequences), and where the op's inputs are drawn from."""

    batch: int
    seq: int
    hidden: int
    heads: int
    ffn: int  # the MLP's width
    vocab: int  # the tokenizer's
    padded_vocab: int  # the logits' columns
    device: torch.device
    generator: torch.Generator  # on ``device``
    head_dim: int | None = None  # each head's width; None: hidden / heads

    @property
    def head_size(self) -> int:
        """Return each attention head's width."""
        return self.head_dim or self.hidden // self.heads

    @property
    def rows(self) -> int:
        """Return the tokens of a micro-batch."""
        return self.batch * self.seq

    def randn(
        self, *dims: int, dtype: torch.dtype = torch.float32, scale: float = 1.0
    ) -> torch.Tensor:
        """Return a normal tensor times ``scale`` in ``dtype``, requiring grad."""
        t = torch.randn(dims, generator=self.generator, device=self.device) * scale
        return t.to(dtype).requires_grad_()


@dataclass
class BenchCase:
    """One op as ``hpcllm bench kernels`` times it: how to call an implementation on its
    inputs, and the bytes it must move."""

    name: str
    call: Callable[[Callable[..., torch.Tensor], bool], torch.Tensor]  # (fn, checking)
    grad_inputs: list[torch.Tensor]
    fwd_bytes: int
    bwd_bytes: int


def _has_elements(x: torch.Tensor, *_: Any) -> bool:
    return x.numel() > 0


@dataclass(frozen=True)
class FusedOp:
    """What the package reads of one fused op (its module's ``OP``)."""

    name: str
    # The public function (hpcllm.kernels.NAME): the op's signature and docstring; its body
    # calls the custom op.
    fused: Callable[..., Any]
    # The same signature in plain torch: what runs unfused, and the kernels' test oracle.
    reference: Callable[..., Any]
    # Whether the custom op takes these arguments; where not, the reference runs.
    supported: Callable[..., bool] = _has_elements
    # Whether the op has a backward: auto times forward + backward where it has.
    differentiable: bool = True
    # Whether auto keeps the Triton kernel inside torch.compile graphs (else inductor gets
    # the reference to fuse with its neighbours).
    in_compiled_graphs: bool = False
    # The case hpcllm bench kernels times at a shape, or None: not timed alone.
    bench: Callable[[BenchShape], BenchCase] | None = None


def register(
    name: str,
    schema: str,
    *,
    triton: Callable[..., Any],
    torch_impl: Callable[..., Any],
    fake: Callable[..., Any],
    setup_context: Callable[..., None] | None = None,
    backward: Callable[..., Any] | None = None,
) -> Any:
    """Register and return the custom op ``hpcllm::name`` with ``schema``.

    ``triton`` (the launcher) runs on CUDA, and on the CPU where :func:`interpreting`;
    ``torch_impl`` on the CPU otherwise; ``fake`` under tracing. All three take the schema's
    arguments. With ``backward`` the op is differentiable (``register_autograd``): it is
    called with ``setup_context``'s ``ctx`` and the outputs' gradients and returns one
    gradient per input (None for those without). A run of the launcher notes ``name`` in
    :data:`TRITON_RAN`, except for a backward op (``*_backward``), whose forward was noted.
    """

    def on_triton(*args: Any) -> Any:
        if not name.endswith("_backward"):
            TRITON_RAN.add(name)
        return triton(*args)

    def on_cpu(*args: Any) -> Any:
        return on_triton(*args) if interpreting() else torch_impl(*args)

    op = torch.library.custom_op(
        f"hpcllm::{name}", on_triton, mutates_args=(), device_types="cuda", schema=schema
    )
    op.register_kernel("cpu")(on_cpu)
    op.register_fake(fake)
    if backward is not None:
        op.register_autograd(backward, setup_context=setup_context)
    return op
