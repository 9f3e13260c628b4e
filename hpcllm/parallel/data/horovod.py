"""``parallel.dp_engine: horovod``: Horovod's ring all-reduce, and Horovod's settings.

Horovod starts on the grid's data-parallel MPI communicator, so each model shard (t·p > 1)
has its own Horovod world. Its gradient hooks all-reduce each parameter once it has
accumulated a step's backwards (tensor fusion batches them); :meth:`HorovodEngine.
reduce_grads` waits for them, and the optimizer then steps without synchronising a second
time. At ep > 1 the experts differ by rank: Horovod's optimizer is not used, the dense gradients
are averaged over d and the experts' over their expert-dp process set after the backward, and
the MoE layers send tokens with Horovod's ``alltoall`` on the ep process set (both sets declared
when Horovod starts). The ``parallel.horovod_*`` keys, the ``HOROVOD_*`` variables and
hpcllm's tuned defaults resolve here (:func:`horovod_settings`), for the engine, the
distributed optimizer's Horovod collectives, local SGD's averaging and ``bench dp``/``bench
collectives``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

from hpcllm import watchdog
from hpcllm.config import ParallelConfig
from hpcllm.errors import UserError
from hpcllm.parallel.data.engine import Engine
from hpcllm.parallel.data.experts import ALL_TO_ALL, AllToAll, is_expert
from hpcllm.parallel.data.optimizer import MixedPrecisionOptimizer
from hpcllm.topology import Grid


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
# all-reduce sweeps (docs/benchmarks.md, "Horovod's settings"). On CPU ranks the
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


def start_horovod(grid: Grid, parallel: ParallelConfig | None) -> tuple[Any, dict[str, Any]]:
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
    if grid.groups.dp_comm is None:
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
    sets = expert_process_sets(hvd, grid) if grid.ep > 1 and not hvd.is_initialized() else []
    if sets:
        hvd.init(comm=grid.groups.dp_comm, process_sets=sets)
    else:
        hvd.init(comm=grid.groups.dp_comm)
    _DECLARED.update({tuple(ps.ranks): ps for ps in sets})
    if hvd.size() != grid.dp:
        raise UserError(
            f"Horovod sees {hvd.size()} ranks in the data-parallel group, "
            f"the grid has d = {grid.dp}"
        )
    return hvd, settings


def expert_sets(dp: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """Return the Horovod ranks (the dp ranks) of every expert-parallel group and every
    expert-data-parallel group of a d = ``dp`` world with ``ep`` ranks splitting the experts,
    leaving out what Horovod has already (the whole world) or needs not (one rank)."""
    if ep == 1:
        return [], []
    ep_sets = [[g * ep + e for e in range(ep)] for g in range(dp // ep)]
    edp_sets = [[e + ep * g for g in range(dp // ep)] for e in range(ep)]
    keep = lambda sets: [s for s in sets if 1 < len(s) < dp]  # noqa: E731
    return keep(ep_sets), keep(edp_sets)


# The process sets this process declared to Horovod, by their ranks: hvd.init declares them
# once, and a later init in the same process (several runs in one launch) declares none.
_DECLARED: dict[tuple[int, ...], Any] = {}


def expert_process_sets(hvd: Any, grid: Grid) -> list[Any]:
    """Return the process sets expert parallelism needs (:func:`expert_sets`), declared to
    ``hvd.init`` by every rank alike; none at ep = 1."""
    ep_sets, edp_sets = expert_sets(grid.dp, grid.ep)
    return [hvd.ProcessSet(ranks) for ranks in (*ep_sets, *edp_sets)]


def process_set(hvd: Any, ranks: list[int]) -> Any:
    """Return the process set of ``ranks`` (Horovod ranks): the global set for the whole world,
    None for one rank, else the one declared when Horovod started."""
    if len(ranks) == 1:
        return None
    if len(ranks) == hvd.size():
        return hvd.global_process_set
    found = _DECLARED.get(tuple(ranks))
    if found is None:
        raise UserError(
            f"Horovod was started in this process without a process set of ranks {ranks}; "
            "expert parallelism under horovod needs its own launch"
        )
    return found


def expert_process_sets_of(hvd: Any, grid: Grid) -> tuple[Any, Any]:
    """Return (ep set, expert-dp set) of this rank at ep > 1 (:func:`process_set`'s; None
    for a group of one rank), or (None, None) at ep = 1. Horovod ranks are dp ranks."""
    if grid.ep == 1:
        return None, None
    layout = grid.layout
    dp_rank = lambda world: layout.coords(world)[2]  # noqa: E731
    ep_set = process_set(hvd, [dp_rank(r) for r in layout.ep_group(grid.rank)])
    edp_set = process_set(hvd, [dp_rank(r) for r in layout.expert_dp_group(grid.rank)])
    return ep_set, edp_set


def horovod_all_to_all(hvd: Any, ep_set: Any) -> AllToAll:
    """Return Horovod's all-to-all over the ep process set ``ep_set``."""

    def run(x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        if x.dtype == torch.bfloat16:
            # Horovod 0.28 moves no bf16: the same bits as int16, which it does.
            return run(x.view(torch.int16), send, recv).view(torch.bfloat16)
        splits = torch.tensor(send, dtype=torch.int32)
        with watchdog.waiting(ALL_TO_ALL, axis="ep"):
            out, _ = hvd.alltoall(x, splits=splits, process_set=ep_set)
        return out

    return run


def horovod_transport(grid: Grid, hvd: Any) -> str:
    """Return what carries Horovod's collectives of this grid's tensors."""
    return "NCCL" if grid.device.type == "cuda" and hvd.nccl_built() else "MPI"


class HorovodOptimizer(MixedPrecisionOptimizer):
    """The step over Horovod's ``DistributedOptimizer``: the gradients are averaged already
    (the engine's :meth:`~HorovodEngine.reduce_grads` synchronised), so the step must not make
    Horovod synchronise a second time."""

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        with self.inner.skip_synchronize():  # type: ignore[attr-defined]
            return super().step()


class HorovodEngine(Engine):
    """Horovod ring all-reduce, initialised on the data-parallel MPI communicator."""

    name = "horovod"

    def __init__(
        self,
        grid: Grid,
        parallel: ParallelConfig | None = None,
        compression: str = "none",
    ) -> None:
        super().__init__(grid)
        self.hvd, self.settings = start_horovod(grid, parallel)
        hvd = self.hvd
        # fp16 or none: config.check refuses bf16, which Horovod does not compress to.
        self.compression = hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none
        self.compression_name = compression
        # At ep > 1: the process sets of this rank's ep and expert-dp groups (Horovod ranks
        # are dp ranks).
        self.ep_set, self.expert_dp_set = expert_process_sets_of(hvd, grid)

    def all_to_all(self) -> AllToAll:
        """Return Horovod's all-to-all over this rank's ep process set."""
        return horovod_all_to_all(self.hvd, self.ep_set)

    def describe(self) -> str:
        mpi = describe_mpi(self.grid.device.type == "cuda")
        return (
            f"{horovod_transport(self.grid, self.hvd)}, {describe_horovod(self.settings)}, "
            f"compression {self.compression_name}" + (f", {mpi}" if mpi else "")
        )

    def build_optimizer(
        self,
        inner: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        clip: float,
        accumulation: int,
    ) -> MixedPrecisionOptimizer:
        if self.grid.ep > 1:
            # Horovod's optimizer averages every parameter over its world; the experts differ
            # by ep rank, so reduce_grads reduces the two kinds apart, after the backward.
            self.optimizer = MixedPrecisionOptimizer(
                inner, scaler, clip, self.grid.groups, self.parameters
            )
            return self.optimizer
        # Horovod's optimizer is a new object of the same class and groups: checkpointed state
        # loads into it. Its gradient hooks all-reduce each parameter once it has accumulated
        # ``accumulation`` backward passes.
        distributed = self.hvd.DistributedOptimizer(
            inner,
            named_parameters=self.named_parameters(),
            backward_passes_per_step=accumulation,
            compression=self.compression,
            op=self.hvd.Average,
        )
        self.optimizer = HorovodOptimizer(
            distributed, scaler, clip, self.grid.groups, self.parameters
        )
        return self.optimizer

    def broadcast_state(self) -> None:
        if self.grid.ep > 1:
            # Every rank loaded its own experts and their state: the dense weights come from
            # dp rank 0, the experts from the first rank holding them; the optimizer state
            # each rank read stays.
            self._broadcast_by_kind()
            return
        # Every replica starts from rank 0's weights, whatever the init, as Horovod users
        # expect.
        state = {
            f"{i}.{k}": v for i, m in enumerate(self.modules) for k, v in m.state_dict().items()
        }
        self.hvd.broadcast_parameters(state, root_rank=0)
        assert self.optimizer is not None
        if self.optimizer.state:
            # Only real state (a resumed run): on empty state Horovod initialises it by
            # stepping with zero gradients, which would apply AdamW's weight decay once.
            self.hvd.broadcast_optimizer_state(self.optimizer.inner, root_rank=0)

    def _broadcast_by_kind(self) -> None:
        hvd, layout, rank = self.hvd, self.grid.layout, self.grid.rank
        for name, p in self.named_parameters():
            if is_expert(p):
                if self.expert_dp_set is None:
                    continue
                root = layout.coords(layout.expert_dp_group(rank)[0])[2]
                hvd.broadcast_(p.data, root, name=f"experts.{name}", process_set=self.expert_dp_set)
            else:
                hvd.broadcast_(p.data, 0, name=name)

    def reduce_grads(self) -> None:
        assert self.optimizer is not None
        started = time.perf_counter()
        if self.grid.ep > 1:
            self._reduce_by_kind()
        else:
            self.optimizer.inner.synchronize()  # type: ignore[attr-defined]
        self.comm_wait_s += time.perf_counter() - started

    def _reduce_by_kind(self) -> None:
        """Average the dense gradients over d and the experts' over their expert-dp set
        (divided by d: :mod:`hpcllm.parallel.data.experts`), in one grouped all-reduce each."""
        hvd = self.hvd
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        for _, p in named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        dense = [(n, p) for n, p in named if not is_expert(p)]
        experts = [(n, p) for n, p in named if is_expert(p)]
        for kind, group, op, ps in (
            ("dense", dense, hvd.Average, hvd.global_process_set),
            ("experts", experts, hvd.Sum, self.expert_dp_set),
        ):
            if not group:
                continue
            grads = [p.grad for _, p in group]
            if ps is not None:
                packed = [self.compression.compress(g) for g in grads]
                reduced = hvd.grouped_allreduce(
                    [t for t, _ in packed], name=f"grads.{kind}", op=op, process_set=ps
                )
                for g, r, (_, ctx) in zip(grads, reduced, packed, strict=True):
                    g.copy_(self.compression.decompress(r, ctx))
            if kind == "experts":
                torch._foreach_div_(grads, self.grid.dp)
