"""Cross-entropy over vocabulary-parallel logits, without gathering them (Megatron's seam)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hpcllm import kernels
from hpcllm.kernels.ops.cross_entropy import counted_mean, row_gradients
from hpcllm.parallel.tensor.mappings import all_reduce, record


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits whose vocabulary is split across the tp group.

    Two all-reduces of (b, s) values replace a gather of the (b, s, V) logits: the maximum,
    then each rank's sum of exponentials (rescaled to that maximum) stacked with the target's
    logit from whichever rank holds it. The per-slice pass and the gradient are
    :mod:`hpcllm.kernels` ops (one fused Triton kernel each on CUDA), and backward recomputes
    the softmax from the saved log-sum-exp rather than keeping it in fp32.
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        group: Any,
        vocab_start: int,
        vocab_size: int,
    ) -> torch.Tensor:
        rows, flat = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        top, sumexp, target = kernels.vocab_ce_partials(rows, flat, vocab_start, vocab_size)
        global_top = top.clone()
        record("all_reduce", global_top.numel() * global_top.element_size(), False)
        dist.all_reduce(global_top, op=dist.ReduceOp.MAX, group=group)
        # A slice that holds only padding has max -inf and sum 0: it adds nothing.
        scaled = torch.where(
            sumexp > 0, sumexp * torch.exp(top - global_top), torch.zeros_like(sumexp)
        )
        sums = all_reduce(torch.stack([scaled, target]), group, backward=False)
        lse = global_top + sums[0].log()
        ctx.save_for_backward(rows, flat, lse)
        ctx.shape, ctx.vocab_start, ctx.vocab_size = logits.shape, vocab_start, vocab_size
        return counted_mean(lse - sums[1], flat)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        rows, flat, lse = ctx.saved_tensors
        d_logits = kernels.vocab_ce_backward(
            rows, flat, lse, row_gradients(grad, flat), ctx.vocab_start, ctx.vocab_size
        )
        return d_logits.view(ctx.shape), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, group: Any, vocab_start: int, vocab_size: int
) -> torch.Tensor:
    """Return the mean token cross-entropy of vocabulary-split logits, never gathering them.

    ``logits`` is this rank's (..., V_padded / t) slice starting at ``vocab_start``; columns at
    or past ``vocab_size`` (the real vocabulary) are padding and excluded, so the loss equals
    the unpadded single-GPU loss; labels under 0 take no loss (the mean is over the others).
    """
    return _VocabParallelCrossEntropy.apply(logits, labels, group, vocab_start, vocab_size)
