"""Llama: RMSNorm, rotary positions, grouped-query attention, a SwiGLU MLP, no biases.

The torch half of the ``llama`` family (:mod:`hpcllm.families.llama`), built from the same
tensor-parallel layers as GPT-2 and cut into stages the same way (a stage holds some blocks,
the embedding if first, the final norm and output layer if last). Only what differs from
:class:`~hpcllm.model.gpt.GPT` is here; the block loop, recomputation, the stage boundary and
sampling are GPT's.

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
import torch.nn.functional as F
from torch import nn

from hpcllm import kernels
from hpcllm.config import ModelConfig
from hpcllm.families.llama import ffn_size, kv_heads
from hpcllm.model.gpt import GPT, Attention, LayerCache, cached_attention, dropout_rng, tp_size
from hpcllm.parallel.pipeline.zero_bubble import linear
from hpcllm.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mark_sequence_parallel,
    normal_init,
    sequence_parallel_linear,
)
from hpcllm.parallel.tensor.mappings import copy_to_tp, group_rank


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight, computed in fp32 (Zhang & Sennrich, 2019)."""

    def __init__(self, dim: int, eps: float, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        if sequence_parallel:
            mark_sequence_parallel(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Return the rotary inverse frequencies of one head (head_dim / 2 of them), with Llama
    3.1's scaling when ``rope_scaling`` is set."""
    head_dim = cfg.d_model // cfg.n_head
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim
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
    head r // (t / heads), drawn from the whole weight as every layout draws it."""

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
    ) -> None:
        super().__init__()
        t = tp_size(group)
        self.group, self.sequence_parallel = group, sequence_parallel and t > 1
        replicas = t // heads
        full = torch.empty(heads * head_dim, in_features, dtype=torch.float32)
        init(full, gen)
        head = group_rank(group) // replicas
        self.weight = nn.Parameter(full[head * head_dim : (head + 1) * head_dim].clone())
        self.weight.tensor_parallel = True
        self.weight.partition = (0, 1, replicas)
        # The ranks sharing a head sum its gradient; only the first of them counts it.
        self.weight.kv_replicas = replicas
        self.weight.tp_duplicate = group_rank(group) % replicas != 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return sequence_parallel_linear(x, self.weight, None, self.group)
        return linear(copy_to_tp(x, self.group), self.weight)


class LlamaAttention(Attention):
    """Causal grouped-query attention with rotary positions; q split by head over the tp
    group, k and v split by head or replicated (:class:`ReplicatedHeadLinear`)."""

    def __init__(
        self, cfg: ModelConfig, group: Any, gen: torch.Generator, sequence_parallel: bool = False
    ) -> None:
        nn.Module.__init__(self)
        h, t, kv = cfg.d_model, tp_size(group), kv_heads(cfg)
        self.group = group
        self.local_heads = cfg.n_head // t
        self.head_dim = h // cfg.n_head
        self.local_kv = kv // t if kv % t == 0 else 1
        self.dropout = cfg.dropout
        self.selective = cfg.recompute == "selective"
        common = {"group": group, "gen": gen, "sequence_parallel": sequence_parallel}
        self.q = ColumnParallelLinear(h, h, init=normal_init(cfg.init_std), bias=False, **common)
        for name in ("k", "v"):
            if kv % t == 0:
                layer: nn.Module = ColumnParallelLinear(
                    h, kv * self.head_dim, init=normal_init(cfg.init_std), bias=False, **common
                )
            else:
                layer = ReplicatedHeadLinear(
                    h, kv, self.head_dim, init=normal_init(cfg.init_std), **common
                )
            setattr(self, name, layer)
        self.proj = RowParallelLinear(
            h,
            h,
            init=normal_init(cfg.init_std / math.sqrt(2 * cfg.n_layer)),
            bias=False,
            **common,
        )
        # Numbers, not a buffer: a model built on the meta device and loaded from a
        # checkpoint (which holds no buffers) must still have them.
        self.inv_freq = tuple(rope_frequencies(cfg).tolist())

    def rotary(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Return x (b, s, heads, head_dim) rotated by positions offset … offset + s - 1 (the
        fused op)."""
        inv = torch.tensor(self.inv_freq, device=x.device, dtype=torch.float32)
        return kernels.rotary(x, inv, offset)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with dropout_rng(self.group, self.dropout, self.training):
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                is_causal=True,
                dropout_p=self.dropout if self.training else 0.0,
                enable_gqa=self.local_kv != self.local_heads,
            )

    def forward(
        self, x: torch.Tensor, add_bias: bool = False, cache: LayerCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (output, None): the projections have no bias. With ``cache`` (generation) x
        holds the new tokens, at the positions after the cached ones; the cache keeps the
        shared key/value heads, once."""
        q = self.q(x)  # (b, s, heads/t · d): the whole sequence, even under SP
        b, s, _ = q.shape
        offset = 0 if cache is None else cache.length
        # Rotated in (b, s, heads, d), the projections' own layout, then heads first for SDPA.
        q = self.rotary(q.view(b, s, self.local_heads, self.head_dim), offset).transpose(1, 2)
        k = self.k(x).view(b, s, self.local_kv, self.head_dim)
        k = self.rotary(k, offset).transpose(1, 2)
        v = self.v(x).view(b, s, self.local_kv, self.head_dim).transpose(1, 2)
        if cache is not None:
            y = cached_attention(q, k, v, cache, gqa=self.local_kv != self.local_heads)
        elif self.selective and self.training:
            y = self._recomputed_core(q, k, v)
        else:
            y = self._core(q, k, v)
        y = y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)
        return self.proj(y), None


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(kernels.swiglu(self.gate(x), self.up(x)))


class LlamaBlock(nn.Module):
    """Pre-RMSNorm block: x + attn(norm1(x)), then + mlp(norm2(x)); dropout (if any) on each
    branch, from the tensor-parallel stream under sequence parallelism."""

    def __init__(
        self, cfg: ModelConfig, group: Any, gen: torch.Generator, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        sp = sequence_parallel and tp_size(group) > 1
        self.norm1 = RMSNorm(cfg.d_model, cfg.layer_norm_eps, sp)
        self.attn = LlamaAttention(cfg, group, gen, sp)
        self.norm2 = RMSNorm(cfg.d_model, cfg.layer_norm_eps, sp)
        self.mlp = SwiGLU(cfg, group, gen, sp)
        self.dropout = cfg.dropout
        self.rng_group = group if sp else None

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        out, _ = self.attn(self.norm1(x), cache=cache)
        with dropout_rng(self.rng_group, self.dropout, self.training):
            x = kernels.bias_dropout_add(out, None, x, self.dropout, self.training)
        out = self.mlp(self.norm2(x))
        with dropout_rng(self.rng_group, self.dropout, self.training):
            return kernels.bias_dropout_add(out, None, x, self.dropout, self.training)


class Llama(GPT):
    """The whole Llama (or one tensor-parallel shard, or one pipeline stage): the keywords and
    the stage rules are :class:`~hpcllm.model.gpt.GPT`'s. The output layer is the token
    embedding when ``tie_embeddings``, else its own vocabulary-parallel weight (``lm_head``),
    drawn after the blocks."""

    def __init__(
        self,
        cfg: ModelConfig,
        vocab_size: int,
        *,
        tp_group: Any = None,
        seed: int = 1234,
        sequence_parallel: bool = False,
        layers: range | None = None,
        pre: bool = True,
        post: bool = True,
    ) -> None:
        nn.Module.__init__(self)
        layers, gen = self.setup(cfg, vocab_size, tp_group, seed, sequence_parallel, layers)
        self.pre, self.post = pre, post
        self.tied = bool(cfg.tie_embeddings)
        vocab = {
            "group": tp_group,
            "gen": gen,
            "init": normal_init(cfg.init_std),
            "real_rows": vocab_size,
        }
        wte = VocabParallelEmbedding(
            self.padded_vocab, cfg.d_model, sequence_parallel=self.sequence_parallel, **vocab
        )
        if pre or (post and self.tied):
            self.wte = wte
        blocks = {}
        for index in range(cfg.n_layer):
            block = LlamaBlock(cfg, tp_group, gen, self.sequence_parallel)
            if index in layers:
                blocks[str(index)] = block
        self.blocks = nn.ModuleDict(blocks)
        if post:
            self.norm_f = RMSNorm(cfg.d_model, cfg.layer_norm_eps, self.sequence_parallel)
            if not self.tied:
                self.lm_head = VocabParallelEmbedding(self.padded_vocab, cfg.d_model, **vocab)

    def embed(self, ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Return the token embeddings (after dropout) of ``ids`` (b, s); no positions (the
        attention rotates q and k, from ``offset``). Under sequence parallelism, this rank's
        part."""
        self.check_length(offset + ids.shape[1])
        return self.dropout_embedding(self.wte(ids))

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """Return the final RMSNorm of ``x``."""
        return self.norm_f(x)

    def output_layer(self) -> VocabParallelEmbedding:
        """Return the output layer: the embedding when tied, else ``lm_head``."""
        return self.wte if self.tied else self.lm_head
