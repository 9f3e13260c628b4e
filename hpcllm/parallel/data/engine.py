"""The protocol every data-parallel engine follows, and the engine of one replica.

All engines give the same result: after each optimizer step every replica holds the
parameters one process would have after training on the whole global batch (ps-async and
local SGD relax that on purpose). They differ in how the gradients travel, which is what
``hpcllm bench dp`` measures. The trainer uses an engine in this order:

1. :meth:`Engine.wrap` this rank's stage modules (one per model chunk); what it returns runs
   the forwards;
2. :meth:`Engine.build_optimizer`: the optimizer the trainer steps
   (:class:`~hpcllm.parallel.data.optimizer.MixedPrecisionOptimizer` or the engine's own);
3. after a resume, :meth:`Engine.resume_at` and :meth:`Engine.broadcast_state`;
4. in each step, :meth:`Engine.forward_context` around each forward, :meth:`Engine.backward`
   for each backward, then one :meth:`Engine.finalize_grads` (the engine's reduction over d
   and the model's gradient sums, in the order that engine needs: Megatron-Core's
   ``finalize_model_grads``), then ``optimizer.step()``, which returns (grad norm, skipped);
5. :meth:`Engine.before_save` before a checkpoint.

An engine that trains whole segments of steps between the trainer's sync points (ps-async)
also follows :class:`RunsSegments`; the trainer chooses its step strategy from that, once.

Each engine also times this rank's exposed communication (``comm_wait_s``: time spent waiting
for gradients after its own backward finished; ``backward_wait_s``, the part of it spent inside
the last backward, which DDP's reducer waits in), so a slow rank shows up as the one whose
peers wait for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from hpcllm.parallel.data.experts import (
    AllToAll,
    TimedAllToAll,
    split_experts,
    torch_all_to_all,
)
from hpcllm.parallel.data.finalize import finalize_model_grads
from hpcllm.parallel.data.flat import broadcast_parameters
from hpcllm.parallel.data.optimizer import MixedPrecisionOptimizer
from hpcllm.topology import Grid


class Engine:
    """What the trainer needs from a data-parallel engine, and the engine of one replica."""

    name = "none"

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.comm_wait_s = 0.0
        self.backward_wait_s = 0.0
        # The MoE layers' all-to-all, timed (ep > 1; hpcllm.train.parallelize sets it).
        self.all_to_all_timer: TimedAllToAll | None = None
        self.modules: list[nn.Module] = []
        self.optimizer: MixedPrecisionOptimizer | None = None

    def describe(self) -> str:
        """Return the engine's settings as one line, for the banner and ``bench dp``."""
        return "no gradient reduction (one replica)"

    def master_bytes(self) -> int:
        """Return the bytes of fp32 master weights kept apart from the weights (none)."""
        return 0

    def buffer_bytes(self) -> tuple[int, int]:
        """Return the bytes this rank holds of weights and of gradients."""
        weights = sum(p.numel() * p.element_size() for p in self.parameters)
        return weights, weights

    @property
    def parameters(self) -> list[nn.Parameter]:
        """Return the wrapped modules' trainable parameters, in module order."""
        return [p for m in self.modules for p in m.parameters() if p.requires_grad]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Return the wrapped modules' parameters with names unique across modules."""
        return [
            (f"{i}.{name}", p)
            for i, m in enumerate(self.modules)
            for name, p in m.named_parameters()
        ]

    def wrap(self, modules: Sequence[nn.Module]) -> list[nn.Module]:
        """Take this rank's stage modules; return the modules that run their forwards."""
        self.modules = list(modules)
        return list(modules)

    def from_first_replica(self, params: Sequence[torch.Tensor]) -> None:
        """Give every replica dp rank 0's values of ``params`` (nothing with one replica):
        where every engine but DDP and Horovod starts its replicas, and where ps-async's
        workers take the server's weights. Expert tensors (ep > 1) come from the first rank
        holding the same experts."""
        if self.grid.dp > 1:
            dense, experts = split_experts(params)
            root = self.grid.layout.dp_group(self.grid.rank)[0]
            broadcast_parameters(dense, root, self.grid.groups.dp)
            if experts and self.grid.dp > self.grid.ep:
                root = self.grid.layout.expert_dp_group(self.grid.rank)[0]
                broadcast_parameters(experts, root, self.grid.groups.expert_dp)

    def all_to_all(self) -> AllToAll:
        """Return the all-to-all over this rank's expert-parallel group that the MoE layers
        send tokens with (torch.distributed's; Horovod's engine gives its own)."""
        return torch_all_to_all(self.grid.groups.ep)

    def build_optimizer(
        self,
        inner: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        clip: float,
        accumulation: int,
    ) -> MixedPrecisionOptimizer:
        """Return the optimizer the trainer steps, over ``inner`` (built on the wrapped
        modules' parameters), with ``accumulation`` backwards per step."""
        self.optimizer = MixedPrecisionOptimizer(
            inner, scaler, clip, self.grid.groups, self.parameters
        )
        return self.optimizer

    def forward_context(self, chunk: int) -> Any:
        """Return the context for a forward of ``chunk``."""
        return contextlib.nullcontext()

    def backward(
        self, chunk: int, outs: list[torch.Tensor], grads: list[torch.Tensor | None], last: bool
    ) -> None:
        """Backward from ``chunk``'s outputs; ``last`` marks the chunk's last of the step."""
        torch.autograd.backward(outs, grads)

    def finalize_grads(self) -> None:
        """Complete every gradient after the step's last backward: the engine's reduction over
        d (:meth:`reduce_grads`), then the tp and tied-embedding sums
        (:func:`~hpcllm.parallel.data.finalize.finalize_model_grads`).

        Engines that write the averaged gradient over ``.grad`` sum after it (Horovod's
        synchronize would overwrite an earlier sum); the distributed optimizer, whose
        reduce-scatter leaves each rank 1/d of the gradient, sums before it.
        """
        self.reduce_grads()
        finalize_model_grads(self.parameters, self.grid.groups)

    def reduce_grads(self) -> None:
        """Make the reduced (averaged) gradients available where the optimizer steps."""

    def broadcast_state(self) -> None:
        """Make every replica hold rank 0's weights and optimizer state (after a resume)."""

    def resume_at(self, step: int) -> None:
        """Learn the step a run resumes after (local SGD counts its averaging periods)."""

    def before_save(self) -> None:
        """Make the replicas agree before a checkpoint (local SGD averages them)."""

    def reset_timers(self) -> None:
        """Start a new step's communication timing."""
        self.comm_wait_s = 0.0
        self.backward_wait_s = 0.0


class SegmentWorker(Protocol):
    """What a rank computes for an engine that runs segments: one worker's side."""

    def local_gradient(self) -> tuple[torch.Tensor, float, float]:
        """Compute one gradient (a step's micro-batches of this rank) into the parameters'
        ``.grad``; return (mean loss, data seconds, compute seconds)."""
        ...

    def lr(self, step: int) -> float:
        """Return the learning rate of step ``step``."""
        ...


@runtime_checkable
class RunsSegments(Protocol):
    """An engine that trains the steps between two of the trainer's sync points as one
    segment (ps-async), instead of one step at a time."""

    def run_segment(self, first_step: int, steps: int, worker: SegmentWorker) -> Any:
        """Train ``steps`` steps from ``first_step`` with ``worker``; return its stats."""
        ...
