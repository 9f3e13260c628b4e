"""Llama's parts: RMSNorm, rotary positions, grouped-query attention, a SwiGLU MLP, no biases.

The torch half of the ``llama`` family (:mod:`hpcllm.families.llama`): the decoder, its stage
cut, the tied or untied output layer, recomputation, KV cache and sampling are
:class:`~hpcllm.model.decoder.Decoder`'s; only the parts are here.

Rotary embeddings rotate the two halves of each head (the convention of Hugging Face's Llama,
whose checkpoints then need no permutation); Llama 3.1's scaling divides the low frequencies
by ``rope_scaling``, keeps the high ones and blends those between (Meta's Llama 3.1 release).
With fewer key/value heads than tensor-parallel ranks, each rank keeps the one head its query
heads use; the ranks sharing a head sum its gradient (:mod:`hpcllm.parallel.data.finalize`).
RMSNorm, the SwiGLU activation and the rotation are :mod:`hpcllm.kernels` ops: fused Triton
kernels where ``model.fused_kernels`` enables them, their torch references elsewhere.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from hpcllm import kernels
from hpcllm.config import ModelConfig
from hpcllm.families.llama import ffn_size, head_dim, kv_heads
from hpcllm.model.decoder import Decoder, DecoderParts, SelfAttention
from hpcllm.parallel.tensor.deferred import linear
from hpcllm.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    mark_split,
    normal_init,
    sequence_parallel_linear,
)
from hpcllm.parallel.tensor.mappings import copy_to_tp, group_rank, group_size


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight, computed in fp32 (Zhang & Sennrich, 2019)."""

    def __init__(self, dim: int, eps: float, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Return the rotary inverse frequencies of one head (head_dim / 2 of them), with Llama
    3.1's scaling when ``rope_scaling`` is set."""
    size = head_dim(cfg)
    exponents = torch.arange(0, size, 2, dtype=torch.float64, device="cpu") / size
    inv = 1.0 / (cfg.rope_theta**exponents)
    if cfg.rope_scaling is None:
        return inv.float()
    factor, context = cfg.rope_scaling, cfg.rope_original_seq_len
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelength = 2 * math.pi / inv
    # Wavelengths longer than context/low are slowed down by the factor, shorter than
    # context/high kept; in between, a blend linear in context/wavelength.
    blend = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    scaled = (1 - blend) * inv / factor + blend * inv
    return scaled.float()


class ReplicatedHeadLinear(nn.Module):
    """The k (or v) projection when the tp ranks outnumber the key/value heads: rank r keeps
    head r // (t / heads), drawn from the whole weight as every layout draws it (its bias,
    where it has one, zero as every bias starts)."""

    def __init__(
        self,
        in_features: int,
        heads: int,
        head_dim: int,
        *,
        group: Any,
        gen: torch.Generator,
        init: Any,
        sequence_parallel: bool,
        bias: bool = False,
    ) -> None:
        super().__init__()
        t = group_size(group)
        self.group, self.sequence_parallel = group, sequence_parallel and t > 1
        replicas = t // heads
        full = torch.empty(heads * head_dim, in_features, dtype=torch.float32)
        init(full, gen)
        head = group_rank(group) // replicas
        self.weight = nn.Parameter(full[head * head_dim : (head + 1) * head_dim].clone())
        self.bias = nn.Parameter(torch.zeros(head_dim)) if bias else None
        # Split by head; the ranks sharing a head sum its gradient, the first counts it (the
        # family's "kv-replicas" rule, hpcllm.parallel.roles).
        mark_split(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return sequence_parallel_linear(x, self.weight, self.bias, self.group)
        return linear(copy_to_tp(x, self.group), self.weight, self.bias)


class LlamaAttention(SelfAttention):
    """Causal grouped-query attention with rotary positions; q split by head over the tp
    group, k and v split by head or replicated (:class:`ReplicatedHeadLinear`).

    Qwen's variants, as the model keys ask: heads ``head_dim`` wide whatever d_model is
    (q and the output projection then map d_model to and from n_head × head_dim); biases on
    q, k and v (``qkv_bias``, split with their heads); an RMSNorm over each head's queries
    and keys before the rotation (``qk_norm``: one weight of head_dim shared by the heads, so
    whole on every tp rank, its gradient summed over them).
    """

    def __init__(
        self, cfg: ModelConfig, group: Any, gen: torch.Generator, sequence_parallel: bool = False
    ) -> None:
        kv = kv_heads(cfg)
        super().__init__(cfg, group, kv_heads=kv, head_dim=head_dim(cfg))
        h, t, width = cfg.d_model, group_size(group), cfg.n_head * self.head_dim
        common = {"group": group, "gen": gen, "sequence_parallel": sequence_parallel}
        bias = bool(cfg.qkv_bias)
        self.q = ColumnParallelLinear(h, width, init=normal_init(cfg.init_std), bias=bias, **common)
        for name in ("k", "v"):
            if kv % t == 0:
                layer: nn.Module = ColumnParallelLinear(
                    h, kv * self.head_dim, init=normal_init(cfg.init_std), bias=bias, **common
                )
            else:
                layer = ReplicatedHeadLinear(
                    h, kv, self.head_dim, init=normal_init(cfg.init_std), bias=bias, **common
                )
            setattr(self, name, layer)
        self.proj = RowParallelLinear(
            width,
            h,
            init=normal_init(cfg.init_std / math.sqrt(2 * cfg.n_layer)),
            bias=False,
            **common,
        )
        self.q_norm = RMSNorm(self.head_dim, cfg.layer_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.layer_norm_eps) if cfg.qk_norm else None
        # Numbers, not a buffer: a model built on the meta device and loaded from a
        # checkpoint (which holds no buffers) must still have them.
        self.inv_freq = tuple(rope_frequencies(cfg).tolist())

    def rotary(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Return x (b, s, heads, head_dim) rotated to its tokens' ``positions`` ((s,) or
        (b, s); None: 0 … s - 1) (the fused op)."""
        inv = torch.tensor(self.inv_freq, device=x.device, dtype=torch.float32)
        return kernels.rotary(x, inv, 0 if positions is None else positions)

    def project(
        self, x: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return q, k and v (b, heads, s, d), q and k rotated to the tokens' ``positions``
        ((s,) or (b, s); None: 0 … s - 1); k and v hold this rank's key/value heads (shared by
        its query heads)."""
        q = self.q(x)  # (b, s, heads/t · d): the whole sequence, even under SP
        b, s, _ = q.shape
        # Rotated in (b, s, heads, d), the projections' own layout, then heads first for SDPA.
        q = q.view(b, s, self.local_heads, self.head_dim)
        k = self.k(x).view(b, s, self.local_kv, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            # The norms compute in fp32 (their weights'): back to the projections' dtype.
            q, k = self.q_norm(q).to(q.dtype), self.k_norm(k).to(k.dtype)
        q = self.rotary(q, positions).transpose(1, 2)
        k = self.rotary(k, positions).transpose(1, 2)
        v = self.v(x).view(b, s, self.local_kv, self.head_dim).transpose(1, 2)
        return q, k, v


class SwiGLU(nn.Module):
    """SiLU(x·G) ⊙ (x·U) → D (Shazeer, 2020): gate and up column-parallel, down row-parallel."""

    def __init__(
        self, cfg: ModelConfig, group: Any, gen: torch.Generator, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        h, f = cfg.d_model, ffn_size(cfg)
        common = {"group": group, "gen": gen, "sequence_parallel": sequence_parallel}
        self.gate = ColumnParallelLinear(h, f, init=normal_init(cfg.init_std), bias=False, **common)
        self.up = ColumnParallelLinear(h, f, init=normal_init(cfg.init_std), bias=False, **common)
        self.proj = RowParallelLinear(
            f,
            h,
            init=normal_init(cfg.init_std / math.sqrt(2 * cfg.n_layer)),
            bias=False,
            **common,
        )

    def forward(self, x: torch.Tensor, add_bias: bool = False) -> tuple[torch.Tensor, None]:
        """Return (output, None): no bias to add."""
        return self.proj(kernels.swiglu(self.gate(x), self.up(x))), None


class Llama(Decoder):
    """Llama (or this rank's tensor-parallel shard, or one pipeline stage): the decoder with
    Llama's parts, its weights named as Hugging Face's Llama names them, less the prefixes.
    The output layer is the token embedding when ``tie_embeddings``, else ``lm_head``."""

    parts = DecoderParts(
        norm=RMSNorm,
        attention=LlamaAttention,
        mlp=SwiGLU,
        norm_names=("norm1", "norm2", "norm_f"),
        expert_activation="swiglu",
        mlp_width=ffn_size,
    )
