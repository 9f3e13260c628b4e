"""The autograd collectives that move tensor-parallel activations (Megatron's mappings).

Each communication is an ``autograd.Function`` whose backward mirrors its forward: copying
into the tensor-parallel region all-reduces gradients on the way back, reducing out of it
passes gradients through, gathering splits and splitting gathers. With a tp group of one rank
every function is the identity.

Sequence parallelism (Korthikanti et al., 2022) splits the regions between tensor-parallel
layers (LayerNorm, dropout, residual adds) along the sequence instead of replicating them: an
all-gather along the sequence replaces the copy before a column-parallel layer, and a
reduce-scatter replaces the all-reduce after a row-parallel one. Activations are (b, s, h)
throughout, so the sequence is dimension 1.

Every collective here is reported to :func:`count_comm`, so tests and docs can check the
bytes against the analytic count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


def group_size(group: Any) -> int:
    """Return the number of ranks in ``group`` (1 for None)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Any) -> int:
    """Return this rank's index in ``group`` (0 for None)."""
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


def record(op: str, nbytes: int, backward: bool) -> None:
    for log in _LOGS:
        log.calls.append((op, "backward" if backward else "forward", nbytes))


def all_reduce(x: torch.Tensor, group: Any, backward: bool) -> torch.Tensor:
    x = x.contiguous()
    record("all_reduce", x.numel() * x.element_size(), backward)
    dist.all_reduce(x, group=group)
    return x


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce(grad, ctx.group, backward=True), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return all_reduce(x, group, backward=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def split(x: torch.Tensor, group: Any, dim: int = -1) -> torch.Tensor:
    return x.chunk(group_size(group), dim=dim)[group_rank(group)].contiguous()


def gather(x: torch.Tensor, group: Any, backward: bool, dim: int = -1) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    record("all_gather", x.numel() * x.element_size() * len(parts), backward)
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter(x: torch.Tensor, group: Any, backward: bool, dim: int) -> torch.Tensor:
    size = group_size(group)
    if x.shape[dim] % size:
        raise ValueError(
            f"dimension {dim} of size {x.shape[dim]} does not split over the "
            f"{size} tensor-parallel ranks"
        )
    record("reduce_scatter", x.numel() * x.element_size(), backward)
    parts = [c.contiguous() for c in x.chunk(size, dim=dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


def _split_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    return split(x, group, dim=-1)


def _gather_last(x: torch.Tensor, group: Any, backward: bool = False) -> torch.Tensor:
    return gather(x, group, backward, dim=-1)


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
        return split(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return gather(grad, ctx.group, True, SEQ_DIM), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return gather(x, group, False, SEQ_DIM)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # The gathered tensor feeds a tensor-parallel layer, so each rank's gradient is a
        # partial sum: reduce, and keep this rank's part of the sequence.
        return reduce_scatter(grad, ctx.group, True, SEQ_DIM), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return reduce_scatter(x, group, False, SEQ_DIM)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return gather(grad, ctx.group, True, SEQ_DIM), None


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Return x unchanged; its gradient is all-reduced over the tp group."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Return the sum of x over the tp group; its gradient passes through."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Return the tp ranks' x concatenated along the last dimension; backward splits."""
    return x if group_size(group) == 1 else _GatherFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Return this rank's slice of x's last dimension; backward gathers."""
    return x if group_size(group) == 1 else _ScatterToTP.apply(x, group)


def scatter_to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Return this rank's part of x's sequence (dimension 1); backward all-gathers."""
    return x if group_size(group) == 1 else _ScatterToSequence.apply(x, group)


def gather_from_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Return the whole sequence gathered from the tp ranks; backward reduce-scatters."""
    return x if group_size(group) == 1 else _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Return this rank's sequence part of the sum of x over the tp group; backward gathers."""
    return x if group_size(group) == 1 else _ReduceScatterToSequence.apply(x, group)
