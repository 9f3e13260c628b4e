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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Return RMSNorm over the last dimension: weight · (x / sqrt(mean(x²) + eps)), the
    statistics in fp32, the normalised row rounded to x's dtype before the weight."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Return SiLU(gate) · up, the SwiGLU MLP's activation (Shazeer, 2020)."""
    return F.silu(gate) * up


def rope_angles(
    inv_freq: torch.Tensor, seq: int, offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the cosines and sines (seq, head_dim) of positions offset … offset + seq - 1:
    position × inv_freq in fp32, each frequency for both halves of a head."""
    positions = torch.arange(offset, offset + seq, device=inv_freq.device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq.float())
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotary(
    x: torch.Tensor, inv_freq: torch.Tensor, offset: int = 0, sign: float = 1.0
) -> torch.Tensor:
    """Return x (b, s, heads, head_dim) rotated by its positions' angles: each half of a head
    pairs with the other (Hugging Face's Llama convention). ``sign`` -1 rotates back."""
    cos, sin = rope_angles(inv_freq, x.shape[1], offset)
    cos, sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    if sign != 1.0:
        sin = sin * sign
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin
