"""Data-parallel engines behind one interface: ``parallel.dp_engine: ddp | horovod | ps``.

All three give the same result: after each optimizer step every replica holds the parameters
one process would have after training on the whole global batch. They differ in how the
gradients travel, which is what ``hpcllm bench dp`` measures:

* ``ddp``: PyTorch DistributedDataParallel. Gradients are all-reduced in buckets while
  backward is still running (overlap); ``no_sync`` skips it during accumulation.
* ``horovod``: Horovod's ring all-reduce with tensor fusion, started on the grid's
  data-parallel MPI communicator, so each model shard (t·p > 1) has its own Horovod world.
* ``ps``: a single parameter server, what ``nn.DataParallel`` does: every rank sends its whole
  gradient to the dp group's root, which averages, steps, and broadcasts the new parameters.
  No overlap and one root link carrying everything: the bottleneck Bai (2022) measured.

Each engine also times this rank's exposed communication (``comm_wait_s``: time spent waiting
for gradients after its own backward finished), so a slow rank shows up as the one whose
peers wait for it.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpcllm.errors import UserError
from hpcllm.parallel.tensor import clip_grad_norm

ENGINES = ("ddp", "horovod", "ps")


class Engine:
    """What the trainer needs from a data-parallel engine."""

    name = "none"
    waits_in_backward = False  # whether comm_wait_s was spent inside the last backward

    def __init__(self, model: nn.Module, grid: Any) -> None:
        self.model = model
        self.module: nn.Module = model
        self.grid = grid
        self.comm_wait_s = 0.0
        # The global gradient norm spans the tensor-parallel slices and pipeline stages.
        self.tp_group = grid.tp_group if getattr(grid, "tp", 1) > 1 else None
        self.pp_group = grid.pp_group if getattr(grid, "pp", 1) > 1 else None
        # A pipeline rank's model is a ModuleList of chunks, each run as one module.
        self.pipelined = isinstance(model, nn.ModuleList)
        self.pipeline_modules: list[nn.Module] = []
        if self.pipelined:
            from hpcllm.parallel.pipeline.stages import StageForward

            self.pipeline_modules = [StageForward(chunk) for chunk in model]

    def pipeline_forward(self, chunk: int) -> Any:
        """Return the context for a pipeline forward of ``chunk``."""
        return contextlib.nullcontext()

    def pipeline_backward(
        self, chunk: int, outs: list[torch.Tensor], grads: list[torch.Tensor | None], last: bool
    ) -> None:
        """Backward from ``chunk``'s outputs; ``last`` marks the chunk's last of the step."""
        torch.autograd.backward(outs, grads)

    def attach_optimizer(
        self, optimizer: torch.optim.Optimizer, accumulation: int
    ) -> torch.optim.Optimizer:
        """Return the optimizer the trainer should use (Horovod wraps it)."""
        return optimizer

    def broadcast_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Make every replica hold rank 0's weights and optimizer state (after a resume)."""

    def accumulate(self, last_micro_batch: bool) -> Any:
        """Return the context for one micro-batch's forward and backward."""
        return contextlib.nullcontext()

    def finish_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the reduced (averaged) gradients available where the optimizer steps."""

    def step(
        self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, clip: float
    ) -> tuple[float, bool]:
        """Unscale, clip, step and update the scaler; return (grad norm, step skipped)."""
        return _local_step(self.model, optimizer, scaler, clip, self.tp_group, self.pp_group)

    def reset_timers(self) -> None:
        """Start a new step's communication timing."""
        self.comm_wait_s = 0.0


def _local_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    clip: float,
    tp_group: Any = None,
    pp_group: Any = None,
) -> tuple[float, bool]:
    scaler.unscale_(optimizer)
    norm = clip_grad_norm(list(model.parameters()), clip, tp_group, pp_group)
    if scaler.is_enabled() and not torch.isfinite(norm):
        # The norm spans every tp and pp rank, so an overflow anywhere makes it inf or NaN
        # everywhere: every rank then skips the step and backs off its scale together, as
        # Megatron-LM does by all-reducing found-inf. Each rank's own check sees only its
        # gradients (GradScaler keeps that flag per optimizer; it has no public setter).
        for found in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            found.fill_(1.0)
    scale = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    return float(norm), bool(scaler.is_enabled() and scaler.get_scale() < scale)


class _AllReduceTimer:
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


def _timed_hook(inner: Any) -> Any:
    # DDP inspects the hook's annotations and accepts only dist.GradBucket (or none) for the
    # bucket, which postponed annotations turn into strings: leave it unannotated.
    def hook(state: _AllReduceTimer, bucket):  # noqa: ANN001, ANN202
        state.launched.append(time.perf_counter())

        def done(fut: torch.futures.Future) -> torch.Tensor:
            state.finished.append(time.perf_counter())
            return fut.value()

        return inner(state.group, bucket).then(done)

    return hook


class DDPEngine(Engine):
    """PyTorch DistributedDataParallel over the grid's data-parallel group."""

    name = "ddp"
    waits_in_backward = True

    def __init__(
        self,
        model: nn.Module,
        grid: Any,
        bucket_mb: float = 25.0,
        gradient_as_bucket_view: bool = True,
        compression: str = "none",
    ) -> None:
        super().__init__(model, grid)
        self.timer = _AllReduceTimer(grid.dp_group)
        if grid.dp > 1:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            from torch.nn.parallel import DistributedDataParallel

            inner = {
                "none": default_hooks.allreduce_hook,
                "fp16": default_hooks.fp16_compress_hook,
                "bf16": default_hooks.bf16_compress_hook,
            }[compression]

            def wrap(module: nn.Module) -> DistributedDataParallel:
                ddp = DistributedDataParallel(
                    module,
                    device_ids=[grid.device] if grid.device.type == "cuda" else None,
                    process_group=grid.dp_group,
                    bucket_cap_mb=bucket_mb,
                    gradient_as_bucket_view=gradient_as_bucket_view,
                )
                ddp.register_comm_hook(self.timer, _timed_hook(inner))
                return ddp

            if self.pipelined:
                # One DDP per chunk: each reduces after its own last backward of the step.
                self.pipeline_modules = [wrap(m) for m in self.pipeline_modules]
            else:
                self.module = wrap(model)

    def pipeline_forward(self, chunk: int) -> Any:
        # Forwards never arm DDP's reducer: other micro-batches' backwards run between a
        # forward and its own backward. pipeline_backward arms it for the last one.
        module = self.pipeline_modules[chunk]
        return module.no_sync() if self.grid.dp > 1 else contextlib.nullcontext()

    def pipeline_backward(
        self, chunk: int, outs: list[torch.Tensor], grads: list[torch.Tensor | None], last: bool
    ) -> None:
        if last and self.grid.dp > 1:
            # What DDP's forward does when it will sync, done for the backward that ends the
            # chunk's step (torch.distributed.pipelining does the same).
            self.pipeline_modules[chunk].reducer.prepare_for_backward(list(outs))
        torch.autograd.backward(outs, grads)

    def accumulate(self, last_micro_batch: bool) -> Any:
        if last_micro_batch or self.module is self.model:
            return contextlib.nullcontext()
        return self.module.no_sync()

    def finish_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        # DDP finished the reduction inside the last backward; what it waited for there is
        # the time from its last bucket's launch to that bucket's completion.
        self.comm_wait_s += self.timer.exposed_wait()

    def reset_timers(self) -> None:
        super().reset_timers()
        self.timer.launched.clear()
        self.timer.finished.clear()


class HorovodEngine(Engine):
    """Horovod ring all-reduce, initialised on the data-parallel MPI communicator."""

    name = "horovod"

    def __init__(
        self,
        model: nn.Module,
        grid: Any,
        fusion_mb: float | None = None,
        cycle_ms: float | None = None,
        compression: str = "none",
    ) -> None:
        super().__init__(model, grid)
        # Under mpirun Horovod's CPU collectives must go through MPI: its gloo path crashes
        # there. Fusion buffer and cycle time are read once, by hvd.init.
        os.environ.setdefault("HOROVOD_CPU_OPERATIONS", "MPI")
        if fusion_mb is not None:
            os.environ["HOROVOD_FUSION_THRESHOLD"] = str(int(fusion_mb * 1024 * 1024))
        if cycle_ms is not None:
            os.environ["HOROVOD_CYCLE_TIME"] = str(cycle_ms)
        try:
            import horovod.torch as hvd
        except ImportError as err:
            raise UserError(
                f"parallel.dp_engine: horovod needs Horovod built with MPI and "
                f"PyTorch; run `make setup` ({err})"
            ) from None
        if grid.dp_comm is None:
            raise UserError(
                "parallel.dp_engine: horovod needs a launcher (mpirun or srun "
                "--mpi=pmix), even for one rank"
            )
        hvd.init(comm=grid.dp_comm)
        if hvd.size() != grid.dp:
            raise UserError(
                f"Horovod sees {hvd.size()} ranks in the data-parallel group, "
                f"the grid has d = {grid.dp}"
            )
        self.hvd = hvd
        self.compression = hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none
        if compression == "bf16":
            raise UserError(
                "Horovod compresses to fp16 only; use parallel.dp_compression: fp16 or none"
            )

    def attach_optimizer(
        self, optimizer: torch.optim.Optimizer, accumulation: int
    ) -> torch.optim.Optimizer:
        # A new optimizer object of the same class and groups: load checkpointed state into
        # the returned one, not into the one given.
        return self.hvd.DistributedOptimizer(
            optimizer,
            named_parameters=self.model.named_parameters(),
            backward_passes_per_step=accumulation,
            compression=self.compression,
            op=self.hvd.Average,
        )

    def broadcast_state(self, optimizer: torch.optim.Optimizer) -> None:
        # Every replica starts from rank 0's weights, whatever the init, as Horovod users
        # expect.
        self.hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        if optimizer.state:
            # Only real state (a resumed run): on empty state Horovod initialises it by
            # stepping with zero gradients, which would apply AdamW's weight decay once.
            self.hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def finish_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        started = time.perf_counter()
        optimizer.synchronize()  # waits for the all-reduces the backward hooks started
        self.comm_wait_s += time.perf_counter() - started

    def step(
        self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, clip: float
    ) -> tuple[float, bool]:
        # Gradients are already averaged (synchronize); unscale and clip those, then step
        # without Horovod synchronising a second time.
        with optimizer.skip_synchronize():
            return _local_step(self.model, optimizer, scaler, clip, self.tp_group, self.pp_group)


class ParameterServerEngine(Engine):
    """One parameter server (the dp group's first rank), as ``nn.DataParallel`` does it.

    After the last backward every rank sends its whole gradient, flattened, to the root with
    one reduce; the root averages, unscales, clips and steps; then one broadcast sends every
    parameter back. Nothing overlaps with compute.
    """

    name = "ps"

    def __init__(self, model: nn.Module, grid: Any) -> None:
        super().__init__(model, grid)
        self.group = grid.dp_group
        self.root = grid.layout.dp_group(grid.rank)[0]
        self.is_root = grid.dp_rank == 0
        self.params = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in self.params])
            if grid.dp > 1:
                dist.broadcast(flat, src=self.root, group=self.group)
            self._unflatten(flat, [p.data for p in self.params])

    @staticmethod
    def _unflatten(flat: torch.Tensor, targets: list[torch.Tensor]) -> None:
        offset = 0
        for target in targets:
            n = target.numel()
            target.copy_(flat[offset : offset + n].view_as(target))
            offset += n

    def finish_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        if self.grid.dp == 1:
            return
        started = time.perf_counter()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.reduce(flat, dst=self.root, group=self.group)
        if self.is_root:
            flat /= self.grid.dp
            for p, g in zip(self.params, grads, strict=True):
                if p.grad is None:
                    p.grad = g
            self._unflatten(flat, [p.grad for p in self.params])
        self.comm_wait_s += time.perf_counter() - started

    def step(
        self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, clip: float
    ) -> tuple[float, bool]:
        if self.grid.dp == 1:
            return _local_step(self.model, optimizer, scaler, clip, self.tp_group, self.pp_group)
        device = self.params[0].device  # nccl moves CUDA tensors only
        result = torch.zeros(3, device=device)  # grad norm, skipped, new loss scale
        if self.is_root:
            norm, skipped = _local_step(
                self.model, optimizer, scaler, clip, self.tp_group, self.pp_group
            )
            result = torch.tensor(
                [norm, float(skipped), scaler.get_scale() if scaler.is_enabled() else 1.0],
                device=device,
            )
        started = time.perf_counter()
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in self.params])
            dist.broadcast(flat, src=self.root, group=self.group)
            dist.broadcast(result, src=self.root, group=self.group)
            if not self.is_root:
                self._unflatten(flat, [p.data for p in self.params])
        self.comm_wait_s += time.perf_counter() - started
        if not self.is_root:
            # Only the root stepped; the others drop their (unreduced) gradients and take the
            # root's loss scale so the next backward scales alike.
            optimizer.zero_grad()
            if scaler.is_enabled():
                scaler.update(new_scale=float(result[2]))
        return float(result[0]), bool(result[1])


def build_engine(name: str, model: nn.Module, grid: Any, parallel: Any) -> Engine:
    """Return the data-parallel engine ``parallel.dp_engine`` names, set up from ``parallel``."""
    if name == "ddp":
        return DDPEngine(
            model, grid, parallel.ddp_bucket_mb, parallel.ddp_bucket_view, parallel.dp_compression
        )
    if name == "horovod":
        return HorovodEngine(
            model,
            grid,
            parallel.horovod_fusion_mb,
            parallel.horovod_cycle_ms,
            parallel.dp_compression,
        )
    if name == "ps":
        if parallel.dp_compression != "none":
            raise UserError("parallel.dp_compression applies to ddp and horovod, not ps")
        return ParameterServerEngine(model, grid)
    raise UserError(f"parallel.dp_engine must be one of {', '.join(ENGINES)}, got {name!r}")
