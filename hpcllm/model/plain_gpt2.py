"""GPT-2 as a user would write it in plain PyTorch: the ``gpt2`` family's baseline
(:attr:`hpcllm.families.Family.reference`), which ``hpcllm bench step`` measures hpcllm against.

nanoGPT's shape: learned positions, pre-LayerNorm blocks, ``is_causal`` scaled-dot-product
attention, tanh GeLU, the output layer tied to the token embedding, the vocabulary padded by
the caller (50257 → 50304). Its sizes come from the model config; nothing of hpcllm computes
in it, so it measures what hpcllm's layers, kernels and step add or save, not a weak baseline.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hpcllm import families


class _Attention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.n_head, self.dropout = n_head, dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.c_attn(x).split(h, dim=2)
        q, k, v = (t.view(b, s, self.n_head, h // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, s, h)))


class _MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.c_proj = nn.Linear(4 * d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class _Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float, eps: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model, eps=eps)
        self.attn = _Attention(d_model, n_head, dropout)
        self.ln_2 = nn.LayerNorm(d_model, eps=eps)
        self.mlp = _MLP(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class PlainGPT2(nn.Module):
    """GPT-2 in plain PyTorch; ``forward(ids, targets)`` returns the mean cross-entropy."""

    def __init__(self, model: Any, vocab_size: int, *, seed: int = 1234) -> None:
        """Build the model of ``model`` (a ``cfg.model``) over ``vocab_size`` ids (padded by
        the caller), its weights drawn from ``seed``."""
        super().__init__()
        shape = families.shape(model, vocab_size)
        h, layers, std = shape.hidden, shape.layers, model.init_std
        torch.manual_seed(seed)
        self.wte = nn.Embedding(vocab_size, h)
        self.wpe = nn.Embedding(shape.seq, h)
        self.drop = nn.Dropout(model.dropout)
        self.blocks = nn.ModuleList(
            _Block(h, shape.heads, model.dropout, model.layer_norm_eps) for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(h, eps=model.layer_norm_eps)
        self.lm_head = nn.Linear(h, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, std=std / math.sqrt(2 * layers))
            elif param.dim() >= 2:
                nn.init.normal_(param, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(param)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.wte(ids) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
