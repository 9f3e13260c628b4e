"""What one turn of the training loop runs: a synchronous step, or an asynchronous segment.

The trainer chooses the strategy once, at start-up (:func:`choose_step`), from its
data-parallel engine, and its loop never asks which it has:

- :class:`SynchronousStep` (every engine but ps-async; local SGD is a synchronous step whose
  optimizer averages the replicas every H steps) runs one optimizer step as Megatron-Core
  takes it: this rank's schedule over the step's micro-batches, the engine's one
  ``finalize_grads()`` (its reduction over d and the model's gradient sums), then
  ``optimizer.step()``, which unscales, clips, skips on inf/NaN and returns (grad norm,
  skipped).
- :class:`SegmentStep` (an engine that :class:`~hpcllm.parallel.data.engine.RunsSegments`,
  ps-async) hands the engine the steps up to the loop's next sync point (a logged step, a
  save, a validation, a profiler bound, the end) and one worker object: the engine's server
  applies the workers' gradients as they come, so no step boundary exists in between.

Both run the same :class:`ScheduleRunner` for a rank's forwards and backwards, and both return
a :class:`StepOutcome`: the metrics record of the turn and how many steps it took.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.amp import GradScaler

from hpcllm import observe, watchdog
from hpcllm.config import Config, moe_layers
from hpcllm.model import moe
from hpcllm.parallel.data.engine import RunsSegments
from hpcllm.parallel.data.optimizer import MixedPrecisionOptimizer
from hpcllm.parallel.pipeline.runtime import Runtime
from hpcllm.parallel.pipeline.schedule import Interval
from hpcllm.topology import Grid
from hpcllm.train.divergence import DivergenceGuard
from hpcllm.train.optim import lr_at, step_autocast_cache
from hpcllm.train.parallelize import ParallelModel
from hpcllm.train.stage_work import MicroBatches, stage_loss_sum
from hpcllm.train.state import TrainState

# Called after the gradients are finished, before the optimizer step, with the step, this
# rank's model chunks (a ModuleList; one chunk, the whole GPT, with one pipeline stage) and
# the optimizer (whose main_grads() are the gradients its step reads, whatever the engine).
GradHook = Callable[[int, torch.nn.Module, MixedPrecisionOptimizer], None]


@dataclass
class StepOutcome:
    """What one turn of the loop did."""

    record: dict[str, Any]  # the metrics of its (last) step; loss and grad norm may be tensors
    steps: int  # optimizer steps taken: 1, or a segment's
    synced: bool  # whether the host has read the device's results (the skip count is current)


class Step(Protocol):
    """A step strategy: what one turn of the training loop runs."""

    def run(
        self,
        batches: Iterator[Any],
        state: TrainState,
        *,
        until: int,
        timed: bool = False,
        wait: bool = True,
    ) -> StepOutcome:
        """Train from ``state`` (advancing it) toward ``until``, the next sync point."""
        ...


class ScheduleRunner:
    """Runs this rank's pipeline schedule over one step's micro-batches.

    Keeps the intervals of the last run in :attr:`timeline` (for the timeline files).
    """

    def __init__(self, cfg: Config, grid: Grid, model: ParallelModel, accumulation: int) -> None:
        self.cfg, self.grid, self.model = cfg, grid, model
        self.scaler: GradScaler = model.optimizer.scaler
        self.accumulation = accumulation
        self.timeline: list[Interval] = []
        # Mixtures of experts: this rank's MoE layers, closed after each step's backwards
        # (the sigmoid router's bias, the figures logged) on every rank, MoE layers held or not.
        self.moe_blocks = moe_layers(cfg.model)
        self.moe = bool(self.moe_blocks)
        self.moe_layers = moe.layers_of(list(model.chunks))
        self.moe_figures: dict[str, torch.Tensor] = {}
        self.moe_table: torch.Tensor | None = None  # per MoE block, the last step's

    def __call__(self, batches: Iterator[Any], timed: bool) -> tuple[torch.Tensor, float, float]:
        """Return the step's summed micro-batch losses, its data time and its compute time.

        The losses are summed on every stage. On a GPU, ``timed`` steps wait for each action's
        kernels, so their intervals time the device.
        """
        train, model, device = self.cfg.train, self.model, self.grid.device
        micro = MicroBatches(batches, self.accumulation, device)
        # Only the last stage scales a loss; every stage's scaler must hold the scale, since
        # each unscales its own gradients and all of them update it together.
        self.scaler.scale(torch.zeros((), device=device))
        work = model.stage_work(micro, train.precision, device, scale=self.scaler.scale)
        if timed and model.pp_group is not None:
            # Stages of a logged step start together, so that its recorded timelines share
            # one origin; other steps skip it (on NCCL a barrier waits for the device).
            with watchdog.waiting("pipeline start barrier", axis="pp"):
                dist.barrier(group=model.pp_group)
        with (
            observe.nvtx_range(f"pipeline {model.schedule}"),
            step_autocast_cache(train.precision, device),
        ):
            sync = torch.cuda.synchronize if timed and device.type == "cuda" else None
            self.timeline = Runtime(model.channel).run(
                model.actions, work, split_backward=model.split_backward, synchronize=sync
            )
        if self.moe:
            # An engine running segments (ps-async, local SGD) has no step all ranks meet at.
            lockstep = not isinstance(model.engine, RunsSegments)
            groups = (self.grid.groups.dp, model.pp_group) if lockstep else (None, None)
            with watchdog.waiting("MoE loads all-reduce", axis="dp"):
                self.moe_figures, self.moe_table = moe.end_step(
                    self.moe_layers,
                    self.cfg.model.moe_bias_rate,
                    groups,
                    device,
                    self.moe_blocks,
                    self.cfg.model.moe_experts,
                )
        # Micro-batches are read inside the forwards that first need them.
        compute = sum(i.end - i.start for i in self.timeline if i.kind.is_compute)
        loss_sum = stage_loss_sum(work, model.pp_group, device)
        return loss_sum, micro.data_time, self._straggle(compute - micro.data_time)

    def _straggle(self, compute_time: float) -> float:
        """Return this rank's compute time, made ``train.straggler_factor`` times as long on
        ``train.straggler_rank``: as if its forward and backward took that long, before its
        gradients leave it (its peers wait for them, or for it)."""
        train = self.cfg.train
        if self.grid.rank == train.straggler_rank and train.straggler_factor > 1:
            with observe.nvtx_range("straggler sleep"):
                time.sleep((train.straggler_factor - 1) * compute_time)
            compute_time *= train.straggler_factor
        return compute_time


class SynchronousStep:
    """One optimizer step over ``accumulation`` micro-batches, every rank in lockstep."""

    def __init__(
        self,
        runner: ScheduleRunner,
        guard: DivergenceGuard,
        global_batch: int,
        grad_hooks: list[GradHook],
    ) -> None:
        self.runner, self.guard = runner, guard
        self.cfg, self.grid, self.model = runner.cfg, runner.grid, runner.model
        self.global_batch = global_batch
        self.grad_hooks = grad_hooks
        self.untimed = 0  # steps since the all-to-all's time was last taken

    def run(
        self,
        batches: Iterator[Any],
        state: TrainState,
        *,
        until: int,
        timed: bool = False,
        wait: bool = True,
    ) -> StepOutcome:
        """Run one step (``until``, the next sync point, is always at least one step away).

        ``timed`` (on logged steps) waits for the GPU after each forward and backward, so that
        the per-rank compute time measures the device's work, not kernel launches. Without
        ``wait`` the step reads nothing back from the device (bf16 and fp32; fp16's skip check
        must): its loss and grad norm stay 0-d device tensors and its step time is the host's,
        so on a GPU the next step's kernels queue behind this one's. The loop waits on logged
        steps only; its mean step time over a logging interval is then still the device's.
        """
        train, model, engine = self.cfg.train, self.model, self.model.engine
        optimizer, device = self.model.optimizer, self.grid.device
        started = time.perf_counter()
        lr = lr_at(state.step, train, self.global_batch)
        for group in optimizer.param_groups:
            group["lr"] = lr
        model.chunks.train()
        engine.reset_timers()
        loss_sum, data_time, compute_time = self.runner(batches, timed)
        with (
            observe.nvtx_range("gradient communication"),
            watchdog.waiting("gradient communication", axis="dp"),
        ):
            engine.finalize_grads()
        # What DDP's reducer waited for inside the last backward was not compute.
        compute_time -= engine.backward_wait_s
        for hook in self.grad_hooks:
            hook(state.step, model.chunks, optimizer)
        with observe.nvtx_range("optimizer"), watchdog.waiting("optimizer step", axis="mp"):
            grad_norm, skipped = optimizer.step()
            optimizer.zero_grad()
        # Counted on the device; read on logged steps and before saving.
        self.guard.count_step(skipped)
        state.advance(1, self.global_batch)
        loss_mean = loss_sum / self.runner.accumulation
        if self.grid.dp > 1:
            with watchdog.waiting("loss all-reduce", axis="dp"):
                dist.all_reduce(loss_mean, group=self.grid.groups.dp)
            loss_mean /= self.grid.dp
        if wait:
            # On a GPU the host meets a stalled collective here, where it reads the device.
            with watchdog.waiting("device results"):
                self.guard.check(state)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
        record = {
            "step": state.step,
            "loss": loss_mean.item() if wait else loss_mean,
            "lr": lr,
            "grad_norm": grad_norm.item() if wait else grad_norm,
            "step_time_s": time.perf_counter() - started,
            "data_time_s": data_time,
            "compute_s": compute_time,
            "comm_wait_s": engine.comm_wait_s,
            "skipped": bool(skipped) if wait else skipped,
        }
        for name, value in self.runner.moe_figures.items():
            record[name] = value.item() if wait else value
        self.untimed += 1
        timer = engine.all_to_all_timer
        if timer is not None and wait:
            # This rank's all-to-alls since the last step that waited, per step.
            record["moe_all_to_all_s"] = timer.take() / self.untimed
            self.untimed = 0
        if wait and self.runner.moe_table is not None:
            record.update(moe.per_block(self.runner.moe_table, self.runner.moe_blocks))
        return StepOutcome(record, steps=1, synced=wait)


class SegmentWork:
    """This rank's worker side of a segment: a gradient of one step's micro-batches, and the
    learning rate of each step (what :class:`~hpcllm.parallel.data.engine.SegmentWorker`
    asks of it)."""

    def __init__(self, runner: ScheduleRunner, batches: Iterator[Any], global_batch: int) -> None:
        self.runner, self.batches, self.global_batch = runner, batches, global_batch
        self.params = runner.model.parameters

    def local_gradient(self) -> tuple[torch.Tensor, float, float]:
        """Compute this rank's gradient of its next micro-batches; return (mean loss, data
        seconds, compute seconds)."""
        for p in self.params:
            p.grad = None
        loss_sum, data_time, compute_time = self.runner(self.batches, timed=False)
        return loss_sum / self.runner.accumulation, data_time, compute_time

    def lr(self, step: int) -> float:
        """Return the learning rate of step ``step``."""
        return lr_at(step, self.runner.cfg.train, self.global_batch)


class SegmentStep:
    """The steps up to the next sync point under an engine that runs segments (ps-async)."""

    def __init__(
        self,
        runner: ScheduleRunner,
        engine: RunsSegments,
        guard: DivergenceGuard,
        global_batch: int,
    ) -> None:
        self.runner, self.engine, self.guard = runner, engine, guard
        self.cfg, self.model = runner.cfg, runner.model
        self.global_batch = global_batch

    def run(
        self,
        batches: Iterator[Any],
        state: TrainState,
        *,
        until: int,
        timed: bool = False,
        wait: bool = True,
    ) -> StepOutcome:
        """Run the steps from ``state.step`` to ``until``; the record is the segment's last
        step's, its times the segment's means per step. A segment always ends synced."""
        steps = until - state.step
        started = time.perf_counter()
        self.model.chunks.train()
        worker = SegmentWork(self.runner, batches, self.global_batch)
        stats = self.engine.run_segment(state.step, steps, worker)
        state.advance(steps, self.global_batch)
        # A step with a skipped update counts as a skipped step; train.max_bad_steps counts
        # whole steps' worth of the server's updates skipped in a row (the segment's stats
        # carry both to every rank).
        self.guard.count_segment(stats.skipped_steps, stats.bad_steps_in_a_row)
        record = {
            "step": state.step,
            "loss": stats.loss,
            "lr": stats.lr,
            "grad_norm": stats.grad_norm,
            "step_time_s": (time.perf_counter() - started) / steps,
            "data_time_s": stats.data_s / steps,
            "compute_s": stats.compute_s / steps,
            "comm_wait_s": stats.wait_s / steps,
            "skipped": stats.skipped > 0,
            "steps": steps,
            **stats.metrics(),
        }
        return StepOutcome(record, steps=steps, synced=True)


def choose_step(
    runner: ScheduleRunner,
    guard: DivergenceGuard,
    global_batch: int,
    grad_hooks: list[GradHook],
) -> Step:
    """Return the step strategy of the run's data-parallel engine (chosen once, at start-up)."""
    engine = runner.model.engine
    if isinstance(engine, RunsSegments):
        return SegmentStep(runner, engine, guard, global_batch)
    return SynchronousStep(runner, guard, global_batch, grad_hooks)
