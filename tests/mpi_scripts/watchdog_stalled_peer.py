"""Under mpirun with 2 ranks: rank 1 stops itself (SIGSTOP) before rank 0 must wait for it.

``argv[1]`` is what rank 0 then waits in: ``allreduce``, a gradient all-reduce inside a
watchdog phase, or ``pipeline``, a 1F1B step of two stages inside a step's phase, where the
runtime marks its receives. Timeout ``argv[2]`` s, report folder ``argv[3]``. Rank 0 prints
when it entered; the watchdog must abort the job, naming the phase. The process group keeps
torch's 30-minute default, so only the watchdog can end the job in time.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hpcllm import topology, watchdog
from hpcllm.bench.pipeline import SleepWork
from hpcllm.parallel.pipeline.runtime import Channel, Runtime
from hpcllm.parallel.pipeline.schedule import rank_actions


def main() -> None:
    mode, timeout_s, report = sys.argv[1], float(sys.argv[2]), Path(sys.argv[3])
    grid = topology.init(pp=2 if mode == "pipeline" else 1)
    watchdog.start(timeout_s, grid.rank, report)
    grid.groups.world_comm.Barrier()
    if grid.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    print(f"entered at {time.time()}", flush=True)
    if mode == "allreduce":
        with watchdog.waiting("gradient all-reduce", axis="dp", step=12):
            dist.all_reduce(torch.ones(4))
    else:
        first, last = (0, None) if grid.pp_rank == 0 else (None, 0)
        work = SleepWork(0.0, 0.0, 0.0, 1, last_chunk=last, first_chunk=first)
        channel = Channel(grid.pp_prev, grid.pp_next, (256,), torch.float32, grid.device)
        with watchdog.waiting("pipeline schedule", step=1):
            Runtime(channel).run(rank_actions("1f1b", 2, grid.pp_rank, 2), work)
    print("rank 0 went on", flush=True)


if __name__ == "__main__":
    main()
