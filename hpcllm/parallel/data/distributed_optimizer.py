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

At ep > 1 the routed experts' tensors (which differ by ep rank) get buckets of their own, cut
over the expert-data-parallel group instead (:class:`ExpertCut`), and a checkpoint holds the
plain state (:meth:`ZeroState.plain_state`).

Reduce-scatter + all-gather move the bytes of one all-reduce. torch collectives for ``ddp``
(``reduce_scatter_single``/``all_gather_single`` on the dp group), Horovod's
``reducescatter``/``allgather`` on the dp communicator for ``horovod``.

The optimizer state converts to and from the plain AdamW ``state_dict`` of the same
parameters (:mod:`~hpcllm.parallel.data.optimizer_parts`,
:meth:`DistributedAdamW.load_state_dict`), so checkpoints of either kind resume at any d and
every checkpoint reader keeps working.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpcllm.config import ParallelConfig
from hpcllm.errors import UserError
from hpcllm.parallel.data.engine import Engine
from hpcllm.parallel.data.experts import AllToAll, is_expert
from hpcllm.parallel.data.finalize import finalize_model_grads
from hpcllm.parallel.data.horovod import (
    describe_horovod,
    describe_mpi,
    expert_process_sets_of,
    horovod_all_to_all,
    horovod_transport,
    start_horovod,
)
from hpcllm.parallel.data.optimizer import MixedPrecisionOptimizer
from hpcllm.parallel.data.optimizer_parts import FORMAT, merge_shards
from hpcllm.parallel.roles import role
from hpcllm.topology import Grid


@dataclass
class Bucket:
    """One flat buffer of ``params`` (their data and their gradients are views into it), at
    ``offsets``, ``size`` elements (a multiple of d, zero-padded). ``slot`` is the index of
    this rank's part among the optimizer's parameters."""

    group: int
    chunk: int
    late: bool
    params: list[nn.Parameter]
    indices: list[int]  # each parameter's index in the plain optimizer's state
    offsets: list[int]
    size: int
    slot: int
    data: torch.Tensor = field(repr=False)
    grad: torch.Tensor = field(repr=False)
    pending: int = 0
    work: Any = None
    launched: bool = False
    # The ranks the bucket is cut over and this rank's place among them: d and the dp rank,
    # or, for expert tensors at ep > 1, d/ep and the expert-dp rank.
    cut: int = 1
    cut_rank: int = 0
    expert: bool = False

    def part(self, dp: int, rank: int) -> slice:
        """Return dp rank ``rank``'s part of the bucket."""
        n = self.size // dp
        return slice(rank * n, (rank + 1) * n)

    def mine(self) -> slice:
        """Return this rank's part of the bucket."""
        return self.part(self.cut, self.cut_rank)


@dataclass
class ExpertCut:
    """How ZeRO-1 cuts the routed experts' buckets at ep > 1: over the expert-dp group (the
    d/ep ranks holding the same experts), reduced there and divided by ep as well, so that
    each expert's gradient is the one-process gradient (:mod:`hpcllm.parallel.data.experts`)."""

    params: set[int]  # id() of the expert tensors
    ranks: int  # d / ep
    rank: int  # this rank's expert-dp rank
    ep: int
    collectives: Collectives
    group: Any  # the torch expert-dp group (the state's gather at save)


def plan_buckets(
    groups: Sequence[Sequence[nn.Parameter]],
    chunk_of: dict[int, int],
    late: set[int],
    bucket_numel: int,
    experts: set[int] | frozenset[int] = frozenset(),
) -> list[tuple[int, int, bool, bool, list[int]]]:
    """Return the buckets as (group, chunk, late, expert, indices into the flat parameter
    list).

    Per group and chunk, parameters in reverse order (the order their gradients are ready in)
    fill buckets of up to ``bucket_numel`` elements; a parameter larger than that has a
    bucket of its own. Late parameters, and expert tensors (``experts``, cut over another
    group), get buckets of their own. Every rank of the dp group plans the same buckets: they
    depend on the parameters' order and sizes only.
    """
    flat = [p for g in groups for p in g]
    index = {id(p): i for i, p in enumerate(flat)}
    plan = []
    for g, params in enumerate(groups):
        chunks = sorted({chunk_of[id(p)] for p in params})
        for chunk in chunks:
            for is_late, of_experts in ((False, False), (True, False), (False, True)):
                mine = [
                    p
                    for p in reversed(params)
                    if chunk_of[id(p)] == chunk
                    and (id(p) in late) == is_late
                    and (id(p) in experts) == of_experts
                ]
                current: list[int] = []
                filled = 0
                for p in mine:
                    if current and filled + p.numel() > bucket_numel:
                        plan.append((g, chunk, is_late, of_experts, current))
                        current, filled = [], 0
                    current.append(index[id(p)])
                    filled += p.numel()
                if current:
                    plan.append((g, chunk, is_late, of_experts, current))
    return plan


class Collectives:
    """Reduce-scatter and all-gather of a bucket over the dp group, in place, asynchronous."""

    def reduce_scatter(self, flat: torch.Tensor, part: slice, dp: int, key: int) -> Any:
        """Start averaging ``flat`` (bucket ``key``) over the group into this rank's
        ``flat[part]``."""
        raise NotImplementedError

    def all_gather(self, flat: torch.Tensor, part: slice, key: int) -> Any:
        """Start gathering every rank's part of ``flat`` (bucket ``key``) into all of it."""
        raise NotImplementedError

    def wait(self, work: Any) -> None:
        """Finish what ``reduce_scatter`` or ``all_gather`` started."""
        raise NotImplementedError


class TorchCollectives(Collectives):
    """torch.distributed on the dp group (gloo on CPU, NCCL on GPUs), in place: the output is
    the input's own part, which both backends take."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def reduce_scatter(self, flat: torch.Tensor, part: slice, dp: int, key: int) -> Any:
        out = flat[part]
        # A sum, divided once it has arrived: gloo has no average.
        work = dist.reduce_scatter_single(out, flat, group=self.group, async_op=True)
        return (work, lambda: out.div_(dp))

    def all_gather(self, flat: torch.Tensor, part: slice, key: int) -> Any:
        return (dist.all_gather_single(flat, flat[part], group=self.group, async_op=True), None)

    def wait(self, work: Any) -> None:
        handle, then = work
        handle.wait()
        if then is not None:
            then()


class HorovodCollectives(Collectives):
    """Horovod's reducescatter and allgather on the dp communicator it was started on (they
    return new tensors, copied back into the bucket)."""

    def __init__(self, hvd: Any, process_set: Any = None) -> None:
        self.hvd = hvd
        # None: Horovod's whole world (the dp communicator); else a declared process set.
        self.on = {} if process_set is None else {"process_set": process_set}
        self.prefix = "" if process_set is None else "experts."

    # Horovod matches the ranks' requests by name, whatever order they come in: one name per
    # bucket and collective (each is in flight once at a time).

    # Horovod 0.28 moves no bf16 (train.param_dtype: bf16): the gradients are averaged in
    # fp32, and the weights gathered as the same bits in int16.

    def reduce_scatter(self, flat: torch.Tensor, part: slice, dp: int, key: int) -> Any:
        name = f"hpcllm.zero.{self.prefix}reducescatter.{key}"
        sent = flat.float() if flat.dtype == torch.bfloat16 else flat
        handle = self.hvd.reducescatter_async(sent, name=name, op=self.hvd.Average, **self.on)
        return (handle, lambda result: flat[part].copy_(result))

    def all_gather(self, flat: torch.Tensor, part: slice, key: int) -> Any:
        name = f"hpcllm.zero.{self.prefix}allgather.{key}"
        bits = flat.dtype == torch.bfloat16
        sent = flat[part].view(torch.int16) if bits else flat[part]
        handle = self.hvd.allgather_async(sent, name=name, **self.on)
        return (
            handle,
            lambda result: flat.copy_(result.view(torch.bfloat16) if bits else result),
        )

    def wait(self, work: Any) -> None:
        handle, then = work
        then(self.hvd.synchronize(handle))


class DistributedAdamW(torch.optim.AdamW):
    """AdamW over this rank's parts of the buckets.

    Its param groups are the plain optimizer's (same order, same settings; each holds this
    rank's parts of that group's buckets), so the trainer's LR schedule and the checkpoints'
    hyperparameters are unchanged. ``state_dict`` is this rank's shard with the bucket
    layout; ``load_state_dict`` takes a plain AdamW state of the same parameters (what
    checkpoints read back) or this rank's own shard, and keeps this rank's part.
    """

    def __init__(self, zero: ZeroState, plain: torch.optim.Optimizer) -> None:
        self.zero = zero
        groups = []
        for g, group in enumerate(plain.param_groups):
            settings = {k: v for k, v in group.items() if k != "params"}
            groups.append({**settings, "params": zero.group_parts(g)})
        super().__init__(groups)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the gradients live in the engine's buckets, which it zeroes once the
        parameters are gathered after the step."""

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return self.zero.shard_state(super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        super().load_state_dict(self.zero.own_state(state_dict))


class ZeroState:
    """This rank's buckets and its parts of them (one per rank).

    With fp32 parameters a rank's part of a bucket's data *is* its master copy: the optimizer
    steps it in place and the all-gather spreads it, so a parameter costs 4 + 4 + 8/d bytes.
    """

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
        dtype: torch.dtype = torch.float32,
        experts: ExpertCut | None = None,
    ) -> None:
        self.dp, self.dp_rank, self.collectives = dp, dp_rank, collectives
        self.experts = experts
        self.dp_group = dp_group
        self.dtype = dtype
        self.flat_params = [p for g in groups for p in g]
        self.group_sizes = [len(g) for g in groups]
        device = self.flat_params[0].device
        self.buckets: list[Bucket] = []
        # With 16-bit weights, fp32 master copies of this rank's parts, from the fp32 values
        # the model was built with.
        self.masters: dict[int, torch.Tensor] = {}
        plan = plan_buckets(
            groups, chunk_of, late, bucket_numel, experts.params if experts else frozenset()
        )
        # Optimizer slots: group by group, buckets in plan order within a group.
        slots = sorted(range(len(plan)), key=lambda k: (plan[k][0], k))
        slot_of = {k: slot for slot, k in enumerate(slots)}
        for k, (g, chunk, is_late, of_experts, indices) in enumerate(plan):
            params = [self.flat_params[i] for i in indices]
            offsets, total = [], 0
            for p in params:
                offsets.append(total)
                total += p.numel()
            cut, cut_rank = (dp, dp_rank)
            if of_experts and experts is not None:
                cut, cut_rank = experts.ranks, experts.rank
            size = -(-total // cut) * cut
            exact = torch.zeros(size, dtype=torch.float32, device=device)
            with torch.no_grad():
                for p, off in zip(params, offsets, strict=True):
                    exact[off : off + p.numel()].copy_(p.reshape(-1))
            data = exact if dtype == torch.float32 else exact.to(dtype)
            grad = torch.zeros(size, dtype=dtype, device=device)
            for p, off in zip(params, offsets, strict=True):
                p.data = data[off : off + p.numel()].view_as(p)
                p.grad = grad[off : off + p.numel()].view_as(p)
            bucket = Bucket(
                g, chunk, is_late, params, indices, offsets, size, slot_of[k], data, grad,
                cut=cut, cut_rank=cut_rank, expert=of_experts,
            )  # fmt: skip
            if dtype != torch.float32:
                master = exact[bucket.mine()].clone()
                master.grad = torch.zeros_like(master)
                self.masters[bucket.slot] = master
            self.buckets.append(bucket)
        # What the optimizer steps: with fp32 weights a rank's part of the bucket itself (its
        # master copy), else the fp32 master of that part.
        self.parts: list[torch.Tensor] = [torch.empty(0)] * len(self.buckets)
        for bucket in self.buckets:
            mine = bucket.mine()
            if bucket.slot in self.masters:
                self.parts[bucket.slot] = self.masters[bucket.slot]
            else:
                part = bucket.data[mine]
                part.grad = bucket.grad[mine]
                self.parts[bucket.slot] = part
        # What the gradient norm counts of each part: split over tp (summed over the tp
        # group), whole (the same on every tp rank: counted once), or nothing (the last
        # stage's copy of the tied embedding, which the first stage counts; the padding).
        self.segments: list[list[tuple[slice, str]]] = [[] for _ in self.buckets]
        # Summed over the dp group, expert parts count each expert once: the ep ranks hold
        # other experts, the expert-dp ranks other parts of the same ones.
        for bucket in self.buckets:
            mine = bucket.mine()
            for p, off in zip(bucket.params, bucket.offsets, strict=True):
                lo, hi = max(off, mine.start), min(off + p.numel(), mine.stop)
                if lo >= hi or not role(p).counted:  # another stage or tp rank counts it
                    continue
                kind = "split" if tp_split(p) else "whole"
                seg = slice(lo - mine.start, hi - mine.start)
                self.segments[bucket.slot].append((seg, kind))
        self._armed: int | None = None
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        # Each chunk's buckets that launch during the backward, by the group they reduce
        # over (dense: dp; experts: expert-dp), in plan order (:meth:`_launch_ready`).
        self._queues: dict[tuple[int, bool], list[Bucket]] = {}
        for bucket in self.buckets:
            if not bucket.late:
                self._queues.setdefault((bucket.chunk, bucket.expert), []).append(bucket)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.flat_params
        ]

    def group_parts(self, group: int) -> list[torch.Tensor]:
        """Return this rank's parts of ``group``'s buckets, in slot order."""
        return [
            self.parts[b.slot]
            for b in sorted(self.buckets, key=lambda b: b.slot)
            if b.group == group
        ]

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
            self._launch_ready(self._queues[bucket.chunk, bucket.expert])

    def _launch_ready(self, queue: list[Bucket]) -> None:
        """Launch the ready buckets at the head of ``queue`` (one group's, in plan order).

        A group's ranks must start its collectives in one order. The order gradients become
        ready in can differ between them: a rank whose experts got no token never touches
        their weights (no hook fires), so their buckets wait for disarm there and not on
        its peers. Launching in plan order, a bucket only after those before it, keeps the
        order whatever the readiness."""
        for bucket in queue:
            if bucket.launched:
                continue
            if bucket.pending:
                return
            self._launch(bucket)

    def _collectives(self, bucket: Bucket) -> Collectives:
        return self.experts.collectives if bucket.expert and self.experts else self.collectives

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched = True
        if bucket.cut > 1:
            bucket.work = self._collectives(bucket).reduce_scatter(
                bucket.grad, bucket.mine(), bucket.cut, bucket.slot
            )

    def finish(self) -> float:
        """Start the late buckets and any not started, wait for every reduce-scatter; return
        the seconds spent."""
        started = time.perf_counter()
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                self._collectives(bucket).wait(bucket.work)
                bucket.work = None
            if bucket.expert and self.experts:
                # Averaged over expert-dp; the tokens of the ep group summed already: / ep.
                bucket.grad[bucket.mine()].div_(self.experts.ep)
            if bucket.slot in self.masters:
                self.masters[bucket.slot].grad.copy_(bucket.grad[bucket.mine()])
        return time.perf_counter() - started

    # -- the step ----------------------------------------------------------------------

    def grad_norm(self, tp_group: Any, pp_group: Any) -> torch.Tensor:
        """Return the global gradient norm from this rank's parts: over tp, dp and pp."""
        device = self.parts[0].device
        sums = {"split": torch.zeros((), device=device), "whole": torch.zeros((), device=device)}
        for slot, part in enumerate(self.parts):
            for kind in ("split", "whole"):
                views = [part.grad[seg] for seg, k in self.segments[slot] if k == kind]
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
        """All-gather the stepped parts into the parameters, and zero the gradients for the
        next step; return the seconds spent."""
        started = time.perf_counter()
        for bucket in self.buckets:
            if bucket.slot in self.masters:
                bucket.data[bucket.mine()].copy_(self.masters[bucket.slot])
        works = [
            (b, self._collectives(b).all_gather(b.data, b.mine(), b.slot))
            for b in self.buckets
            if b.cut > 1
        ]
        for bucket, work in works:
            self._collectives(bucket).wait(work)
        for bucket in self.buckets:
            bucket.grad.zero_()
            bucket.launched = False
        return time.perf_counter() - started

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
                    "slot": b.slot,
                    "indices": b.indices,
                    "offsets": b.offsets,
                    "size": b.size,
                }
                for b in self.buckets
            ],
        }

    def shard_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Return ``state`` (the parts' optimizer state) as this rank's checkpoint shard; with
        16-bit weights each part's state also holds its fp32 ``master_weight``.

        At ep > 1 the ranks of d hold different experts, which the dp-rank shards cannot
        describe: the state is then this rank's parameters' plain state instead
        (:meth:`plain_state`, a collective), as the other engines save it."""
        if self.masters:
            state = {
                **state,
                "state": {
                    slot: {**entry, "master_weight": self.masters[slot].detach().clone()}
                    for slot, entry in state["state"].items()
                },
            }
        if self.experts is not None:
            return self.plain_state(state)
        return {"format": FORMAT, "dp_rank": self.dp_rank, "layout": self.layout(), **state}

    def plain_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Return the plain AdamW ``state_dict`` of this rank's parameters from the parts'
        ``state`` (their ``master_weight`` included), on the host, where a checkpoint needs
        it: each bucket's parts gathered to the first rank of the group it is cut over (dp
        rank 0, which writes the model file, or expert-dp rank 0, which writes its experts' file),
        in bucket order on every rank (a collective). The other ranks' entries for those
        parameters are left out; nothing they return is written."""
        per_slot = state["state"]
        plain: dict[int, dict[str, Any]] = {}
        for bucket in self.buckets if per_slot else []:
            entry = per_slot[bucket.slot]
            group = self.experts.group if bucket.expert and self.experts else self.dp_group
            step = entry["step"]
            whole = bucket.cut == 1 or bucket.cut_rank == 0
            for name in ("exp_avg", "exp_avg_sq", "master_weight"):
                if name not in entry:
                    continue
                flat = entry[name].contiguous()
                if bucket.cut > 1:
                    root = dist.get_process_group_ranks(group)[0]
                    parts = [torch.empty_like(flat) for _ in range(bucket.cut)] if whole else None
                    dist.gather(flat, parts, dst=root, group=group)
                    if parts is None:
                        continue
                    flat = torch.cat(parts)
                    del parts
                flat = flat.cpu()
                for i, off in zip(bucket.indices, bucket.offsets, strict=True):
                    p = self.flat_params[i]
                    out = plain.setdefault(
                        i, {"step": step.clone() if torch.is_tensor(step) else step}
                    )
                    out[name] = flat[off : off + p.numel()].reshape(p.shape).clone()
        param_groups, start = [], 0
        for g, size in enumerate(self.group_sizes):
            settings = {k: v for k, v in state["param_groups"][g].items() if k != "params"}
            param_groups.append({**settings, "params": list(range(start, start + size))})
            start += size
        return {"state": dict(sorted(plain.items())), "param_groups": param_groups}

    def own_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Return the parts' optimizer state for this rank from a plain or a shard state.

        Master weights in it (a run with 16-bit weights saved them) go where this run keeps
        them: into its fp32 masters, or, with fp32 weights, into the weights themselves.
        """
        if state.get("format") == FORMAT:
            if not (state["layout"] == self.layout() and state["dp_rank"] == self.dp_rank):
                state = merge_shards([state])  # only a whole set (d = 1) merges alone
            else:
                state = self._take_masters_of_parts(state)
                return {"state": state["state"], "param_groups": state["param_groups"]}
        return self._cut_plain(state)

    def _take_masters_of_parts(self, state: dict[str, Any]) -> dict[str, Any]:
        entries = {}
        with torch.no_grad():
            for slot, entry in state["state"].items():
                entry = dict(entry)
                master = entry.pop("master_weight", None)
                if master is not None and slot in self.masters:
                    self.masters[slot].copy_(master)
                entries[slot] = entry
        return {**state, "state": entries}

    def sync_masters(self) -> None:
        """Set each fp32 master that no longer rounds to its 16-bit weights from them (weights
        loaded from a checkpoint that saved no masters); a master the weights came from
        (a fresh start, or masters loaded with their weights) is kept, bits and all."""
        with torch.no_grad():
            for bucket in self.buckets:
                master = self.masters.get(bucket.slot)
                if master is not None:
                    mine = bucket.data[bucket.mine()]
                    if not torch.equal(master.to(mine.dtype), mine):
                        master.copy_(mine)

    def _cut_plain(self, plain: dict[str, Any]) -> dict[str, Any]:
        per_param = plain["state"]
        groups = plain["param_groups"]
        if [len(g["params"]) for g in groups] != self.group_sizes:
            raise ValueError("the optimizer state holds other parameter groups than this model's")
        state: dict[int, dict[str, Any]] = {}
        if per_param:
            saved_masters = "master_weight" in next(iter(per_param.values()))
            if saved_masters and not self.masters:
                # fp32 weights take the saved masters whole (every rank has the whole state).
                with torch.no_grad():
                    for i, p in enumerate(self.flat_params):
                        p.copy_(per_param[i]["master_weight"].reshape(p.shape))
            names = ["exp_avg", "exp_avg_sq"]
            if saved_masters and self.masters:
                names.append("master_weight")
            for bucket in self.buckets:
                mine = bucket.mine()
                entry: dict[str, Any] = {}
                for name in names:
                    flat = torch.zeros(mine.stop - mine.start, dtype=torch.float32)
                    for i, off in zip(bucket.indices, bucket.offsets, strict=True):
                        n = self.flat_params[i].numel()
                        lo, hi = max(off, mine.start), min(off + n, mine.stop)
                        if lo < hi:
                            src = per_param[i][name].reshape(-1)[lo - off : hi - off]
                            flat[lo - mine.start : hi - mine.start].copy_(src)
                    entry[name] = flat
                step = per_param[bucket.indices[0]]["step"]
                entry["step"] = step.clone() if torch.is_tensor(step) else step
                master = entry.pop("master_weight", None)
                if master is not None:
                    with torch.no_grad():
                        self.masters[bucket.slot].copy_(master)
                state[bucket.slot] = entry
        param_groups = []
        for g, group in enumerate(groups):
            slots = sorted(b.slot for b in self.buckets if b.group == g)
            param_groups.append({**group, "params": slots})
        return {"state": state, "param_groups": param_groups}

    def remove(self) -> None:
        """Remove the gradient hooks (the engine is done)."""
        for hook in self._hooks:
            hook.remove()


class ShardedOptimizer(MixedPrecisionOptimizer):
    """The distributed optimizer as the trainer steps it: the global norm from this rank's
    parts of the reduced gradient (over tp, dp and pp), this rank's part stepped, then every
    part all-gathered into the parameters (which also zeroes the gradient buckets)."""

    def __init__(
        self,
        engine: DistributedOptimizerEngine,
        inner: DistributedAdamW,
        scaler: torch.amp.GradScaler,
        clip: float,
    ) -> None:
        assert engine.zero is not None
        super().__init__(inner, scaler, clip, engine.grid.groups, engine.zero.parts)
        self.engine = engine
        self.zero = engine.zero

    def grad_norm(self) -> torch.Tensor:
        return self.zero.grad_norm(self.groups.tp, self.groups.pp)

    def state_params(self) -> list[torch.Tensor]:
        return list(self.zero.flat_params)

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        result = super().step()
        self.engine.comm_wait_s += self.zero.gather_params()
        return result


class DistributedOptimizerEngine(Engine):
    """``ddp`` or ``horovod`` with ``parallel.distributed_optimizer``: gradients reduce-
    scattered in buckets during the backward, each rank stepping its 1/d of the optimizer
    state, parameters all-gathered after the step (this module).
    """

    def __init__(
        self, grid: Grid, parallel: ParallelConfig, name: str, param_dtype: str = "fp32"
    ) -> None:
        super().__init__(grid)
        self.name = name
        self.param_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[param_dtype]
        self.bucket_mb = parallel.ddp_bucket_mb
        self.zero: ZeroState | None = None
        if name == "horovod":
            self.hvd, self.settings = start_horovod(grid, parallel)
            self.collectives: Collectives = HorovodCollectives(self.hvd)
        else:
            self.collectives = TorchCollectives(grid.groups.dp)

    def all_to_all(self) -> AllToAll:
        if self.name == "horovod":
            return horovod_all_to_all(self.hvd, expert_process_sets_of(self.hvd, self.grid)[0])
        return super().all_to_all()

    def describe(self) -> str:
        mpi = describe_mpi(self.grid.device.type == "cuda")
        how = (
            f"Horovod reducescatter + allgather ({horovod_transport(self.grid, self.hvd)}, "
            f"{describe_horovod(self.settings)}{', ' + mpi if mpi else ''})"
            if self.name == "horovod"
            else "torch reduce-scatter + all-gather"
        )
        buckets = len(self.zero.buckets) if self.zero is not None else 0
        weights = (
            "bf16 weights and gradients, fp32 masters and moments"
            if self.param_dtype == torch.bfloat16
            else "fp32 weights (a rank's part is its master) and moments"
        )
        return (
            f"distributed optimizer (ZeRO-1): {how} in {buckets} buckets of up to "
            f"{self.bucket_mb:g} MB; {weights}, 1/{self.grid.dp} of the optimizer per rank"
            + (
                f" (of its experts' 1/{self.grid.dp // self.grid.ep}, cut over expert-dp)"
                if self.grid.ep > 1
                else ""
            )
        )

    def master_bytes(self) -> int:
        if self.zero is None:
            return 0
        return sum(m.numel() * m.element_size() for m in self.zero.masters.values())

    def buffer_bytes(self) -> tuple[int, int]:
        # The buckets, padding included: the parameters and their gradients are views.
        if self.zero is None:
            return super().buffer_bytes()
        weights = sum(b.data.numel() * b.data.element_size() for b in self.zero.buckets)
        return weights, sum(b.grad.numel() * b.grad.element_size() for b in self.zero.buckets)

    def wrap(self, modules: Sequence[nn.Module]) -> list[nn.Module]:
        super().wrap(modules)
        self.from_first_replica(self.parameters)  # every replica starts from dp rank 0's
        return list(modules)

    def build_optimizer(
        self,
        inner: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        clip: float,
        accumulation: int,
    ) -> MixedPrecisionOptimizer:
        if not isinstance(inner, torch.optim.AdamW):
            raise UserError("parallel.distributed_optimizer shards AdamW's state only")
        groups = [group["params"] for group in inner.param_groups]
        chunk_of = {id(p): i for i, m in enumerate(self.modules) for p in m.parameters()}
        # A gradient summed beyond d (its role's sums) is reduced once those sums are done.
        late = {id(p) for g in groups for p in g if role(p).sums}
        tp_split = (lambda p: role(p).split is not None) if self.grid.tp > 1 else (lambda p: False)
        experts = None
        if self.grid.ep > 1:
            grid = self.grid
            cut = grid.dp // grid.ep
            if self.name == "horovod":
                _, on = expert_process_sets_of(self.hvd, grid)
                collectives: Collectives = HorovodCollectives(self.hvd, on)
            else:
                collectives = TorchCollectives(grid.groups.expert_dp)
            experts = ExpertCut(
                {id(p) for g in groups for p in g if is_expert(p)},
                cut,
                grid.expert_dp_rank,
                grid.ep,
                collectives,
                grid.groups.expert_dp,
            )
        self.zero = ZeroState(
            groups,
            chunk_of,
            late,
            self.grid.dp,
            self.grid.dp_rank,
            max(1, int(self.bucket_mb * 1024 * 1024) // 4),
            self.collectives,
            self.grid.groups.dp,
            tp_split,
            self.param_dtype,
            experts,
        )
        self.optimizer = ShardedOptimizer(self, DistributedAdamW(self.zero, inner), scaler, clip)
        return self.optimizer

    def backward(
        self, chunk: int, outs: list[torch.Tensor], grads: list[torch.Tensor | None], last: bool
    ) -> None:
        assert self.zero is not None
        if not last:
            torch.autograd.backward(outs, grads)
            return
        self.zero.arm(chunk)
        try:
            torch.autograd.backward(outs, grads)
        finally:
            self.zero.disarm(chunk)

    def finalize_grads(self) -> None:
        # The tp and tied-embedding sums first: the reduce-scatter leaves each rank 1/d of the
        # gradient (the sequence-parallel and tied parameters wait in late buckets for them).
        assert self.zero is not None
        finalize_model_grads(self.parameters, self.grid.groups)
        self.comm_wait_s += self.zero.finish()

    def broadcast_state(self) -> None:
        # Every replica loaded the same weights (into the buckets the parameters are views
        # of) and each its part of the optimizer state; with 16-bit weights the fp32 masters
        # follow weights that came without them.
        assert self.zero is not None
        self.zero.sync_masters()
