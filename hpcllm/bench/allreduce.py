"""``hpcllm bench allreduce``: the transport under the data-parallel engines, measured.

Runs inside each rank of an mpirun job: one gradient-sized buffer all-reduced through mpi4py
(MPI), torch.distributed (gloo or nccl) and Horovod, and moved as a reduce-scatter plus an
all-gather through torch and Horovod (what the distributed optimizer does), with nccl-tests'
definitions: algbw = bytes / time, busbw = algbw x 2(n-1)/n.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from hpcllm.errors import UserError
from hpcllm.observe import CaseProgress


def _time(fn: Any, iters: int, warmup: int, barrier: Any) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_allreduce(
    nbytes: int, iters: int, warmup: int, progress: bool = True
) -> dict[str, Any] | None:
    """All-reduce one float32 buffer of ``nbytes`` via MPI, torch and Horovod; rank 0 gets it.

    ``progress`` False keeps rank 0 from reporting each transport on stderr (for a caller
    that reports its own progress, as ``bench dp`` does).
    """
    from hpcllm import topology

    grid = topology.init()
    comm = _world_of_two_or_more(grid)
    n = grid.world_size
    count = nbytes // 4
    # Horovod runs with the settings a training run would have (parallel.horovod_* keys
    # reach this process as HOROVOD_* variables; hpcllm's defaults otherwise).
    from hpcllm.config import ParallelConfig
    from hpcllm.parallel.data.horovod import describe_horovod, horovod_settings

    hvd_settings = horovod_settings(ParallelConfig(), os.environ, grid.device.type)
    hvd = _LazyHorovod(grid)
    transports = _transports(grid, comm, count, hvd)
    show = progress and grid.rank == 0
    results = _time_transports(transports, iters, warmup, comm.Barrier, show)
    # Every rank's median; the slowest rank sets the collective's time.
    gathered = comm.gather(results, root=0)
    if grid.rank != 0:
        return None
    return {
        "ranks": n,
        "bytes": nbytes,
        "iters": iters,
        "device": grid.device.type,
        "results": _bandwidth_rows(results, gathered, nbytes, n),
        "horovod": f"{hvd.transport}, {describe_horovod(hvd_settings)}",
    }


def _world_of_two_or_more(grid: Any) -> Any:
    """Return the grid's world communicator; raise UserError outside mpirun or on one rank."""
    comm = grid.groups.world_comm
    if comm is None:
        raise UserError("hpcllm bench allreduce runs under mpirun with 2 or more ranks")
    if grid.world_size < 2:
        raise UserError(
            "hpcllm bench allreduce needs 2 or more ranks: on one rank an all-reduce moves "
            "nothing, so there is nothing to compare"
            + (
                " (this node has one GPU; run it across nodes, or on a node with more GPUs)"
                if grid.device.type == "cuda" and torch.cuda.device_count() < 2
                else ""
            )
        )
    return comm


@dataclass
class _LazyHorovod:
    """Horovod, started only once a transport that needs it has its turn."""

    grid: Any
    transport: str = "MPI"
    module: Any = None

    def get(self) -> Any:
        """Return Horovod, starting it on the first call and noting what carries its tensors."""
        from hpcllm.config import ParallelConfig
        from hpcllm.parallel.data.horovod import horovod_transport, start_horovod

        if self.module is None:
            # As the engines start it: on the grid's dp communicator (the world here, d = n).
            self.module = start_horovod(self.grid, ParallelConfig())[0]
            self.transport = horovod_transport(self.grid, self.module)
        return self.module


def _transports(
    grid: Any, comm: Any, count: int, hvd: _LazyHorovod
) -> dict[str, Callable[[], Callable[[], Any]]]:
    """Return, by name, each transport's setup, which returns one in-place reduction of it."""
    # Each transport is set up only when its turn comes: Horovod's background thread keeps
    # polling once started, and on a machine with as many ranks as cores it would slow the
    # measurements before it. In place everywhere, as the engines reduce gradients.
    return {
        "mpi": partial(_mpi_allreduce, comm, count),
        f"torch-{grid.backend}": partial(_torch_allreduce, grid, count),
        f"torch-{grid.backend} rs+ag": partial(_torch_rs_ag, grid, count),
        "horovod": partial(_horovod_allreduce, grid, count, hvd),
        "horovod rs+ag": partial(_horovod_rs_ag, grid, count, hvd),
    }


def _mpi_allreduce(comm: Any, count: int) -> Callable[[], Any]:
    """Return an MPI all-reduce of ``count`` floats in host memory."""
    from mpi4py import MPI

    host = np.ones(count, dtype=np.float32)
    return lambda: comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)


def _torch_allreduce(grid: Any, count: int) -> Callable[[], Any]:
    """Return a torch.distributed all-reduce of ``count`` floats on the grid's device."""
    import torch.distributed as dist

    tensor = torch.ones(count, device=grid.device)
    return lambda: dist.all_reduce(tensor)


def _horovod_allreduce(grid: Any, count: int, hvd: _LazyHorovod) -> Callable[[], Any]:
    """Return a Horovod all-reduce of ``count`` floats on the grid's device."""
    horovod = hvd.get()
    tensor = torch.ones(count, device=grid.device)
    return lambda: horovod.allreduce_(tensor, op=horovod.Sum, name="bench")


def _torch_rs_ag(grid: Any, count: int) -> Callable[[], Any]:
    """Return a torch reduce-scatter then all-gather of ``count`` floats (padded), in place."""
    # What the distributed optimizer does with the same bytes.
    import torch.distributed as dist

    n = grid.world_size
    padded = -(-count // n) * n
    tensor = torch.ones(padded, device=grid.device)
    part = tensor[grid.rank * (padded // n) : (grid.rank + 1) * (padded // n)]

    def run() -> None:
        dist.reduce_scatter_single(part, tensor)
        dist.all_gather_single(tensor, part)

    return run


def _horovod_rs_ag(grid: Any, count: int, hvd: _LazyHorovod) -> Callable[[], Any]:
    """Return a Horovod reduce-scatter then all-gather of ``count`` floats (padded)."""
    horovod = hvd.get()
    n = grid.world_size
    padded = -(-count // n) * n
    tensor = torch.ones(padded, device=grid.device)
    return lambda: horovod.allgather(
        horovod.reducescatter(tensor, op=horovod.Sum, name="bench.rs"), name="bench.ag"
    )


def _time_transports(
    transports: dict[str, Callable[[], Callable[[], Any]]],
    iters: int,
    warmup: int,
    barrier: Any,
    show: bool,
) -> dict[str, float]:
    """Set up and time each transport in turn; return this rank's median seconds by name."""
    results = {}
    with CaseProgress(len(transports), "hpcllm bench allreduce", show=show) as cases:
        for name, setup in transports.items():
            cases.start(name)
            results[name] = _time(setup(), iters, warmup, barrier)
            cases.done(f"{results[name] * 1e3:.3f} ms on rank 0")
    return results


def _bandwidth_rows(
    results: dict[str, float], gathered: list[dict[str, float]], nbytes: int, n: int
) -> dict[str, dict[str, float]]:
    """Return each transport's slowest-rank time, algbw, busbw and busbw relative to MPI's."""
    rows = {}
    for name in results:
        seconds = max(g[name] for g in gathered)
        algbw = nbytes / seconds / 1e9
        rows[name] = {
            "seconds": seconds,
            "algbw_GBps": algbw,
            "busbw_GBps": algbw * 2 * (n - 1) / n,
        }
    mpi_bus = rows["mpi"]["busbw_GBps"]
    for row in rows.values():
        row["vs_mpi"] = row["busbw_GBps"] / mpi_bus
    return rows


def render_allreduce(result: dict[str, Any]) -> str:
    """Return the all-reduce micro-benchmark as a small table."""
    lines = [
        f"all-reduce of {result['bytes'] / 1e6:.1f} MB float32 on {result['ranks']} ranks "
        f"(median of {result['iters']}; busbw = algbw x 2(n-1)/n):",
        f"  {'transport':<17} {'time ms':>9} {'algbw GB/s':>11} {'busbw GB/s':>11} {'vs MPI':>7}",
    ]
    for name, r in result["results"].items():
        lines.append(
            f"  {name:<17} {r['seconds'] * 1e3:>9.3f} {r['algbw_GBps']:>11.3f} "
            f"{r['busbw_GBps']:>11.3f} {r['vs_mpi']:>7.2f}"
        )
    lines.append(
        "  rs+ag: a reduce-scatter then an all-gather of the same bytes, as the distributed "
        "optimizer moves them (a ring all-reduce's traffic)"
    )
    if result.get("device") == "cuda":
        lines.append("  mpi: host memory (a reference); torch and Horovod: the GPUs' memory")
    if result.get("horovod"):
        lines.append(f"  horovod: {result['horovod']}")
    return "\n".join(lines)
