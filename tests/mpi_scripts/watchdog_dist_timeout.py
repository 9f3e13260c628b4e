"""Under mpirun with 2 ranks: ``topology.init(timeout_s=...)`` bounds a gloo all-reduce.

Rank 1 stays away for ``argv[2]`` s; rank 0's all-reduces, on the world group and on a grid
group, with the timeout ``argv[1]`` s and no watchdog, must raise before then. Rank 0 prints
how long each waited. With ``argv[3]``, init gives the groups that (longer) timeout and
``topology.set_timeout`` gives them ``argv[1]`` s before the all-reduces, as the trainer does
after its first step.
"""

import json
import sys
import time

import torch
import torch.distributed as dist

from hpcllm import topology


def main() -> None:
    timeout_s, away_s = float(sys.argv[1]), float(sys.argv[2])
    if len(sys.argv) > 3:
        grid = topology.init(timeout_s=float(sys.argv[3]))
        topology.set_timeout(grid, timeout_s)
        assert grid.timeout_s == timeout_s
    else:
        grid = topology.init(timeout_s=timeout_s)
    grid.groups.world_comm.Barrier()
    if grid.rank == 0:
        # The world group, and one made by new_group, which does not inherit its timeout.
        for name, group in (("world", None), ("dp", grid.groups.dp)):
            started = time.monotonic()
            try:
                dist.all_reduce(torch.ones(4), group=group)
                error = None
            except RuntimeError as err:
                error = str(err)
            waited = time.monotonic() - started
            print(json.dumps({"group": name, "waited_s": waited, "error": error}), flush=True)
    else:
        time.sleep(away_s)
    grid.groups.world_comm.Barrier()


if __name__ == "__main__":
    main()
