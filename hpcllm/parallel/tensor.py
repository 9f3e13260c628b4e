"""Megatron's tensor-parallel layers and the autograd functions that move data between ranks.

Each communication is an ``autograd.Function`` whose backward mirrors its forward: copying
into the tensor-parallel region all-reduces gradients on the way back, reducing out of it
passes gradients through, gathering splits and splitting gathers. With a tp group of one rank
every function is the identity and each layer an ordinary Linear or Embedding.

Sequence parallelism (Korthikanti et al., 2022) splits the regions between tensor-parallel
layers (LayerNorm, dropout, residual adds) along the sequence instead of replicating them: an
all-gather along the sequence replaces the copy before a column-parallel layer, and a
reduce-scatter replaces the all-reduce after a row-parallel one. Activations are (b, s, h)
throughout, so the sequence is dimension 1.

Every collective here is reported to :func:`count_comm`, so tests and docs can check the
bytes against the analytic count.

Weights are initialised whole, from the same generator on every rank, and each rank keeps its
slice, so a model built with t > 1 holds exactly the shards of the t = 1 model from the same
seed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

InitFn = Callable[[torch.Tensor, torch.Generator], None]


def _size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group: Any) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass
class CommLog:
    """Tensor-parallel collectives seen inside :func:`count_comm`, in call order.

    Each entry is ``(op, direction, nbytes)``: op is ``all_reduce``, ``all_gather`` or
    ``reduce_scatter``; direction ``forward`` or ``backward``; nbytes the size of the whole
    tensor (an all-reduce's tensor, an all-gather's output, a reduce-scatter's input).
    """

    calls: list[tuple[str, str, int]] = field(default_factory=list)

    def total(self, op: str | None = None, direction: str | None = None) -> int:
        """Return the bytes of the calls matching ``op`` and ``direction`` (None: any)."""
        return sum(
            n
            for o, d, n in self.calls
            if (op is None or o == op) and (direction is None or d == direction)
        )

    def count(self, op: str | None = None, direction: str | None = None) -> int:
        """Return how many calls match ``op`` and ``direction``."""
        return sum(
            1
            for o, d, _ in self.calls
            if (op is None or o == op) and (direction is None or d == direction)
        )


_LOGS: list[CommLog] = []


@contextlib.contextmanager
def count_comm() -> Iterator[CommLog]:
    """Record every tensor-parallel collective run (forward and backward) inside the block."""
    log = CommLog()
    _LOGS.append(log)
    try:
        yield log
    finally:
        _LOGS.remove(log)


def _record(op: str, nbytes: int, backward: bool) -> None:
    for log in _LOGS:
        log.calls.append((op, "backward" if backward else "forward", nbytes))


def _all_reduce(x: torch.Tensor, group: Any, backward: bool) -> torch.Tensor:
    x = x.contiguous()
    _record("all_reduce", x.numel() * x.element_size(), backward)
    dist.all_reduce(x, group=group)
    return x


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group, backward=True), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x, group, backward=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _split(x: torch.Tensor, group: Any, dim: int = -1) -> torch.Tensor:
    return x.chunk(_size(group), dim=dim)[_rank(group)].contiguous()


def _gather(x: torch.Tensor, group: Any, backward: bool, dim: int = -1) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    _record("all_gather", x.numel() * x.element_size() * len(parts), backward)
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, group: Any, backward: bool, dim: int) -> torch.Tensor:
    size = _size(group)
    if x.shape[dim] % size:
        raise ValueError(
            f"dimension {dim} of size {x.shape[dim]} does not split over the "
            f"{size} tensor-parallel ranks"
        )
    _record("reduce_scatter", x.numel() * x.element_size(), backward)
    parts = [c.contiguous() for c in x.chunk(size, dim=dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


def _split_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _split(x, group, dim=-1)


def _gather_last(x: torch.Tensor, group: Any, backward: bool = False) -> torch.Tensor:
    return _gather(x, group, backward, dim=-1)


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last(grad, ctx.group), None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last(grad, ctx.group, backward=True), None


# Sequence parallelism: the sequence is dimension 1 of (b, s, h) activations.
SEQ_DIM = 1


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _split(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather(grad, ctx.group, True, SEQ_DIM), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _gather(x, group, False, SEQ_DIM)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # The gathered tensor feeds a tensor-parallel layer, so each rank's gradient is a
        # partial sum: reduce, and keep this rank's part of the sequence.
        return _reduce_scatter(grad, ctx.group, True, SEQ_DIM), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(x, group, False, SEQ_DIM)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather(grad, ctx.group, True, SEQ_DIM), None


class _WeightGradients:
    """Where zero-bubble pipelines park linear layers' weight gradients between B and W."""

    def __init__(self) -> None:
        self.deferrable = False  # forwards record what a deferred weight gradient needs
        self.queue: list[tuple[Any, ...]] | None = None  # backwards defer into it when set


_WGRAD = _WeightGradients()


@contextlib.contextmanager
def deferrable_weight_grads(enabled: bool = True) -> Iterator[None]:
    """Run linear layers inside as autograd functions whose weight gradient can be deferred."""
    previous, _WGRAD.deferrable = _WGRAD.deferrable, enabled
    try:
        yield
    finally:
        _WGRAD.deferrable = previous


@contextlib.contextmanager
def defer_weight_grads() -> Iterator[list[tuple[Any, ...]]]:
    """Backward passes inside compute linear layers' input gradients only (zero-bubble B).

    The weight gradients' inputs collect in the yielded list; :func:`weight_grads` computes
    them later (W). Only layers run under :func:`deferrable_weight_grads` defer.
    """
    queue: list[tuple[Any, ...]] = []
    previous, _WGRAD.queue = _WGRAD.queue, queue
    try:
        yield queue
    finally:
        _WGRAD.queue = previous


def weight_grads(deferred: list[tuple[Any, ...]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Return (parameter, gradient) pairs for weight gradients parked by a deferred backward."""
    out = []
    for weight, bias, x, grad in deferred:
        flat_grad = grad.reshape(-1, grad.shape[-1])
        flat_x = x.reshape(-1, x.shape[-1]).to(grad.dtype)
        out.append((weight, flat_grad.t().matmul(flat_x).to(weight.dtype)))
        if bias is not None:
            out.append((bias, flat_grad.sum(dim=0).to(bias.dtype)))
    return out


def _weight_grad_or_defer(
    weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if _WGRAD.queue is not None:
        _WGRAD.queue.append((weight, bias, x, grad))
        return None, None
    grads = [g for _, g in weight_grads([(weight, bias, x, grad)])]
    return grads[0], grads[1] if bias is not None else None


class _Linear(torch.autograd.Function):
    """F.linear whose weight gradient a zero-bubble backward can defer to its W."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        # The parameters themselves, for W: under activation recomputation the saved weight
        # comes back as a recomputed alias, not the parameter its gradient belongs to.
        ctx.weight, ctx.bias = weight, bias
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_input = grad.matmul(weight.to(grad.dtype)).to(x.dtype)
        grad_weight, grad_bias = _weight_grad_or_defer(ctx.weight, ctx.bias, x, grad)
        return grad_input, grad_weight, grad_bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or under :func:`deferrable_weight_grads` one whose weight grad can wait."""
    if _WGRAD.deferrable and torch.is_grad_enabled():
        return _Linear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


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
        return F.linear(_gather(x, group, False, SEQ_DIM), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        full = _gather(x, ctx.group, True, SEQ_DIM).to(grad.dtype)
        grad_input = grad.matmul(weight.to(grad.dtype))
        grad_input = _reduce_scatter(grad_input, ctx.group, True, SEQ_DIM)
        grad_weight, grad_bias = _weight_grad_or_defer(ctx.weight, ctx.bias, full, grad)
        return grad_input.to(x.dtype), grad_weight, grad_bias, None


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Return x unchanged; its gradient is all-reduced over the tp group."""
    return x if _size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Return the sum of x over the tp group; its gradient passes through."""
    return x if _size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Return the tp ranks' x concatenated along the last dimension; backward splits."""
    return x if _size(group) == 1 else _GatherFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Return this rank's slice of x's last dimension; backward gathers."""
    return x if _size(group) == 1 else _ScatterToTP.apply(x, group)


def scatter_to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Return this rank's part of x's sequence (dimension 1); backward all-gathers."""
    return x if _size(group) == 1 else _ScatterToSequence.apply(x, group)


def gather_from_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Return the whole sequence gathered from the tp ranks; backward reduce-scatters."""
    return x if _size(group) == 1 else _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Return this rank's sequence part of the sum of x over the tp group; backward gathers."""
    return x if _size(group) == 1 else _ReduceScatterToSequence.apply(x, group)


def sequence_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Any
) -> torch.Tensor:
    """Return ``linear(all_gather_sequence(x), weight, bias)``, storing only x's part."""
    if _size(group) == 1:
        return linear(x, weight, bias)
    return _SequenceParallelLinear.apply(x, weight, bias, group)


def normal_init(std: float) -> InitFn:
    """Return an initialiser that draws N(0, std²) from the given generator."""

    def init(weight: torch.Tensor, gen: torch.Generator) -> None:
        with torch.no_grad():
            weight.normal_(0.0, std, generator=gen)

    return init


def mark_split(*params: nn.Parameter | None, dim: int = 0, stride: int = 1) -> None:
    """Mark parameters that hold a tp rank's slice along ``dim`` (see :func:`shard_of`).

    Unmarked parameters are whole on every tp rank.
    """
    for param in params:
        if param is not None:
            param.tensor_parallel = True
            param.partition = (dim, stride)


def is_split(param: torch.Tensor) -> bool:
    """Return whether ``param`` is a tp rank's slice of a larger tensor."""
    return getattr(param, "tensor_parallel", False)


def mark_sequence_parallel(*params: nn.Parameter | None) -> None:
    """Mark whole parameters that see only a sequence part (their grads are partial)."""
    for param in params:
        if param is not None:
            param.sequence_parallel = True


def reduce_sequence_parallel_grads(model: nn.Module, group: Any) -> None:
    """Sum over the tp group the gradients of whole parameters used in sequence-parallel regions.

    LayerNorms, row-parallel biases and positions are whole on every tp rank, but under
    sequence parallelism each rank sees only its part of the sequence, so each holds a partial
    gradient. One all-reduce of the flattened gradients completes them (Megatron does the same).
    """
    if _size(group) == 1:
        return
    grads = [
        p.grad
        for p in model.parameters()
        if getattr(p, "sequence_parallel", False) and p.grad is not None
    ]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for grad, reduced in zip(
        grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
    ):
        grad.copy_(reduced)


def clip_grad_norm(
    parameters: list[torch.Tensor], max_norm: float, tp_group: Any = None, pp_group: Any = None
) -> torch.Tensor:
    """Clip gradients by the model's global norm across tp and pp; return that norm.

    Sliced parameters contribute their squares from every tp rank (an all-reduce); whole
    ones (LayerNorm, row-parallel biases, positions) hold the same gradient on every tp rank
    and are counted once. Each pipeline stage holds different parameters, so the stages' sums
    are added; a parameter marked ``pipeline_duplicate`` (the last stage's copy of the tied
    embedding) is not counted, since the first stage counts it.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads and _size(tp_group) == 1 and _size(pp_group) == 1:
        return torch.zeros(())
    device = grads[0].device if grads else parameters[0].device
    split = torch.zeros((), device=device)
    whole = torch.zeros((), device=device)
    for param in parameters:
        if param.grad is not None and not getattr(param, "pipeline_duplicate", False):
            square = param.grad.detach().float().pow(2).sum()
            if is_split(param):
                split += square
            else:
                whole += square
    if _size(tp_group) > 1:
        dist.all_reduce(split, group=tp_group)
    total = split + whole
    if _size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    norm = total.sqrt()
    if max_norm > 0 and grads:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coef)
    return norm


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
        shard.copy_(shard_of(full, dim, stride, _rank(group), _size(group)))


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
        t = _size(group)
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
        t = _size(group)
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
        t = _size(group)
        if num_embeddings % t:
            raise ValueError(f"vocabulary {num_embeddings} not divisible by tp {t}")
        self.group = group
        self.sequence_parallel = sequence_parallel and t > 1
        per_rank = num_embeddings // t
        self.vocab_start = _rank(group) * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, dim))
        # Only the real rows are drawn (padding rows are zero), so the generator's stream, and
        # with it every later weight, is the same whatever padding t asks for.
        real = real_rows or num_embeddings
        full = torch.zeros(num_embeddings, dim)
        init(full[:real], gen)
        with torch.no_grad():
            self.weight.copy_(shard_of(full, 0, 1, _rank(group), t))
        mark_split(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Return the embeddings of ``ids`` (b, s); with sequence parallelism, of this rank's
        part of the sequence."""
        if _size(self.group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.group)
        return reduce_from_tp(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits whose vocabulary is split across the tp group.

    Two all-reduces of (b, s) values replace a gather of the (b, s, V) logits: the maximum,
    then each rank's sum of exponentials (rescaled to that maximum) stacked with the target's
    logit from whichever rank holds it. The per-slice pass and the gradient are
    :mod:`hpcllm.kernels` ops (one fused Triton kernel each on CUDA), and backward recomputes
    the softmax from the saved log-sum-exp rather than keeping it in fp32.
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        group: Any,
        vocab_start: int,
        vocab_size: int,
    ) -> torch.Tensor:
        from hpcllm import kernels

        rows, flat = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        top, sumexp, target = kernels.vocab_ce_partials(rows, flat, vocab_start, vocab_size)
        global_top = top.clone()
        _record("all_reduce", global_top.numel() * global_top.element_size(), False)
        dist.all_reduce(global_top, op=dist.ReduceOp.MAX, group=group)
        # A slice that holds only padding has max -inf and sum 0: it adds nothing.
        scaled = torch.where(
            sumexp > 0, sumexp * torch.exp(top - global_top), torch.zeros_like(sumexp)
        )
        sums = _all_reduce(torch.stack([scaled, target]), group, backward=False)
        lse = global_top + sums[0].log()
        ctx.save_for_backward(rows, flat, lse)
        ctx.shape, ctx.vocab_start, ctx.vocab_size = logits.shape, vocab_start, vocab_size
        return (lse - sums[1]).mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        from hpcllm import kernels

        rows, flat, lse = ctx.saved_tensors
        d_logits = kernels.vocab_ce_backward(
            rows, flat, lse, grad / flat.numel(), ctx.vocab_start, ctx.vocab_size
        )
        return d_logits.view(ctx.shape), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, group: Any, vocab_start: int, vocab_size: int
) -> torch.Tensor:
    """Return the mean token cross-entropy of vocabulary-split logits, never gathering them.

    ``logits`` is this rank's (..., V_padded / t) slice starting at ``vocab_start``; columns at
    or past ``vocab_size`` (the real vocabulary) are padding and excluded, so the loss equals
    the unpadded single-GPU loss.
    """
    return _VocabParallelCrossEntropy.apply(logits, labels, group, vocab_start, vocab_size)
