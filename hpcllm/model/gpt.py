"""GPT-2's parts: learned positions, pre-LayerNorm blocks with biases, a fused q|k|v
projection, a 4h tanh-GeLU MLP; the output layer is tied to the token embedding.

The torch half of the ``gpt2`` family (:mod:`hpcllm.families.gpt2`): the decoder, its stage
cut, recomputation, KV cache and sampling are :class:`~hpcllm.model.decoder.Decoder`'s; only
the parts are here.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from hpcllm import kernels
from hpcllm.config import ModelConfig
from hpcllm.model.decoder import Decoder, DecoderParts, SelfAttention
from hpcllm.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    normal_init,
)


class LayerNorm(nn.Module):
    """LayerNorm through the fused-op dispatch point."""

    def __init__(self, dim: int, eps: float, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.layer_norm(x, self.weight, self.bias, self.eps)


class LearnedPositions(nn.Embedding):
    """One learned vector per position up to ``model.seq_len`` (``wpe``)."""

    def __init__(self, cfg: ModelConfig, gen: torch.Generator, sequence_parallel: bool) -> None:
        super().__init__(cfg.seq_len, cfg.d_model)
        normal_init(cfg.init_std)(self.weight, gen)


class Attention(SelfAttention):
    """Causal self-attention with a fused q|k|v projection (column-parallel, stride 3: each
    rank keeps its heads' q, k and v together), heads split over the tp group."""

    def __init__(
        self, cfg: ModelConfig, group: Any, gen: torch.Generator, sequence_parallel: bool = False
    ) -> None:
        super().__init__(cfg, group, kv_heads=cfg.n_head)
        h = cfg.d_model
        self.qkv = ColumnParallelLinear(
            h,
            3 * h,
            group=group,
            gen=gen,
            init=normal_init(cfg.init_std),
            stride=3,
            sequence_parallel=sequence_parallel,
        )
        self.proj = RowParallelLinear(
            h,
            h,
            group=group,
            gen=gen,
            init=normal_init(cfg.init_std / math.sqrt(2 * cfg.n_layer)),
            sequence_parallel=sequence_parallel,
        )

    def project(
        self, x: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return q, k and v (b, heads, s, d); positions are the embedding's, not theirs."""
        qkv = self.qkv(x)  # (b, s, 3h/t): the whole sequence, even under sequence parallelism
        b, s, _ = qkv.shape
        q, k, v = (
            part.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)
            for part in qkv.chunk(3, dim=-1)
        )
        return q, k, v


class MLP(nn.Module):
    """h → 4h (column-parallel) → GeLU → h (row-parallel); returns output without bias."""

    def __init__(
        self, cfg: ModelConfig, group: Any, gen: torch.Generator, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        h = cfg.d_model
        self.fc = ColumnParallelLinear(
            h,
            4 * h,
            group=group,
            gen=gen,
            init=normal_init(cfg.init_std),
            sequence_parallel=sequence_parallel,
        )
        self.proj = RowParallelLinear(
            4 * h,
            h,
            group=group,
            gen=gen,
            init=normal_init(cfg.init_std / math.sqrt(2 * cfg.n_layer)),
            sequence_parallel=sequence_parallel,
        )

    def forward(
        self, x: torch.Tensor, add_bias: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (output, bias) as :meth:`SelfAttention.forward` does.

        With ``add_bias`` each matmul adds its bias itself (``addmm``), as plain PyTorch does
        where no fused kernel takes the bias.
        """
        if add_bias:
            y = kernels.bias_gelu(self.fc(x), None)
        else:
            y = kernels.bias_gelu(self.fc(x, add_bias=False), self.fc.bias)
        return self.proj(y, add_bias=add_bias), None if add_bias else self.proj.bias


class GPT(Decoder):
    """GPT-2 (or this rank's tensor-parallel shard, or one pipeline stage): the decoder with
    GPT-2's parts, its weights named as GPT-2's checkpoints name them."""

    parts = DecoderParts(
        norm=LayerNorm,
        attention=Attention,
        mlp=MLP,
        positions=LearnedPositions,
        norm_names=("ln1", "ln2", "ln_f"),
        expert_activation="gelu",
    )
