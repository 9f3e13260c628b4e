"""Under mpirun -np 2: a blended run in one go against the same run stopped and resumed, at d = 2
and, re-cut, at t = 2 (d = 1).

Usage: blend_resume.py RUN_DIR STEPS OVERRIDES_JSON

Trains STEPS steps at d = 2 in one go (RUN_DIR/whole); STEPS / 2 (RUN_DIR/split), which rank 0
then copies to RUN_DIR/half, and on to STEPS; and RUN_DIR/half on to STEPS at t = 2 with
run.reshard (RUN_DIR/recut), all in one launch. The caller resumes RUN_DIR/half at d = 1 itself.
Rank 0 prints one JSON line: each run's metrics records.
"""

import json
import shutil
import sys
from pathlib import Path

from mpi4py import MPI

from hpcllm.config import load_config
from hpcllm.observe import read_metrics
from hpcllm.train.trainer import Trainer


def train(run: Path, steps: int, overrides: list[str], *extra: str) -> None:
    sets = [*overrides, f"run.dir={run}", f"train.steps={steps}", *extra]
    with Trainer(load_config(None, sets)) as trainer:
        trainer.run(progress=False)


def main() -> None:
    run, steps, overrides = Path(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    train(run / "whole", steps, overrides)
    train(run / "split", steps // 2, overrides)
    if MPI.COMM_WORLD.rank == 0:
        shutil.copytree(run / "split", run / "half")
        shutil.copytree(run / "split", run / "recut")
    MPI.COMM_WORLD.Barrier()
    train(run / "split", steps, overrides)
    train(run / "recut", steps, overrides, "parallel.tp=2", "run.reshard=true")
    if MPI.COMM_WORLD.rank == 0:
        names = ("whole", "split", "recut")
        print(json.dumps({name: read_metrics(run / name) for name in names}), flush=True)


if __name__ == "__main__":
    main()
