"""Fused operators (imported as ``hpcllm.kernels``), one dispatch point per op.

The model calls these functions and never the underlying implementation, so the Triton
kernels can replace the torch references here without the model changing. Today every op runs
its torch reference, which is also the oracle the fused kernels are tested against.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hpcllm.errors import UserError

_GELU_C = math.sqrt(2.0 / math.pi)


def resolve_fused(setting: str, device: torch.device) -> bool:
    """Return whether fused kernels run for ``model.fused_kernels`` on ``device``.

    ``auto`` is off until the Triton kernels exist; ``on`` says so instead of silently
    falling back.
    """
    if setting == "on":
        raise UserError("model.fused_kernels: on needs the Triton kernels, which this version "
                        "does not ship yet; use auto or off")
    return False


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Return GeLU(x + bias), tanh approximation (GPT-2's ``gelu_new``)."""
    if bias is not None:
        x = x + bias
    return 0.5 * x * (1.0 + torch.tanh(_GELU_C * (x + 0.044715 * x * x * x)))


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                     p: float, training: bool) -> torch.Tensor:
    """Return residual + dropout(x + bias)."""
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=p, training=training)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
               eps: float) -> torch.Tensor:
    """Return LayerNorm over the last dimension."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Return the mean token cross-entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
