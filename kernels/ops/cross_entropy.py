"""``cross_entropy``: the mean token cross-entropy, in fp32 whatever the logits' dtype.

A label under 0 (``IGNORE``, PyTorch's ignore_index -100) takes no loss: the mean is over the
rows whose label counts (0 when none does), and those rows get no gradient
(data.mask_eod_loss). The vocabulary-parallel halves with ``vocab_start = 0``: forward is
:mod:`.vocab_ce_partials`' kernel (one pass over the logits) and the log-sum-exp it saves;
backward is ``hpcllm::vocab_ce_backward`` with the mean's gradient g / rows. Columns at or past
``vocab_size`` are padding and excluded, so the padded logits are passed as they are (a
strided view: no copy). Custom op::

    hpcllm::cross_entropy(logits, labels, vocab_size) -> (loss, lse)

On the CPU without the interpreter: the partials' reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from hpcllm.kernels.ops import vocab_ce_partials
from hpcllm.kernels.registry import BenchCase, BenchShape, FusedOp, register

# ---------------------------------------------------------------- launcher


def launch_forward(logits: Tensor, labels: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    """Return (mean cross-entropy, per-row log-sum-exp), fp32, of (rows, columns) logits."""
    top, sumexp, target = vocab_ce_partials.launch_forward(logits, labels, 0, vocab_size)
    lse = top + sumexp.log()
    return counted_mean(lse - target, labels), lse


# ---------------------------------------------------------------- reference


def reference(logits: Tensor, labels: Tensor, vocab_size: int | None = None) -> Tensor:
    """Return the mean token cross-entropy in fp32, over the first ``vocab_size`` columns and
    the labels that count (0 or more)."""
    if vocab_size is not None:
        logits = logits[..., :vocab_size]
    flat = labels.reshape(-1)
    # Rows whose label does not count are computed against column 0 and left out of the mean
    # (no host sync, so a compiled graph keeps it whole).
    losses = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), flat.clamp(min=0), reduction="none"
    )
    return counted_mean(losses, flat)


def counted_mean(losses: Tensor, labels: Tensor) -> Tensor:
    """Return the mean of the rows' ``losses`` whose label counts (0 or more); 0 if none."""
    counted = labels >= 0
    return torch.where(counted, losses, 0.0).sum() / counted.sum().clamp(min=1)


def row_gradients(grad: Tensor, labels: Tensor) -> Tensor:
    """Return each row's share of a counted mean's gradient ``grad``: grad / rows counted
    where its label counts, 0 where it does not."""
    counted = labels >= 0
    return torch.where(counted, grad.float() / counted.sum().clamp(min=1), 0.0)


# ---------------------------------------------------------------- custom op


def _torch_forward(logits: Tensor, labels: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    top, sumexp, target = vocab_ce_partials.reference(logits, labels, 0, vocab_size)
    lse = top + sumexp.log()
    return counted_mean(lse - target, labels), lse


def _fake(logits: Tensor, labels: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    return logits.new_empty((), dtype=torch.float32), logits.new_empty(
        logits.shape[0], dtype=torch.float32
    )


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple):
    logits, labels, vocab_size = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(logits, labels, output[1])
    ctx.vocab_size = vocab_size


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor, _: Tensor) -> tuple:
    logits, labels, lse = ctx.saved_tensors
    dlogits = torch.ops.hpcllm.vocab_ce_backward(
        logits, labels, lse, row_gradients(grad, labels), 0, ctx.vocab_size
    )
    return dlogits, None, None


register(
    "cross_entropy",
    "(Tensor logits, Tensor labels, SymInt vocab_size) -> (Tensor, Tensor)",
    triton=launch_forward,
    torch_impl=_torch_forward,
    fake=_fake,
    setup_context=_setup_context,
    backward=_backward,
)


# ---------------------------------------------------------------- the op


def cross_entropy(logits: Tensor, labels: Tensor, vocab_size: int | None = None) -> Tensor:
    """Return the mean token cross-entropy, computed in fp32 whatever the logits' dtype.

    With ``vocab_size``, columns at or past it are padding and excluded: passing the padded
    logits this way saves the copy that slicing them would cost in backward. The logits are
    flattened to rows as a view: padded logits' rows keep their stride.
    """
    rows = logits.reshape(-1, logits.shape[-1])
    vocab = logits.shape[-1] if vocab_size is None else vocab_size
    return torch.ops.hpcllm.cross_entropy(rows, labels.reshape(-1), vocab)[0]


def _has_labels(logits: Tensor, labels: Tensor, vocab_size: int | None = None) -> bool:
    return labels.numel() > 0


def bench(shape: BenchShape) -> BenchCase:
    """Return the loss over bf16 logits padded to a multiple of 128 columns."""
    logits = shape.randn(shape.rows, shape.padded_vocab, dtype=torch.bfloat16, scale=2.0)
    labels = torch.randint(
        0, shape.vocab, (shape.rows,), generator=shape.generator, device=shape.device
    )
    return BenchCase(
        "cross_entropy",
        lambda fn, _: fn(logits, labels, shape.vocab),
        [logits],
        fwd_bytes=2 * shape.rows * shape.padded_vocab,
        bwd_bytes=2 * 2 * shape.rows * shape.padded_vocab,
    )


# As the vocabulary-parallel halves: auto keeps the kernel inside compiled graphs.
OP = FusedOp(
    "cross_entropy",
    fused=cross_entropy,
    reference=reference,
    supported=_has_labels,
    in_compiled_graphs=True,
    bench=bench,
)
