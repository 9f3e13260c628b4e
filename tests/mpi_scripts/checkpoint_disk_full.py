"""Under mpirun -np 2 (t = 2): rank 1's disk fills up while it writes its checkpoint shard.

Both ranks must learn of it in the same save, raise the same one-line error and go on to the
next collective together; rank 0 removes the partial folder and the earlier checkpoint stays
the one to resume from. Prints ``agreed: MESSAGE`` and ``resume: FOLDER`` on every rank.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for full_disk
from full_disk import open_on_full_disk  # noqa: E402

from hpcllm import topology
from hpcllm.errors import UserError
from hpcllm.train import checkpoint


def main(run_dir: Path) -> None:
    grid = topology.init(tp=2)
    shard = {"w": torch.full((4,), float(grid.rank))}
    checkpoint.save(run_dir, 1, grid, shard, {}, "{}\n")
    if grid.rank == 1:
        real_open = open

        def open_full(path, mode="r", *args, **kwargs):
            if "w" in mode:
                return open_on_full_disk(path, mode, *args, **kwargs)
            return real_open(path, mode, *args, **kwargs)

        checkpoint.write.open = open_full  # where the checkpoint's files are opened
    try:
        checkpoint.save(run_dir, 2, grid, shard, {}, "{}\n")
    except UserError as err:
        print(f"agreed: {err}", flush=True)
    grid.groups.world_comm.Barrier()
    folder = checkpoint.agreed_resumable(run_dir, grid, lambda m: print(f"warn: {m}"))
    print(f"resume: {folder.name}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
