"""Under mpirun with 2 ranks: rank 0 ends while a Gloo all-reduce with a Python callback chained
on its future (as DDP's communication hooks chain them) is still in flight.

Rank 0 starts the all-reduce, drops it and returns at once, leaving an object whose
``__del__`` holds a finalising interpreter for 5 s; rank 1 joins the all-reduce 1 s later.
So rank 0's Gloo worker thread reaches the callback while a process that ends through the
interpreter's finalisation is finalising. Rank 0 prints ``returned`` as it returns.
"""

import time

import torch
import torch.distributed as dist

from hpcllm import topology


class SlowFinalisation:
    """Held by the module: a finalising interpreter clears it, and waits."""

    def __del__(self) -> None:
        time.sleep(5)


def main() -> None:
    grid = topology.init(timeout_s=60)
    if grid.rank == 0:
        work = dist.all_reduce(torch.ones(8), async_op=True)
        work.get_future().then(lambda done: done.value())
        globals()["held"] = SlowFinalisation()
        print("returned", flush=True)
    else:
        time.sleep(1)
        dist.all_reduce(torch.ones(8))


if __name__ == "__main__":
    main()
