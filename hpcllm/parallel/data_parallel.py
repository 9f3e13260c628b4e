"""Data-parallel engines behind one interface: ``parallel.dp_engine: ddp | horovod | ps``
(and ``ps-async | local-sgd``).

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

Two more strategies, ``ps-async`` (a stale-synchronous parameter server) and ``local-sgd``
(replicas averaged every H steps), do not wait for every rank each step; they live in
:mod:`hpcllm.parallel.async_engines` behind the same interface.

Each engine also times this rank's exposed communication (``comm_wait_s``: time spent waiting
for gradients after its own backward finished), so a slow rank shows up as the one whose
peers wait for it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpcllm.config import ParallelConfig
from hpcllm.errors import UserError
from hpcllm.topology import Grid

ENGINES = ("ddp", "horovod", "ps", "ps-async", "local-sgd")

StepFn = Callable[[], tuple[torch.Tensor, torch.Tensor]]


class Engine:
    """What the trainer needs from a data-parallel engine, and the engine of one replica.

    The protocol, in the order the trainer uses it: :meth:`wrap` the stage modules (one per
    model chunk; what it returns runs the forwards), :meth:`attach_optimizer`,
    :meth:`broadcast_state` after a resume; in each step :meth:`forward_context` around each
    forward, :meth:`backward` for each backward, :meth:`finish_gradients` after the last, and
    :meth:`step`, which is handed the default optimizer step. Engines move gradients; the step
    is the trainer's, and an engine changes it through :meth:`step` only where its algorithm
    needs to (Horovod's optimizer must not synchronise twice; the parameter server steps on
    its root and broadcasts).
    """

    name = "none"
    waits_in_backward = False  # whether comm_wait_s was spent inside the last backward
    # Whether the tp and tied-embedding sums of gradients come before the engine's reduction
    # (the distributed optimizer reduce-scatters them last) or after it (the others).
    reduces_after_model_grads = False

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.comm_wait_s = 0.0
        self.modules: list[nn.Module] = []

    holds_optimizer_state = True  # whether this rank's optimizer steps (and keeps state)
    # ps-async trains a whole segment of steps between the trainer's sync points
    # (run_segment) instead of one step at a time.
    runs_segments = False
    # local SGD without averaging the moments: each replica's optimizer state is its own
    # and the checkpoint keeps every one.
    optimizer_per_replica = False

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

    def forward_context(self, chunk: int) -> Any:
        """Return the context for a forward of ``chunk``."""
        return contextlib.nullcontext()

    def backward(
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

    def resume_at(self, step: int) -> None:
        """Learn the step a run resumes after (local SGD counts its averaging periods)."""

    def before_save(self) -> None:
        """Make the replicas agree before a checkpoint (local SGD averages them)."""

    def finish_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the reduced (averaged) gradients available where the optimizer steps."""

    def gradients_for_step(
        self, tp_group: Any, pp_group: Any
    ) -> tuple[list[torch.Tensor], Callable[[], torch.Tensor]] | None:
        """Return where the step's gradients are and their global norm, when not in the
        parameters' ``.grad`` (the distributed optimizer's masters hold 1/d of them)."""
        return None

    def step(
        self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, local_step: StepFn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the optimizer step; return (grad norm, step skipped) as 0-d device tensors.

        ``local_step`` is the default step on this rank's gradients (unscale, clip, step,
        update the scale); engines run it as it is unless their algorithm steps elsewhere.
        """
        return local_step()

    def reset_timers(self) -> None:
        """Start a new step's communication timing."""
        self.comm_wait_s = 0.0


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
    """PyTorch DistributedDataParallel over the grid's data-parallel group, one per chunk.

    Each chunk's DDP reduces after that chunk's last backward of the step, so with several
    chunks (interleaved pipelines) the reductions overlap the remaining backwards.
    """

    name = "ddp"
    waits_in_backward = True

    def __init__(
        self,
        grid: Any,
        bucket_mb: float = 25.0,
        gradient_as_bucket_view: bool = True,
        compression: str = "none",
    ) -> None:
        super().__init__(grid)
        self.timer = _AllReduceTimer(grid.dp_group)
        self.bucket_mb = bucket_mb
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.compression = compression

    def describe(self) -> str:
        return describe_ddp(self.bucket_mb, self.gradient_as_bucket_view, self.compression)

    def buffer_bytes(self) -> tuple[int, int]:
        weights, gradients = super().buffer_bytes()
        # Without gradient_as_bucket_view DDP's buckets are a second copy of the gradients.
        if self.grid.dp > 1 and not self.gradient_as_bucket_view:
            gradients *= 2
        return weights, gradients
        self.wrapped: list[nn.Module] = []

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
            ddp = DistributedDataParallel(
                module,
                device_ids=[self.grid.device] if self.grid.device.type == "cuda" else None,
                process_group=self.grid.dp_group,
                bucket_cap_mb=self.bucket_mb,
                gradient_as_bucket_view=self.gradient_as_bucket_view,
            )
            ddp.register_comm_hook(self.timer, _timed_hook(inner))
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

    def finish_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        # DDP finished the reduction inside the last backward; what it waited for there is
        # the time from its last bucket's launch to that bucket's completion.
        self.comm_wait_s += self.timer.exposed_wait()

    def reset_timers(self) -> None:
        super().reset_timers()
        self.timer.launched.clear()
        self.timer.finished.clear()


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


# Each ``parallel.horovod_*`` key, the variable Horovod reads it from, and how it is written.
HOROVOD_KEYS: dict[str, tuple[str, Callable[[Any], str]]] = {
    "horovod_fusion_mb": ("HOROVOD_FUSION_THRESHOLD", lambda mb: str(int(mb * 1024 * 1024))),
    "horovod_cycle_ms": ("HOROVOD_CYCLE_TIME", _number),
    "horovod_response_cache": ("HOROVOD_CACHE_CAPACITY", str),
    "horovod_autotune": ("HOROVOD_AUTOTUNE", lambda on: "1" if on else "0"),
    "horovod_autotune_log": ("HOROVOD_AUTOTUNE_LOG", str),
}

# Horovod 0.28's own defaults, for the report.
HOROVOD_DEFAULTS = {
    "HOROVOD_FUSION_THRESHOLD": str(128 * 1024 * 1024),
    "HOROVOD_CYCLE_TIME": "1",
    "HOROVOD_CACHE_CAPACITY": "1024",
    "HOROVOD_AUTOTUNE": "0",
    "HOROVOD_AUTOTUNE_LOG": "",
}

# hpcllm's defaults where they differ from Horovod's, per device type, from `bench dp` and
# `bench allreduce` sweeps (docs/benchmarks.md, "Horovod's settings"). On CPU ranks the
# background thread shares the rank's cores: each cycle's negotiation costs compute time, so
# fewer cycles per step pay. GPUs keep Horovod's defaults until they are measured there.
HOROVOD_TUNED: dict[str, dict[str, str]] = {
    "cpu": {"HOROVOD_CYCLE_TIME": "5"},
    "cuda": {},
}


def horovod_settings(
    parallel: ParallelConfig, environ: dict[str, str] | os._Environ[str], device_type: str
) -> dict[str, tuple[str, str]]:
    """Return ``{variable: (value, source)}`` for every Horovod setting hpcllm has a key for.

    Precedence, first that is set: the ``parallel.horovod_*`` key (config file or ``--set``),
    the ``HOROVOD_*`` variable in the environment (``jobs/mpirun.sh`` passes those on to every
    rank), hpcllm's default for the device type (:data:`HOROVOD_TUNED`), Horovod's default.
    ``source`` says which: ``config``, ``environment``, ``hpcllm default`` or ``Horovod
    default``.

    With autotune on, hpcllm's defaults step aside: Horovod tunes only the settings it is not
    given (a fusion threshold or cycle time set by key or variable stays fixed).
    """
    settings: dict[str, tuple[str, str]] = {}
    for key, (variable, write) in HOROVOD_KEYS.items():
        value = getattr(parallel, key)
        if value is not None:
            settings[variable] = (write(value), "config")
        elif variable in environ:
            settings[variable] = (environ[variable], "environment")
    autotune = settings.get("HOROVOD_AUTOTUNE", ("0", ""))[0] not in ("", "0")
    tuned = {} if autotune else HOROVOD_TUNED.get(device_type, {})
    for variable, default in HOROVOD_DEFAULTS.items():
        if variable not in settings:
            if variable in tuned:
                settings[variable] = (tuned[variable], "hpcllm default")
            else:
                source = "tuned by Horovod" if autotune and variable in _AUTOTUNED else None
                settings[variable] = (default, source or "Horovod default")
    return {variable: settings[variable] for variable in HOROVOD_DEFAULTS}


# What Horovod's autotune searches (of the settings above).
_AUTOTUNED = ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "HOROVOD_CACHE_CAPACITY")


def describe_mpi(gpu: bool) -> str:
    """Return the Open MPI settings hpcllm chose or found (``topology.mpi_settings``)."""
    from hpcllm.topology import applied_mpi_settings

    return ", ".join(
        f"Open MPI {variable.removeprefix('OMPI_MCA_')} {value} ({source})"
        for variable, (value, source) in applied_mpi_settings(gpu).items()
    )


def describe_horovod(settings: dict[str, tuple[str, str]]) -> str:
    """Return the settings as one line: ``cycle 5 ms (hpcllm default), ...``."""
    names = {
        "HOROVOD_FUSION_THRESHOLD": ("fusion", lambda v: f"{int(v) / 2**20:g} MiB"),
        "HOROVOD_CYCLE_TIME": ("cycle", lambda v: f"{v} ms"),
        "HOROVOD_CACHE_CAPACITY": ("response cache", lambda v: "off" if v == "0" else v),
        "HOROVOD_AUTOTUNE": ("autotune", lambda v: "on" if v not in ("", "0") else "off"),
        "HOROVOD_AUTOTUNE_LOG": ("autotune log", lambda v: v),
    }
    parts = []
    for variable, (value, source) in settings.items():
        label, show = names[variable]
        if variable == "HOROVOD_AUTOTUNE_LOG" and not value:
            continue
        try:
            shown = show(value)
        except ValueError:
            shown = value
        if source == "tuned by Horovod":
            parts.append(f"{label} tuned by Horovod from {shown}")
        else:
            parts.append(f"{label} {shown} ({source})")
    return ", ".join(parts)


def describe_ddp(bucket_mb: float, bucket_view: bool, compression: str) -> str:
    """Return DDP's settings as one line."""
    return (
        f"bucket {bucket_mb:g} MB, gradient_as_bucket_view {str(bucket_view).lower()}, "
        f"compression {compression}"
    )


def start_horovod(grid: Any, parallel: ParallelConfig | None) -> tuple[Any, dict[str, Any]]:
    """Start Horovod on the grid's data-parallel MPI communicator; return it and its settings.

    The settings (:func:`horovod_settings`) are handed to Horovod through its variables, which
    ``hvd.init`` reads once.
    """
    device = getattr(grid, "device", torch.device("cpu"))
    settings = horovod_settings(parallel or ParallelConfig(), os.environ, device.type)
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
    # Only now that Horovod will start: a refused start leaves the environment as it was.
    # Under mpirun Horovod's CPU collectives must go through MPI: its gloo path crashes there.
    os.environ.setdefault("HOROVOD_CPU_OPERATIONS", "MPI")
    for variable, (value, source) in settings.items():
        if source in ("config", "hpcllm default"):
            os.environ[variable] = value
    if grid.timeout_s is not None:
        # Horovod's stall check from the groups' timeout, unless the user set it: warn
        # early (at most Horovod's 60 s), shut down at the timeout. Whole seconds; Horovod
        # checks once per warning interval and ignores a shutdown time not above it.
        warn = max(1, min(60, int(grid.timeout_s) // 2))
        os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(warn))
        shutdown = max(warn + 1, round(grid.timeout_s))
        os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(shutdown))
    hvd.init(comm=grid.dp_comm)
    if hvd.size() != grid.dp:
        raise UserError(
            f"Horovod sees {hvd.size()} ranks in the data-parallel group, "
            f"the grid has d = {grid.dp}"
        )
    return hvd, settings


def horovod_transport(grid: Any, hvd: Any) -> str:
    """Return what carries Horovod's collectives of this grid's tensors."""
    return "NCCL" if grid.device.type == "cuda" and hvd.nccl_built() else "MPI"


class HorovodEngine(Engine):
    """Horovod ring all-reduce, initialised on the data-parallel MPI communicator."""

    name = "horovod"

    def __init__(
        self,
        grid: Any,
        parallel: ParallelConfig | None = None,
        compression: str = "none",
    ) -> None:
        super().__init__(grid)
        self.hvd, self.settings = start_horovod(grid, parallel)
        hvd = self.hvd
        self.compression = hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none
        self.compression_name = compression
        if compression == "bf16":
            raise UserError(
                "Horovod compresses to fp16 only; use parallel.dp_compression: fp16 or none"
            )

    def describe(self) -> str:
        mpi = describe_mpi(self.grid.device.type == "cuda")
        return (
            f"{horovod_transport(self.grid, self.hvd)}, {describe_horovod(self.settings)}, "
            f"compression {self.compression_name}" + (f", {mpi}" if mpi else "")
        )

    def attach_optimizer(
        self, optimizer: torch.optim.Optimizer, accumulation: int
    ) -> torch.optim.Optimizer:
        # A new optimizer object of the same class and groups: load checkpointed state into
        # the returned one, not into the one given. Its gradient hooks all-reduce each
        # parameter once it has accumulated ``accumulation`` backward passes.
        return self.hvd.DistributedOptimizer(
            optimizer,
            named_parameters=self.named_parameters(),
            backward_passes_per_step=accumulation,
            compression=self.compression,
            op=self.hvd.Average,
        )

    def broadcast_state(self, optimizer: torch.optim.Optimizer) -> None:
        # Every replica starts from rank 0's weights, whatever the init, as Horovod users
        # expect.
        state = {
            f"{i}.{k}": v for i, m in enumerate(self.modules) for k, v in m.state_dict().items()
        }
        self.hvd.broadcast_parameters(state, root_rank=0)
        if optimizer.state:
            # Only real state (a resumed run): on empty state Horovod initialises it by
            # stepping with zero gradients, which would apply AdamW's weight decay once.
            self.hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def finish_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        started = time.perf_counter()
        optimizer.synchronize()  # waits for the all-reduces the backward hooks started
        self.comm_wait_s += time.perf_counter() - started

    def step(
        self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, local_step: StepFn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The gradients are averaged already (finish_gradients synchronised): the step must
        # not make Horovod synchronise a second time.
        with optimizer.skip_synchronize():
            return local_step()


class ParameterServerEngine(Engine):
    """One parameter server (the dp group's first rank), as ``nn.DataParallel`` does it.

    After the last backward every rank sends its whole gradient, flattened, to the root with
    one reduce; the root averages, unscales, clips and steps; then one broadcast sends every
    parameter back. Nothing overlaps with compute.
    """

    name = "ps"

    def __init__(self, grid: Any) -> None:
        super().__init__(grid)
        self.group = grid.dp_group
        self.root = grid.layout.dp_group(grid.rank)[0]
        self.is_root = grid.dp_rank == 0
        self.params: list[nn.Parameter] = []

    def describe(self) -> str:
        return f"one server (dp rank 0, world rank {self.root}): reduce, step, broadcast"

    @property
    def holds_optimizer_state(self) -> bool:  # type: ignore[override]
        return self.is_root

    def wrap(self, modules: Sequence[nn.Module]) -> list[nn.Module]:
        super().wrap(modules)
        self.params = self.parameters
        # Every replica starts from the server's weights.
        if self.grid.dp > 1:
            _broadcast_parameters(self.params, self.root, self.group)
        return list(modules)

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
            _unflatten(flat, [p.grad for p in self.params])
        self.comm_wait_s += time.perf_counter() - started

    def step(
        self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, local_step: StepFn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.grid.dp == 1:
            return local_step()
        device = self.params[0].device  # nccl moves CUDA tensors only
        result = torch.zeros(3, device=device)  # grad norm, skipped, new loss scale
        if self.is_root:
            norm, skipped = local_step()
            result = torch.stack(
                [
                    norm.to(device=device, dtype=torch.float32),
                    skipped.to(device=device, dtype=torch.float32),
                    torch.tensor(scaler.get_scale() if scaler.is_enabled() else 1.0, device=device),
                ]
            )
        started = time.perf_counter()
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in self.params])
            dist.broadcast(flat, src=self.root, group=self.group)
            dist.broadcast(result, src=self.root, group=self.group)
            if not self.is_root:
                _unflatten(flat, [p.data for p in self.params])
        self.comm_wait_s += time.perf_counter() - started
        if not self.is_root:
            # Only the root stepped; the others drop their (unreduced) gradients and take the
            # root's loss scale so the next backward scales alike.
            optimizer.zero_grad()
            if scaler.is_enabled():
                scaler.update(new_scale=float(result[2]))
        return result[0], result[1] > 0


class DistributedOptimizerEngine(Engine):
    """``ddp`` or ``horovod`` with ``parallel.distributed_optimizer``: gradients reduce-
    scattered in buckets during the backward, each rank stepping its 1/d of the optimizer
    state, parameters all-gathered after the step (:mod:`hpcllm.parallel.distributed_optimizer`).
    """

    reduces_after_model_grads = True

    def __init__(
        self, grid: Any, parallel: ParallelConfig, name: str, param_dtype: str = "fp32"
    ) -> None:
        from hpcllm.parallel import distributed_optimizer as zero

        super().__init__(grid)
        self.name = name
        self.param_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[param_dtype]
        self.bucket_mb = parallel.ddp_bucket_mb
        self.zero: Any = None
        if name == "horovod":
            self.hvd, self.settings = start_horovod(grid, parallel)
            self.collectives: Any = zero.HorovodCollectives(self.hvd)
        else:
            self.collectives = zero.TorchCollectives(grid.dp_group)

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
        # Every replica starts from dp rank 0's weights.
        if self.grid.dp > 1:
            root = self.grid.layout.dp_group(self.grid.rank)[0]
            _broadcast_parameters(self.parameters, root, self.grid.dp_group)
        return list(modules)

    def attach_optimizer(
        self, optimizer: torch.optim.Optimizer, accumulation: int
    ) -> torch.optim.Optimizer:
        from hpcllm.parallel import distributed_optimizer as zero
        from hpcllm.parallel.tensor.layers import is_split

        if not isinstance(optimizer, torch.optim.AdamW):
            raise UserError("parallel.distributed_optimizer shards AdamW's state only")
        groups = [group["params"] for group in optimizer.param_groups]
        chunk_of = {id(p): i for i, m in enumerate(self.modules) for p in m.parameters()}
        late = {
            id(p)
            for g in groups
            for p in g
            if getattr(p, "sequence_parallel", False) or getattr(p, "tied_across_stages", False)
        }
        tp_split = is_split if self.grid.tp > 1 else (lambda p: False)
        self.zero = zero.ZeroState(
            groups,
            chunk_of,
            late,
            self.grid.dp,
            self.grid.dp_rank,
            max(1, int(self.bucket_mb * 1024 * 1024) // 4),
            self.collectives,
            self.grid.dp_group,
            tp_split,
            self.param_dtype,
        )
        return zero.DistributedAdamW(self.zero, optimizer)

    def backward(
        self, chunk: int, outs: list[torch.Tensor], grads: list[torch.Tensor | None], last: bool
    ) -> None:
        if not last:
            torch.autograd.backward(outs, grads)
            return
        self.zero.arm(chunk)
        try:
            torch.autograd.backward(outs, grads)
        finally:
            self.zero.disarm(chunk)

    def finish_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        self.comm_wait_s += self.zero.finish()

    def gradients_for_step(
        self, tp_group: Any, pp_group: Any
    ) -> tuple[list[torch.Tensor], Callable[[], torch.Tensor]] | None:
        return list(self.zero.parts), lambda: self.zero.grad_norm(tp_group, pp_group)

    def step(
        self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, local_step: StepFn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        result = local_step()
        self.comm_wait_s += self.zero.gather_params()
        return result

    def broadcast_state(self, optimizer: torch.optim.Optimizer) -> None:
        # Every replica loaded the same weights (into the buckets the parameters are views
        # of) and each its part of the optimizer state; with 16-bit weights the fp32 masters
        # follow weights that came without them.
        self.zero.sync_masters()


def _broadcast_parameters(params: list[nn.Parameter], root: int, group: Any) -> None:
    """Give every rank of ``group`` the world rank ``root``'s values of ``params``."""
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        dist.broadcast(flat, src=root, group=group)
        _unflatten(flat, [p.data for p in params])


def _unflatten(flat: torch.Tensor, targets: list[torch.Tensor]) -> None:
    offset = 0
    for target in targets:
        n = target.numel()
        target.copy_(flat[offset : offset + n].view_as(target))
        offset += n
