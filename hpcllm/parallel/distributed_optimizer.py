"""The distributed optimizer (ZeRO stage 1): Adam's state sharded over the data-parallel group.

``parallel.distributed_optimizer: true`` with ``dp_engine: ddp`` or ``horovod``. Each rank's
trainable parameters are laid out in flat gradient buckets (one set per optimizer param group
and model chunk, in backward order, of about ``ddp_bucket_mb`` / ``horovod_fusion_mb``), and
each bucket is cut into d equal parts, part r belonging to dp rank r, as Megatron-LM's
distributed optimizer cuts its buckets. Then, each step:

1. the parameters' gradients are views into their bucket, so the backward accumulates
   straight into it (micro-batches add up there); during a chunk's last backward of the step
   a bucket whose gradients are all complete is reduce-scattered at once (the averaged part r
   lands on rank r), overlapping the rest of the backward. Gradients that another group must
   complete first (sequence-parallel LayerNorms summed over tp, the tied embedding summed
   over the first and last stage) wait in buckets of their own until that is done;
2. each rank holds fp32 master copies and Adam moments of its parts only (1/d of the
   optimizer state), takes the global gradient norm from its parts (summed over tp, dp and pp,
   each weight counted once), clips, and steps them; fp16's overflow check spans every rank;
3. the updated parts are all-gathered back into the buckets' memory and copied into the
   parameters (the gradient buffer is free again then: it is zeroed for the next step).

Reduce-scatter + all-gather move the bytes of one all-reduce. torch collectives for ``ddp``
(``reduce_scatter_single``/``all_gather_single`` on the dp group), Horovod's
``reducescatter``/``allgather`` on the dp communicator for ``horovod``.

The optimizer state converts to and from the plain AdamW ``state_dict`` of the same
parameters (:func:`merge_shards`, :meth:`DistributedAdamW.load_state_dict`), so checkpoints
of either kind resume at any d and every checkpoint reader keeps working.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

FORMAT = "hpcllm-distributed-optimizer-1"


@dataclass
class Bucket:
    """One flat gradient buffer: ``params`` at ``offsets``, ``size`` elements (a multiple of d).

    ``master`` is where this rank's part lies in its group's flat master tensor.
    """

    group: int
    chunk: int
    late: bool
    params: list[nn.Parameter]
    indices: list[int]  # each parameter's index in the plain optimizer's state
    offsets: list[int]
    size: int
    master: slice
    grad: torch.Tensor = field(repr=False)
    pending: int = 0
    work: Any = None
    launched: bool = False

    def part(self, dp: int, rank: int) -> slice:
        """Return dp rank ``rank``'s part of the bucket."""
        n = self.size // dp
        return slice(rank * n, (rank + 1) * n)


def plan_buckets(
    groups: Sequence[Sequence[nn.Parameter]],
    chunk_of: dict[int, int],
    late: set[int],
    dp: int,
    bucket_numel: int,
) -> list[tuple[int, int, bool, list[int]]]:
    """Return the buckets as (group, chunk, late, indices into the flat parameter list).

    Per group and chunk, parameters in reverse order (the order their gradients are ready in)
    fill buckets of up to ``bucket_numel`` elements; a parameter larger than that has a
    bucket of its own. Late parameters get buckets of their own. Every rank of the dp group
    plans the same buckets: they depend on the parameters' order and sizes only.
    """
    flat = [p for g in groups for p in g]
    index = {id(p): i for i, p in enumerate(flat)}
    plan = []
    for g, params in enumerate(groups):
        chunks = sorted({chunk_of[id(p)] for p in params})
        for chunk in chunks:
            for is_late in (False, True):
                mine = [
                    p
                    for p in reversed(params)
                    if chunk_of[id(p)] == chunk and (id(p) in late) == is_late
                ]
                current: list[int] = []
                filled = 0
                for p in mine:
                    if current and filled + p.numel() > bucket_numel:
                        plan.append((g, chunk, is_late, current))
                        current, filled = [], 0
                    current.append(index[id(p)])
                    filled += p.numel()
                if current:
                    plan.append((g, chunk, is_late, current))
    return plan


class Collectives:
    """Reduce-scatter and all-gather over the dp group, asynchronous."""

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, dp: int) -> Any:
        """Start averaging ``flat`` over the group into this rank's part ``out``."""
        raise NotImplementedError

    def all_gather(self, flat: torch.Tensor, part: torch.Tensor) -> Any:
        """Start gathering every rank's ``part`` into ``flat``."""
        raise NotImplementedError

    def wait(self, work: Any) -> None:
        """Finish what ``reduce_scatter`` or ``all_gather`` started."""
        raise NotImplementedError


class TorchCollectives(Collectives):
    """torch.distributed on the dp group (gloo on CPU, NCCL on GPUs)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, dp: int) -> Any:
        # A sum, divided once it has arrived: gloo has no average.
        work = dist.reduce_scatter_single(out, flat, group=self.group, async_op=True)
        return (work, lambda: out.div_(dp))

    def all_gather(self, flat: torch.Tensor, part: torch.Tensor) -> Any:
        return (dist.all_gather_single(flat, part, group=self.group, async_op=True), None)

    def wait(self, work: Any) -> None:
        handle, then = work
        handle.wait()
        if then is not None:
            then()


class HorovodCollectives(Collectives):
    """Horovod's reducescatter and allgather on the dp communicator it was started on."""

    def __init__(self, hvd: Any) -> None:
        self.hvd = hvd
        self.count = 0

    def _name(self, kind: str) -> str:
        # Horovod matches the ranks' requests by name; every rank starts them in one order.
        self.count += 1
        return f"hpcllm.zero.{kind}.{self.count}"

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, dp: int) -> Any:
        handle = self.hvd.reducescatter_async(flat, name=self._name("rs"), op=self.hvd.Average)
        return (handle, lambda result: out.copy_(result))

    def all_gather(self, flat: torch.Tensor, part: torch.Tensor) -> Any:
        handle = self.hvd.allgather_async(part, name=self._name("ag"))
        return (handle, lambda result: flat.copy_(result))

    def wait(self, work: Any) -> None:
        handle, then = work
        then(self.hvd.synchronize(handle))


class DistributedAdamW(torch.optim.AdamW):
    """AdamW over this rank's parts of the buckets (flat fp32 masters, one per param group).

    Its param groups are the plain optimizer's (same order, same settings), so the trainer's
    LR schedule and the checkpoints' hyperparameters are unchanged. ``state_dict`` is this
    rank's shard with the bucket layout; ``load_state_dict`` takes that (same d, same layout)
    or a plain AdamW state of the same parameters, and keeps this rank's part.
    """

    def __init__(self, zero: ZeroState, plain: torch.optim.Optimizer) -> None:
        self.zero = zero
        groups = []
        for g, group in enumerate(plain.param_groups):
            settings = {k: v for k, v in group.items() if k != "params"}
            groups.append({**settings, "params": [zero.masters[g]]})
        super().__init__(groups)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the gradients live in the engine's buckets, which it zeroes after the
        parameters are gathered (the masters' gradients are views it fills)."""

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return self.zero.shard_state(super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        super().load_state_dict(self.zero.own_state(state_dict))


class ZeroState:
    """This rank's buckets, master parts and the collectives between them (one per rank)."""

    def __init__(
        self,
        groups: Sequence[Sequence[nn.Parameter]],
        chunk_of: dict[int, int],
        late: set[int],
        dp: int,
        dp_rank: int,
        bucket_numel: int,
        collectives: Collectives,
        dp_group: Any,
        tp_split: Callable[[nn.Parameter], bool],
    ) -> None:
        self.dp, self.dp_rank, self.collectives = dp, dp_rank, collectives
        self.dp_group = dp_group
        self.flat_params = [p for g in groups for p in g]
        self.group_sizes = [len(g) for g in groups]
        device = self.flat_params[0].device
        self.buckets: list[Bucket] = []
        master_sizes = [0] * len(groups)
        for g, chunk, is_late, indices in plan_buckets(groups, chunk_of, late, dp, bucket_numel):
            params = [self.flat_params[i] for i in indices]
            offsets, total = [], 0
            for p in params:
                offsets.append(total)
                total += p.numel()
            size = -(-total // dp) * dp
            part = size // dp
            grad = torch.zeros(size, dtype=params[0].dtype, device=device)
            for p, off in zip(params, offsets, strict=True):
                p.grad = grad[off : off + p.numel()].view_as(p)
            self.buckets.append(
                Bucket(
                    group=g,
                    chunk=chunk,
                    late=is_late,
                    params=params,
                    indices=indices,
                    offsets=offsets,
                    size=size,
                    master=slice(master_sizes[g], master_sizes[g] + part),
                    grad=grad,
                )
            )
            master_sizes[g] += part
        self.masters = [
            torch.zeros(n, dtype=torch.float32, device=device, requires_grad=False)
            for n in master_sizes
        ]
        for master in self.masters:
            master.grad = torch.zeros_like(master)
        self.copy_params_to_masters()
        # What the gradient norm counts of each master element: split over tp (summed over
        # the tp group), whole (the same on every tp rank: counted once) or not at all (the
        # last stage's copy of the tied embedding, which the first stage counts).
        self.segments: list[list[tuple[slice, str]]] = [[] for _ in groups]
        for bucket in self.buckets:
            mine = bucket.part(dp, dp_rank)
            for p, off in zip(bucket.params, bucket.offsets, strict=True):
                lo, hi = max(off, mine.start), min(off + p.numel(), mine.stop)
                if lo >= hi:
                    continue
                kind = (
                    "none"
                    if getattr(p, "pipeline_duplicate", False)
                    else "split"
                    if tp_split(p)
                    else "whole"
                )
                start = bucket.master.start + lo - mine.start
                self.segments[bucket.group].append((slice(start, start + hi - lo), kind))
        self._armed: int | None = None
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.flat_params
        ]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}

    # -- the backward ------------------------------------------------------------------

    def arm(self, chunk: int) -> None:
        """Count the gradients of ``chunk``'s last backward of the step, bucket by bucket."""
        self._armed = chunk
        for bucket in self.buckets:
            if bucket.chunk == chunk and not bucket.late:
                bucket.pending = len(bucket.params)

    def disarm(self, chunk: int) -> None:
        """After ``chunk``'s last backward: start the buckets some parameter never reached."""
        self._armed = None
        for bucket in self.buckets:
            if bucket.chunk == chunk and not bucket.late and not bucket.launched:
                self._launch(bucket)

    def _grad_ready(self, param: torch.Tensor) -> None:
        if self._armed is None:
            return
        bucket = self._bucket_of[id(param)]
        if bucket.chunk != self._armed or bucket.late or bucket.launched:
            return
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched = True
        grad = self.masters[bucket.group].grad
        mine = bucket.part(self.dp, self.dp_rank)
        if self.dp == 1:
            grad[bucket.master].copy_(bucket.grad[mine])
            return
        out = grad[bucket.master]
        if bucket.grad.dtype != torch.float32:
            out = torch.empty(mine.stop - mine.start, dtype=bucket.grad.dtype, device=grad.device)
        bucket.work = (self.collectives.reduce_scatter(out, bucket.grad, self.dp), out)

    def finish(self) -> float:
        """Start the late buckets and any not started, wait for every reduce-scatter; return
        the seconds spent."""
        started = time.perf_counter()
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                work, out = bucket.work
                self.collectives.wait(work)
                target = self.masters[bucket.group].grad[bucket.master]
                if out.data_ptr() != target.data_ptr():
                    target.copy_(out)
                bucket.work = None
        return time.perf_counter() - started

    # -- the step ----------------------------------------------------------------------

    def grad_norm(self, tp_group: Any, pp_group: Any) -> torch.Tensor:
        """Return the global gradient norm from this rank's parts: over tp, dp and pp."""
        device = self.masters[0].device
        sums = {"split": torch.zeros((), device=device), "whole": torch.zeros((), device=device)}
        for g, master in enumerate(self.masters):
            for kind in ("split", "whole"):
                views = [master.grad[s] for s, k in self.segments[g] if k == kind]
                if views:
                    norms = torch._foreach_norm(views, 2)
                    sums[kind] = sums[kind] + torch.stack(norms).square().sum()
        split = sums["split"]
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            dist.all_reduce(split, group=tp_group)
        total = split + sums["whole"]
        if self.dp > 1:
            dist.all_reduce(total, group=self.dp_group)
        if pp_group is not None and dist.get_world_size(pp_group) > 1:
            dist.all_reduce(total, group=pp_group)
        return total.sqrt()

    def gather_params(self) -> float:
        """All-gather the updated parts into the buckets, copy them into the parameters, and
        zero the buckets for the next step's gradients; return the seconds spent."""
        started = time.perf_counter()
        works = []
        for bucket in self.buckets:
            master = self.masters[bucket.group][bucket.master].to(bucket.grad.dtype)
            if self.dp == 1:
                bucket.grad.copy_(master)
                continue
            works.append(self.collectives.all_gather(bucket.grad, master))
        for work in works:
            self.collectives.wait(work)
        with torch.no_grad():
            for bucket in self.buckets:
                for p, off in zip(bucket.params, bucket.offsets, strict=True):
                    p.copy_(bucket.grad[off : off + p.numel()].view_as(p))
                bucket.grad.zero_()
                bucket.launched = False
        for master in self.masters:
            master.grad.zero_()
        return time.perf_counter() - started

    def copy_params_to_masters(self) -> None:
        """Set the masters from the parameters (at start, and after a checkpoint's weights)."""
        with torch.no_grad():
            for bucket in self.buckets:
                mine = bucket.part(self.dp, self.dp_rank)
                master = self.masters[bucket.group][bucket.master]
                for p, off in zip(bucket.params, bucket.offsets, strict=True):
                    lo, hi = max(off, mine.start), min(off + p.numel(), mine.stop)
                    if lo < hi:
                        src = p.detach().reshape(-1)[lo - off : hi - off]
                        master[lo - mine.start : hi - mine.start].copy_(src)

    # -- state -------------------------------------------------------------------------

    def layout(self) -> dict[str, Any]:
        """Return the bucket layout (the same on every dp rank), as checkpoints record it."""
        return {
            "dp": self.dp,
            "group_sizes": self.group_sizes,
            "shapes": [list(p.shape) for p in self.flat_params],
            "buckets": [
                {
                    "group": b.group,
                    "indices": b.indices,
                    "offsets": b.offsets,
                    "size": b.size,
                    "master": [b.master.start, b.master.stop],
                }
                for b in self.buckets
            ],
        }

    def shard_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Return ``state`` (the masters' optimizer state) as this rank's checkpoint shard."""
        return {"format": FORMAT, "dp_rank": self.dp_rank, "layout": self.layout(), **state}

    def own_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Return the masters' optimizer state for this rank from a plain or a shard state."""
        if state.get("format") == FORMAT:
            if state["layout"] != self.layout() or state["dp_rank"] != self.dp_rank:
                state = merge_shards([state])  # only a whole set (d = 1) merges alone
            else:
                return {"state": state["state"], "param_groups": state["param_groups"]}
        return self._cut_plain(state)

    def _cut_plain(self, plain: dict[str, Any]) -> dict[str, Any]:
        per_param = plain["state"]
        groups = plain["param_groups"]
        if [len(g["params"]) for g in groups] != self.group_sizes:
            raise ValueError("the optimizer state holds other parameter groups than this model's")
        state: dict[int, dict[str, Any]] = {}
        for g, master in enumerate(self.masters):
            if not per_param:
                break
            moments = {}
            for name in ("exp_avg", "exp_avg_sq"):
                flat = torch.zeros_like(master)
                for bucket in self.buckets:
                    if bucket.group != g:
                        continue
                    mine = bucket.part(self.dp, self.dp_rank)
                    for i, off in zip(bucket.indices, bucket.offsets, strict=True):
                        n = self.flat_params[i].numel()
                        lo, hi = max(off, mine.start), min(off + n, mine.stop)
                        if lo < hi:
                            src = per_param[i][name].reshape(-1)[lo - off : hi - off]
                            start = bucket.master.start + lo - mine.start
                            flat[start : start + hi - lo].copy_(src)
                moments[name] = flat
            first = next(i for b in self.buckets if b.group == g for i in b.indices)
            step = per_param[first]["step"]
            state[g] = {"step": step.clone() if torch.is_tensor(step) else step, **moments}
        param_groups = [{**group, "params": [g]} for g, group in enumerate(groups)]
        return {"state": state, "param_groups": param_groups}

    def remove(self) -> None:
        """Remove the gradient hooks (the engine is done)."""
        for hook in self._hooks:
            hook.remove()


def is_shard_state(state: Any) -> bool:
    """Return whether ``state`` is one dp rank's distributed-optimizer shard."""
    return isinstance(state, dict) and state.get("format") == FORMAT


def merge_shards(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Return the plain AdamW ``state_dict`` of the parameters from every dp rank's shard.

    ``shards`` in dp-rank order, all of one layout. Each parameter's moments are cut out of
    the buckets whole again (padding dropped); the step and the param groups' settings are
    the same on every rank.
    """
    shards = sorted(shards, key=lambda s: s["dp_rank"])
    layout = shards[0]["layout"]
    dp = layout["dp"]
    if [s["dp_rank"] for s in shards] != list(range(dp)):
        raise ValueError(f"the distributed optimizer's shards are incomplete (d = {dp})")
    shapes = layout["shapes"]
    state: dict[int, dict[str, Any]] = {}
    first_groups = shards[0]["param_groups"]
    if shards[0]["state"]:
        for bucket in layout["buckets"]:
            g = bucket["group"]
            lo, hi = bucket["master"]
            for name in ("exp_avg", "exp_avg_sq"):
                flat = torch.cat([s["state"][g][name][lo:hi] for s in shards])
                for i, off in zip(bucket["indices"], bucket["offsets"], strict=True):
                    n = 1
                    for d in shapes[i]:
                        n *= d
                    entry = state.setdefault(i, {"step": shards[0]["state"][g]["step"].clone()})
                    entry[name] = flat[off : off + n].reshape(shapes[i]).clone()
    param_groups = []
    start = 0
    for g, size in enumerate(layout["group_sizes"]):
        settings = {k: v for k, v in first_groups[g].items() if k != "params"}
        param_groups.append({**settings, "params": list(range(start, start + size))})
        start += size
    return {"state": dict(sorted(state.items())), "param_groups": param_groups}
