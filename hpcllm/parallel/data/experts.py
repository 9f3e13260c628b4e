"""What the data-parallel engines do for expert parallelism (``parallel.ep`` > 1).

The ep ranks of d hold different experts, so the engines' assumption that every rank of d
holds the same tensors holds for the dense parameters only. For the routed experts' tensors
(their role's ``experts`` > 1):

- the gradient is averaged over the expert-data-parallel group (the d/ep ranks holding the
  same experts) and divided by ep as well: each expert's gradient already sums the tokens of
  its ep group's ranks (the all-to-all's backward brought them), so the sum over the
  expert-dp group covers all d ranks' tokens, and dividing by d gives the one-process
  gradient of the global batch's mean loss, as the dense average does;
- a replica's start and a broadcast come from the first rank of the expert-dp group;
- the global gradient norm adds their squares over the ep group (each expert counted once;
  :func:`hpcllm.parallel.data.finalize.global_grad_norm`).

Megatron-Core does the same with its expert-data-parallel group; pytorch/pytorch#160285 shows
what a missing 1/ep does (gradients exactly ep times too large, losses that look right).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hpcllm import watchdog
from hpcllm.parallel.roles import role
from hpcllm.parallel.tensor.mappings import group_size

# What the watchdog names a rank waiting in the MoE layers' all-to-all.
ALL_TO_ALL = "MoE token all-to-all"

# (x, rows sent to each rank, rows received from each rank) -> the rows received, by source.
AllToAll = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]


def is_expert(param: torch.Tensor) -> bool:
    """Return whether ``param`` is a routed expert tensor split over ep > 1 ranks."""
    return role(param).experts > 1


def split_experts(
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Return (dense, experts): ``params`` held alike by every rank of d, and the others."""
    dense = [p for p in params if not is_expert(p)]
    return dense, [p for p in params if is_expert(p)]


def reduce_expert_grads(params: Sequence[torch.Tensor], group: Any, d: int) -> None:
    """Sum the expert tensors' gradients over ``group`` (expert-dp) and divide them by ``d``,
    in one flat all-reduce (a missing gradient, an expert that got no token, counts as 0)."""
    experts = [p for p in params if is_expert(p)]
    if not experts:
        return
    for p in experts:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in experts]
    flat = torch._utils._flatten_dense_tensors(grads)
    if group_size(group) > 1:
        dist.all_reduce(flat, group=group)
    flat.div_(d)
    for grad, reduced in zip(
        grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
    ):
        grad.copy_(reduced)


def torch_all_to_all(group: Any) -> AllToAll:
    """Return the all-to-all over ``group`` through torch.distributed (gloo or NCCL)."""

    def run(x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(recv), *x.shape[1:]))
        with watchdog.waiting(ALL_TO_ALL, axis="ep"):
            dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    return run


class TimedAllToAll:
    """An all-to-all (:data:`AllToAll`) that adds up the time it takes: on the host where the
    call waits for the exchange (gloo, Horovod), between CUDA events on the device's stream
    where it does not (NCCL), read once the device is done (:meth:`take`). The forward's
    dispatch and combine and the backward's reverse exchanges all count, the counts' too;
    validation's do not (:meth:`paused`). On a GPU every exchange is timed by events, under
    Horovod too (its exchanges also run on the device's streams); the events pile up until the
    next :meth:`take` (a logged step): a few per MoE block and micro-batch."""

    def __init__(self, inner: AllToAll, device: torch.device) -> None:
        self.inner = inner
        self.cuda = device.type == "cuda"
        self.host_s = 0.0
        self.events: list[tuple[Any, Any]] = []
        self.off = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the exchanges made inside out of the time (validation's)."""
        self.off = True
        try:
            yield
        finally:
            self.off = False

    def __call__(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        if self.off:
            return self.inner(x, send, recv)
        if self.cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            out = self.inner(x, send, recv)
            end.record()
            self.events.append((start, end))
            return out
        started = time.perf_counter()
        out = self.inner(x, send, recv)
        self.host_s += time.perf_counter() - started
        return out

    def take(self) -> float:
        """Return the seconds spent since the last call (the device synchronised first)."""
        seconds = self.host_s
        if self.events:
            self.events[-1][1].synchronize()
            seconds += sum(a.elapsed_time(b) for a, b in self.events) / 1e3
        self.host_s, self.events = 0.0, []
        return seconds


# -- checkpoints --------------------------------------------------------------------------
#
# Each rank of an ep group holds its own experts, and the first expert-dp replica of each
# writes them to a file of its own (hpcllm.train.checkpoint: the experts file, cut by tp, pp
# and ep); a reader joins them along dim 0 and takes the part a rank of any ep holds. A
# checkpoint read whole (convert, load_model, a re-cut of t or p) gives them whole, and each
# rank keeps its part.


def own_part(tensor: torch.Tensor, ep: int, ep_rank: int) -> torch.Tensor:
    """Return ep rank ``ep_rank``'s experts of a whole expert tensor (dim 0), as a copy."""
    if tensor.shape[0] % ep:
        raise ValueError(f"{tensor.shape[0]} experts do not split over ep {ep}")
    per = tensor.shape[0] // ep
    return tensor[ep_rank * per : (ep_rank + 1) * per].clone()


def held_part(tensor: torch.Tensor, held: int, ep_rank: int) -> torch.Tensor:
    """Return the ``held`` experts of ep rank ``ep_rank`` from ``tensor``: as it is when a
    reader cut it for this rank already, else cut from the whole (a re-cut of t or p, or a
    checkpoint that held the experts whole)."""
    if tensor.shape[0] == held:
        return tensor
    return own_part(tensor, tensor.shape[0] // held, ep_rank)


def expert_indices(params: Sequence[torch.Tensor]) -> set[int]:
    """Return the indices of the expert tensors among ``params`` (a plain optimizer state's
    parameters, in its order)."""
    return {i for i, p in enumerate(params) if is_expert(p)}
