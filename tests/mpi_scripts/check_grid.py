"""Under mpirun: build the grid for each layout given (tp,pp,dp, tp,pp,dp,ep or
tp,pp,dp,ep,cp) and report what
every group holds.

Usage: mpirun -np N python check_grid.py T,P,D [T,P,D ...]

For each layout it prints one JSON line per rank: coordinates, the members of the torch
groups and of the mpi4py communicators, and the result of an all-reduce of (rank + 1) in
each torch group (the embedding group where the rank has one). The pytest side compares all
of it with an independent oracle.
"""

import json
import sys

import torch
import torch.distributed as dist

from hpcllm import topology


def report(tp: int, pp: int, dp: int, ep: int = 1, cp: int = 1) -> dict:
    grid = topology.init(tp=tp, pp=pp, dp=dp, ep=ep, cp=cp)
    out = {
        "layout": [tp, pp, dp] + ([ep] if ep > 1 or cp > 1 else []) + ([cp] if cp > 1 else []),
        "rank": grid.rank,
        "coords": [grid.tp_rank, grid.pp_rank, grid.dp_rank],
        "cp_rank": grid.cp_rank,
        "pp_prev": grid.pp_prev,
        "pp_next": grid.pp_next,
        "torch": {},
        "mpi": {},
        "sum": {},
    }
    for axis in ("tp", "pp", "dp", "mp", "embedding", "ep", "expert_dp", "cp", "dp_cp"):
        group = getattr(grid.groups, axis)
        comm = getattr(grid.groups, f"{axis}_comm")
        if group is None:  # a middle stage, or p = 1: no embedding group; ep = 1: no ep
            assert comm is None, axis
            continue
        out["torch"][axis] = dist.get_process_group_ranks(group)
        # Members in communicator-rank order, to check the Split keys as well as the colours.
        out["mpi"][axis] = comm.allgather(grid.rank)
        value = torch.tensor([float(grid.rank + 1)])
        dist.all_reduce(value, group=group)
        out["sum"][axis] = value.item()
    return out


def main() -> None:
    for spec in sys.argv[1:]:
        print(json.dumps(report(*(int(x) for x in spec.split(",")))), flush=True)
    topology.shutdown()


if __name__ == "__main__":
    main()
