"""Megatron's tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

With a tp group of one rank each layer is an ordinary Linear or Embedding. Weights are
initialised whole, from the same generator on every rank, and each rank keeps its slice, so a
model built with t > 1 holds exactly the shards of the t = 1 model from the same seed.
Each layer marks how it split its weights (:func:`mark_split`); a model's parameters then take
their roles from the family's rules, checked against these marks (:mod:`hpcllm.parallel.roles`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hpcllm.parallel.tensor.deferred import linear, weight_grad_or_defer
from hpcllm.parallel.tensor.mappings import (
    SEQ_DIM,
    copy_to_tp,
    gather,
    gather_from_tp,
    group_rank,
    group_size,
    reduce_from_tp,
    reduce_scatter,
    reduce_scatter_to_sequence,
    scatter_to_tp,
)

InitFn = Callable[[torch.Tensor, torch.Generator], None]


class _SequenceParallelLinear(torch.autograd.Function):
    """All-gather the sequence, then a linear layer, storing only this rank's sequence part.

    Backward gathers the input again for the weight gradient instead of keeping the whole
    (b, s, h) input alive between forward and backward, as Megatron-LM does: that input is
    exactly the activation sequence parallelism exists to split.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Any
    ) -> torch.Tensor:
        ctx.group, ctx.weight, ctx.bias = group, weight, bias
        ctx.save_for_backward(x, weight)
        return F.linear(gather(x, group, False, SEQ_DIM), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        full = gather(x, ctx.group, True, SEQ_DIM).to(grad.dtype)
        grad_input = grad.matmul(weight.to(grad.dtype))
        grad_input = reduce_scatter(grad_input, ctx.group, True, SEQ_DIM)
        grad_weight, grad_bias = weight_grad_or_defer(ctx.weight, ctx.bias, full, grad)
        return grad_input.to(x.dtype), grad_weight, grad_bias, None


def sequence_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Any
) -> torch.Tensor:
    """Return ``linear(all_gather_sequence(x), weight, bias)``, storing only x's part."""
    if group_size(group) == 1:
        return linear(x, weight, bias)
    return _SequenceParallelLinear.apply(x, weight, bias, group)


def normal_init(std: float) -> InitFn:
    """Return an initialiser that draws N(0, std²) from the given generator."""

    def init(weight: torch.Tensor, gen: torch.Generator) -> None:
        with torch.no_grad():
            weight.normal_(0.0, std, generator=gen)

    return init


def mark_split(*params: nn.Parameter | None, dim: int = 0, stride: int = 1) -> None:
    """Record on parameters that hold a tp rank's slice along ``dim`` (see :func:`shard_of`)
    how their layer split them (``partition``), which the family's rules must repeat.

    Unmarked parameters are whole on every tp rank.
    """
    for param in params:
        if param is not None:
            param.partition = (dim, stride)


def merge_shards(shards: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """Return the whole tensor whose tp slices (:func:`shard_of`) are ``shards``, in rank order."""
    blocks = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([torch.cat([b[i] for b in blocks], dim=dim) for i in range(stride)], dim=dim)


def shard_of(full: torch.Tensor, dim: int, stride: int, rank: int, size: int) -> torch.Tensor:
    """Return tp rank ``rank``'s slice (of ``size``) of a whole tensor along ``dim``.

    ``stride`` > 1 splits each of ``stride`` equal blocks along ``dim`` separately (the fused
    q|k|v projection keeps its q, k and v heads together on each rank).
    """
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in blocks], dim=dim)


def _init_shard(
    shard: torch.Tensor,
    full_shape: tuple[int, ...],
    dim: int,
    stride: int,
    init: InitFn,
    gen: torch.Generator,
    group: Any,
) -> None:
    """Initialise the whole weight from ``gen`` and copy this rank's slice into ``shard``."""
    full = torch.empty(full_shape, dtype=torch.float32)
    init(full, gen)
    with torch.no_grad():
        shard.copy_(shard_of(full, dim, stride, group_rank(group), group_size(group)))


class ColumnParallelLinear(nn.Module):
    """Y = X·Aᵀ + b with A split by output rows: each rank computes its columns of Y."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group: Any,
        gen: torch.Generator,
        init: InitFn,
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        t = group_size(group)
        if out_features % (t * stride):
            raise ValueError(f"out_features {out_features} not divisible by tp {t} x {stride}")
        if sequence_parallel and gather_output:
            raise ValueError("a sequence-parallel input with gather_output is not supported")
        self.group, self.gather_output = group, gather_output
        self.sequence_parallel = sequence_parallel and t > 1
        self.weight = nn.Parameter(torch.empty(out_features // t, in_features))
        _init_shard(self.weight, (out_features, in_features), 0, stride, init, gen, group)
        self.bias = nn.Parameter(torch.zeros(out_features // t)) if bias else None
        mark_split(self.weight, self.bias, dim=0, stride=stride)

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """Return this rank's output columns (all of them with ``gather_output``).

        With sequence parallelism x is this rank's part of the sequence, gathered here.
        """
        bias = self.bias if add_bias else None
        if self.sequence_parallel:
            return sequence_parallel_linear(x, self.weight, bias, self.group)
        y = linear(copy_to_tp(x, self.group), self.weight, bias)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X·Aᵀ + b with A split by input columns: partial products summed over the tp group.

    The bias is added after the sum (once), or left to the caller (``add_bias=False``) so a
    fused bias-dropout-add can take it.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group: Any,
        gen: torch.Generator,
        init: InitFn,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        t = group_size(group)
        if in_features % t:
            raise ValueError(f"in_features {in_features} not divisible by tp {t}")
        self.group, self.input_is_parallel = group, input_is_parallel
        self.sequence_parallel = sequence_parallel and t > 1
        self.weight = nn.Parameter(torch.empty(out_features, in_features // t))
        _init_shard(self.weight, (out_features, in_features), 1, 1, init, gen, group)
        mark_split(self.weight, dim=1)  # the bias is whole on every rank
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """Return the whole output; with sequence parallelism, this rank's sequence part."""
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        if group_size(self.group) == 1:  # no sum: the matmul adds the bias (addmm)
            return linear(x, self.weight, self.bias if add_bias else None)
        y = linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.group)
        else:
            y = reduce_from_tp(y, self.group)
        return y + self.bias if (add_bias and self.bias is not None) else y


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split over the tp group."""

    def __init__(
        self,
        num_embeddings: int,
        dim: int,
        *,
        group: Any,
        gen: torch.Generator,
        init: InitFn,
        real_rows: int | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        t = group_size(group)
        if num_embeddings % t:
            raise ValueError(f"vocabulary {num_embeddings} not divisible by tp {t}")
        self.group = group
        self.sequence_parallel = sequence_parallel and t > 1
        per_rank = num_embeddings // t
        self.vocab_start = group_rank(group) * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, dim))
        # Only the real rows are drawn (padding rows are zero), so the generator's stream, and
        # with it every later weight, is the same whatever padding t asks for.
        real = real_rows or num_embeddings
        full = torch.zeros(num_embeddings, dim)
        init(full[:real], gen)
        with torch.no_grad():
            self.weight.copy_(shard_of(full, 0, 1, group_rank(group), t))
        mark_split(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Return the embeddings of ``ids`` (b, s); with sequence parallelism, of this rank's
        part of the sequence."""
        if group_size(self.group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.group)
        return reduce_from_tp(out, self.group)
