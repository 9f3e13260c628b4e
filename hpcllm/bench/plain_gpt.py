"""The baseline of ``hpcllm bench step``: GPT-2 as a user would write it in plain PyTorch.

nanoGPT's shape: learned positions, pre-LayerNorm blocks, ``is_causal`` scaled-dot-product
attention, tanh GeLU, the output layer tied to the token embedding, the vocabulary padded by
the caller (50257 → 50304), AdamW fused on CUDA. Nothing from hpcllm is in it, so it measures
what hpcllm's layers, kernels and step add or save, not a weak baseline.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


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
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = _Attention(d_model, n_head, dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = _MLP(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class PlainGPT(nn.Module):
    """GPT-2 in plain PyTorch; ``forward(ids, targets)`` returns the mean cross-entropy."""

    def __init__(
        self,
        vocab_size: int,
        n_layer: int,
        n_head: int,
        d_model: int,
        seq_len: int,
        dropout: float = 0.0,
        seed: int = 1234,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * n_layer))
            elif param.dim() >= 2:
                nn.init.normal_(param, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(param)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.wte(ids) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def plain_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """Return nanoGPT's AdamW: decay on matrices only, fused on CUDA, foreach elsewhere."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    cuda = next(model.parameters()).is_cuda
    return torch.optim.AdamW(
        groups, lr=lr, betas=(0.9, 0.95), fused=cuda or None, foreach=None if cuda else True
    )
