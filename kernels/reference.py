"""Torch references of the fused ops: what runs without Triton, and the kernels' test oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Return GeLU(x + bias), tanh approximation (GPT-2's ``gelu_new``)."""
    return F.gelu(x if bias is None else x + bias, approximate="tanh")


def bias_dropout_add(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, training: bool
) -> torch.Tensor:
    """Return residual + dropout(x + bias)."""
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=p, training=training)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """Return LayerNorm over the last dimension."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None
) -> torch.Tensor:
    """Return the mean token cross-entropy in fp32, over the first ``vocab_size`` columns."""
    if vocab_size is not None:
        logits = logits[..., :vocab_size]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _slice_masks(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (padding columns, label's column in the slice or 0, whether the slice holds it)."""
    local = logits.shape[-1]
    padding = torch.arange(vocab_start, vocab_start + local, device=logits.device) >= vocab_size
    inside = (labels >= vocab_start) & (labels < vocab_start + local)
    return padding, (labels - vocab_start).masked_fill(~inside, 0), inside


def vocab_ce_partials(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return per-row (max, sum of exp(x - max), label's logit or 0) of a vocabulary slice."""
    padding, local_labels, inside = _slice_masks(logits, labels, vocab_start, vocab_size)
    x = logits.float().masked_fill(padding, float("-inf"))
    top = x.max(dim=-1).values
    sumexp = (x - top.masked_fill(top == float("-inf"), 0.0).unsqueeze(-1)).exp().sum(dim=-1)
    target = x.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
    return top, sumexp, target


def vocab_ce_backward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    grad: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
) -> torch.Tensor:
    """Return (exp(x - lse) - onehot(label)) * grad in the logits' dtype; 0 on padding."""
    padding, local_labels, inside = _slice_masks(logits, labels, vocab_start, vocab_size)
    d = (logits.float() - lse.unsqueeze(-1)).exp().masked_fill(padding, 0.0)
    d.scatter_add_(-1, local_labels.unsqueeze(-1), -inside.float().unsqueeze(-1))
    return (d * grad.float().reshape(-1, 1)).to(logits.dtype)
