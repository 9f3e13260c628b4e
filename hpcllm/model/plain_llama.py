"""Llama as a user would write it in plain PyTorch: the ``llama`` family's baseline
(:attr:`hpcllm.families.Family.reference`), which ``hpcllm bench step`` measures hpcllm against.

Pre-RMSNorm blocks (``nn.RMSNorm``), rotary positions from cos/sin tables built once (each
half of a head paired with the other, Hugging Face's convention), grouped-query attention
through ``scaled_dot_product_attention(enable_gqa=True)``, a SwiGLU MLP, no biases but
Qwen2's on q, k and v where the model has them (and Qwen3's q and k norms), an output layer
tied to the embedding or not. Its sizes come from the model config through the family,
and its rotary frequencies are hpcllm's (:func:`hpcllm.model.llama.rope_frequencies`, Llama
3.1's scaling included), so that both compute the same function; nothing else of hpcllm is in
it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hpcllm import families
from hpcllm.model.llama import rope_frequencies


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-second, first), dim=-1) * sin.to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, shape: families.Shape, eps: float) -> None:
        super().__init__()
        h, bias = shape.hidden, shape.qkv_bias
        self.n_head, self.n_kv = shape.heads, shape.kv_heads or shape.heads
        self.head_dim = shape.head_size
        self.q_proj = nn.Linear(h, shape.attention_width, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(shape.attention_width, h, bias=False)
        for projection in (self.q_proj, self.k_proj, self.v_proj):
            if projection.bias is not None:  # as hpcllm's start
                nn.init.zeros_(projection.bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=eps) if shape.qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(self.head_dim, eps=eps) if shape.qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, s, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_head
        )
        return self.o_proj(y.transpose(1, 2).reshape(b, s, self.n_head * self.head_dim))


class _MLP(nn.Module):
    def __init__(self, d_model: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, ffn, bias=False)
        self.up_proj = nn.Linear(d_model, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, shape: families.Shape, eps: float) -> None:
        super().__init__()
        h = shape.hidden
        self.input_norm = nn.RMSNorm(h, eps=eps)
        self.attn = _Attention(shape, eps)
        self.post_norm = nn.RMSNorm(h, eps=eps)
        self.mlp = _MLP(h, shape.ffn or 4 * h)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin)
        return x + self.mlp(self.post_norm(x))


class PlainLlama(nn.Module):
    """Llama in plain PyTorch; ``forward(ids, targets)`` returns the mean cross-entropy."""

    def __init__(self, model: Any, vocab_size: int, *, seed: int = 1234) -> None:
        """Build the model of ``model`` (a ``cfg.model``) over ``vocab_size`` ids (padded by
        the caller), its weights drawn from ``seed``."""
        super().__init__()
        shape = families.shape(model, vocab_size)
        h, layers, eps = shape.hidden, shape.layers, model.layer_norm_eps
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab_size, h)
        self.blocks = nn.ModuleList(_Block(shape, eps) for _ in range(layers))
        self.norm = nn.RMSNorm(h, eps=eps)
        self.lm_head = nn.Linear(h, vocab_size, bias=False)
        if shape.tied:
            self.lm_head.weight = self.embed.weight
        positions = torch.arange(shape.seq, dtype=torch.float32)
        angles = torch.outer(positions, rope_frequencies(model))
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for name, param in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(param, std=model.init_std / math.sqrt(2 * layers))
            elif param.dim() >= 2:
                nn.init.normal_(param, std=model.init_std)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
