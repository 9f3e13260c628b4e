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
    comm = grid.groups.world_comm
    if comm is None:
        raise UserError("hpcllm bench allreduce runs under mpirun with 2 or more ranks")
    n = grid.world_size
    if n < 2:
        raise UserError(
            "hpcllm bench allreduce needs 2 or more ranks: on one rank an all-reduce moves "
            "nothing, so there is nothing to compare"
            + (
                " (this node has one GPU; run it across nodes, or on a node with more GPUs)"
                if grid.device.type == "cuda" and torch.cuda.device_count() < 2
                else ""
            )
        )
    count = nbytes // 4
    # Horovod runs with the settings a training run would have (parallel.horovod_* keys
    # reach this process as HOROVOD_* variables; hpcllm's defaults otherwise).
    from hpcllm.config import ParallelConfig
    from hpcllm.parallel.data.horovod import (
        describe_horovod,
        horovod_settings,
        horovod_transport,
        start_horovod,
    )

    hvd_settings = horovod_settings(ParallelConfig(), os.environ, grid.device.type)
    hvd_transport = "MPI"
    started: list[Any] = []  # Horovod, once a transport that needs it has started it

    def hvd_started() -> Any:
        # As the engines start it: on the grid's dp communicator (the world here, d = n).
        nonlocal hvd_transport
        if not started:
            started.append(start_horovod(grid, ParallelConfig())[0])
            hvd_transport = horovod_transport(grid, started[0])
        return started[0]

    # Each transport is set up only when its turn comes: Horovod's background thread keeps
    # polling once started, and on a machine with as many ranks as cores it would slow the
    # measurements before it. In place everywhere, as the engines reduce gradients.
    def mpi() -> Callable[[], Any]:
        from mpi4py import MPI

        host = np.ones(count, dtype=np.float32)
        return lambda: comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)

    def torch_distributed() -> Callable[[], Any]:
        import torch.distributed as dist

        tensor = torch.ones(count, device=grid.device)
        return lambda: dist.all_reduce(tensor)

    def horovod() -> Callable[[], Any]:
        hvd = hvd_started()
        tensor = torch.ones(count, device=grid.device)
        return lambda: hvd.allreduce_(tensor, op=hvd.Sum, name="bench")

    def torch_rs_ag() -> Callable[[], Any]:
        # What the distributed optimizer does with the same bytes: reduce-scatter, then
        # all-gather, in place.
        import torch.distributed as dist

        padded = -(-count // n) * n
        tensor = torch.ones(padded, device=grid.device)
        part = tensor[grid.rank * (padded // n) : (grid.rank + 1) * (padded // n)]

        def run() -> None:
            dist.reduce_scatter_single(part, tensor)
            dist.all_gather_single(tensor, part)

        return run

    def horovod_rs_ag() -> Callable[[], Any]:
        hvd = hvd_started()
        padded = -(-count // n) * n
        tensor = torch.ones(padded, device=grid.device)
        return lambda: hvd.allgather(
            hvd.reducescatter(tensor, op=hvd.Sum, name="bench.rs"), name="bench.ag"
        )

    transports = {
        "mpi": mpi,
        f"torch-{grid.backend}": torch_distributed,
        f"torch-{grid.backend} rs+ag": torch_rs_ag,
        "horovod": horovod,
        "horovod rs+ag": horovod_rs_ag,
    }
    results = {}
    show = progress and grid.rank == 0
    with CaseProgress(len(transports), "hpcllm bench allreduce", show=show) as cases:
        for name, setup in transports.items():
            cases.start(name)
            results[name] = _time(setup(), iters, warmup, comm.Barrier)
            cases.done(f"{results[name] * 1e3:.3f} ms on rank 0")
    # Every rank's median; the slowest rank sets the collective's time.
    gathered = comm.gather(results, root=0)
    if grid.rank != 0:
        return None
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
    return {
        "ranks": n,
        "bytes": nbytes,
        "iters": iters,
        "device": grid.device.type,
        "results": rows,
        "horovod": f"{hvd_transport}, {describe_horovod(hvd_settings)}",
    }


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
