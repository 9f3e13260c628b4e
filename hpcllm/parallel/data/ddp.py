"""``parallel.dp_engine: ddp``: PyTorch DistributedDataParallel over the data-parallel group.

Gradients are all-reduced in buckets while backward is still running (overlap); forwards run
under ``no_sync`` and the backward that ends a chunk's step arms the reducer, so gradient
accumulation and pipeline schedules reduce once per step. At ep > 1 the experts' tensors are
left out of DDP and averaged over their expert-dp group after the backward
(:mod:`hpcllm.parallel.data.experts`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hpcllm.parallel.data.engine import Engine
from hpcllm.parallel.data.experts import is_expert, reduce_expert_grads
from hpcllm.topology import Grid


class AllReduceTimer:
    """DDP communication hook state: when buckets were launched and when they completed."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.launched: list[float] = []
        self.finished: list[float] = []

    def exposed_wait(self) -> float:
        """Return the time from the last bucket's launch to the last completion."""
        if not self.launched or not self.finished:
            return 0.0
        return max(0.0, max(self.finished) - max(self.launched))


def timed_hook(inner: Any) -> Any:
    """Return DDP communication hook ``inner`` (a torch default hook), stamping each bucket's
    launch and completion into its :class:`AllReduceTimer` state."""

    # DDP inspects the hook's annotations and accepts only dist.GradBucket (or none) for the
    # bucket, which postponed annotations turn into strings: leave it unannotated.
    def hook(state: AllReduceTimer, bucket):  # noqa: ANN001, ANN202
        state.launched.append(time.perf_counter())

        def done(fut: torch.futures.Future) -> torch.Tensor:
            state.finished.append(time.perf_counter())
            return fut.value()

        return inner(state.group, bucket).then(done)

    return hook


def describe_ddp(bucket_mb: float, bucket_view: bool, compression: str) -> str:
    """Return DDP's settings as one line."""
    return (
        f"bucket {bucket_mb:g} MB, gradient_as_bucket_view {str(bucket_view).lower()}, "
        f"compression {compression}"
    )


class DDPEngine(Engine):
    """PyTorch DistributedDataParallel over the grid's data-parallel group, one per chunk.

    Each chunk's DDP reduces after that chunk's last backward of the step, so with several
    chunks (interleaved pipelines) the reductions overlap the remaining backwards.
    """

    name = "ddp"

    def __init__(
        self,
        grid: Grid,
        bucket_mb: float = 25.0,
        gradient_as_bucket_view: bool = True,
        compression: str = "none",
    ) -> None:
        super().__init__(grid)
        self.timer = AllReduceTimer(grid.groups.dp)
        self.bucket_mb = bucket_mb
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.compression = compression
        self.wrapped: list[nn.Module] = []

    def describe(self) -> str:
        return describe_ddp(self.bucket_mb, self.gradient_as_bucket_view, self.compression)

    def buffer_bytes(self) -> tuple[int, int]:
        weights, gradients = super().buffer_bytes()
        # Without gradient_as_bucket_view DDP's buckets are a second copy of the gradients.
        if self.grid.dp > 1 and not self.gradient_as_bucket_view:
            gradients *= 2
        return weights, gradients

    def wrap(self, modules: Sequence[nn.Module]) -> list[nn.Module]:
        super().wrap(modules)
        if self.grid.dp == 1:
            self.wrapped = list(modules)
            return self.wrapped
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        inner = {
            "none": default_hooks.allreduce_hook,
            "fp16": default_hooks.fp16_compress_hook,
            "bf16": default_hooks.bf16_compress_hook,
        }[self.compression]
        self.wrapped = []
        for module in modules:
            # Expert tensors (ep > 1) differ by ep rank: DDP neither broadcasts nor reduces
            # them; reduce_grads averages them over their expert-dp group.
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                module, [name for name, p in module.named_parameters() if is_expert(p)]
            )
            ddp = DistributedDataParallel(
                module,
                device_ids=[self.grid.device] if self.grid.device.type == "cuda" else None,
                process_group=self.grid.groups.dp,
                bucket_cap_mb=self.bucket_mb,
                gradient_as_bucket_view=self.gradient_as_bucket_view,
            )
            ddp.register_comm_hook(self.timer, timed_hook(inner))
            self.wrapped.append(ddp)
        return self.wrapped

    def forward_context(self, chunk: int) -> Any:
        # Forwards never arm DDP's reducer: other micro-batches' backwards may run between a
        # forward and its own backward. backward() arms it for the chunk's last one.
        return self.wrapped[chunk].no_sync() if self.grid.dp > 1 else contextlib.nullcontext()

    def backward(
        self, chunk: int, outs: list[torch.Tensor], grads: list[torch.Tensor | None], last: bool
    ) -> None:
        if last and self.grid.dp > 1:
            # What DDP's forward does when it will sync, done for the backward that ends the
            # chunk's step (torch.distributed.pipelining does the same).
            self.wrapped[chunk].reducer.prepare_for_backward(list(outs))
        torch.autograd.backward(outs, grads)

    def reduce_grads(self) -> None:
        # DDP finished the reduction inside the last backward; what it waited for there is
        # the time from its last bucket's launch to that bucket's completion.
        waited = self.timer.exposed_wait()
        self.comm_wait_s += waited
        self.backward_wait_s += waited
        if self.grid.ep > 1:
            started = time.perf_counter()
            reduce_expert_grads(self.parameters, self.grid.groups.expert_dp, self.grid.dp)
            self.comm_wait_s += time.perf_counter() - started

    def reset_timers(self) -> None:
        super().reset_timers()
        self.timer.launched.clear()
        self.timer.finished.clear()
