"""``hpcllm bench allreduce``: the transport under the data-parallel engines, measured.

Runs inside each rank of an mpirun job: one gradient-sized buffer all-reduced through mpi4py
(MPI), torch.distributed (gloo or nccl) and Horovod, with nccl-tests' definitions:
algbw = bytes / time, busbw = algbw x 2(n-1)/n.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import numpy as np
import torch

from hpcllm.errors import UserError


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


def bench_allreduce(nbytes: int, iters: int, warmup: int) -> dict[str, Any] | None:
    """All-reduce one float32 buffer of ``nbytes`` via MPI, torch and Horovod; rank 0 gets it."""
    from hpcllm import topology

    grid = topology.init()
    comm = grid.world_comm
    if comm is None:
        raise UserError("hpcllm bench allreduce runs under mpirun with 2 or more ranks")
    n = grid.world_size
    count = nbytes // 4
    results = {}
    # In place everywhere, as the engines reduce gradients: no output buffer to allocate.
    host = np.ones(count, dtype=np.float32)
    from mpi4py import MPI

    results["mpi"] = _time(
        lambda: comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM), iters, warmup, comm.Barrier
    )
    import torch.distributed as dist

    tensor = torch.ones(count, device=grid.device)
    results[f"torch-{grid.backend}"] = _time(
        lambda: dist.all_reduce(tensor), iters, warmup, comm.Barrier
    )
    # Horovod last: its background thread keeps polling once started, and on a machine with
    # as many ranks as cores it would slow the other two measurements.
    os.environ.setdefault("HOROVOD_CPU_OPERATIONS", "MPI")
    import horovod.torch as hvd

    hvd.init(comm=comm)
    hv_tensor = torch.ones(count, device=grid.device)
    results["horovod"] = _time(
        lambda: hvd.allreduce_(hv_tensor, op=hvd.Sum, name="bench"), iters, warmup, comm.Barrier
    )
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
    return {"ranks": n, "bytes": nbytes, "iters": iters, "results": rows}


def render_allreduce(result: dict[str, Any]) -> str:
    """Return the all-reduce micro-benchmark as a small table."""
    lines = [
        f"all-reduce of {result['bytes'] / 1e6:.1f} MB float32 on {result['ranks']} ranks "
        f"(median of {result['iters']}; busbw = algbw x 2(n-1)/n):",
        f"  {'transport':<12} {'time ms':>9} {'algbw GB/s':>11} {'busbw GB/s':>11} {'vs MPI':>7}",
    ]
    for name, r in result["results"].items():
        lines.append(
            f"  {name:<12} {r['seconds'] * 1e3:>9.3f} {r['algbw_GBps']:>11.3f} "
            f"{r['busbw_GBps']:>11.3f} {r['vs_mpi']:>7.2f}"
        )
    return "\n".join(lines)
