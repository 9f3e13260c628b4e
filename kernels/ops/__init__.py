"""The fused ops, one module each: its Triton kernels, launchers, torch reference, custom-op
registration, public function and bench case, ending in ``OP`` (a
:class:`~hpcllm.kernels.registry.FusedOp`).

Adding an op is its module and its line in :data:`OPS`: :mod:`hpcllm.kernels` exports its
public function and dispatches it, the auto chooser times it (forward + backward where it
is :data:`DIFFERENTIABLE`), ``hpcllm bench kernels`` times its bench case, and
:mod:`hpcllm.kernels.reference` names its reference.
"""

from __future__ import annotations

from hpcllm.kernels.ops import (
    bias_dropout_add,
    bias_gelu,
    cross_entropy,
    layer_norm,
    rms_norm,
    rotary,
    swiglu,
    vocab_ce_backward,
    vocab_ce_partials,
)

# GPT-2's ops, the vocabulary-parallel cross-entropy's halves, then Llama's: the bench's order.
OPS = (
    bias_gelu.OP,
    bias_dropout_add.OP,
    layer_norm.OP,
    cross_entropy.OP,
    vocab_ce_partials.OP,
    vocab_ce_backward.OP,
    rms_norm.OP,
    swiglu.OP,
    rotary.OP,
)

# The ops with a backward, which the auto chooser times forward + backward.
DIFFERENTIABLE = tuple(op.name for op in OPS if op.differentiable)
