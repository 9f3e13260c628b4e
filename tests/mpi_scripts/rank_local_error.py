"""Under mpirun: rank 1 meets an error only it can see while the others wait in a barrier.

The job must end (aborted, non-zero) rather than hang.
"""

from hpcllm import topology
from hpcllm.errors import UserError, run_reporting_errors


def main() -> None:
    grid = topology.init()
    if grid.rank == 1:
        raise UserError("shard data/train-0001.h5 is missing on this node", same_on_all_ranks=False)
    grid.groups.world_comm.Barrier()


if __name__ == "__main__":
    raise SystemExit(run_reporting_errors(main))
