"""Under mpirun: a run trained in one go against the same run stopped halfway and resumed.

Usage: resume_in_one_launch.py DATA RUN_DIR STEPS OVERRIDES_JSON

Trains STEPS steps in one go (RUN_DIR/whole), then STEPS / 2 and (a new trainer, resuming)
up to STEPS (RUN_DIR/split), all in one launch: what separate ``hpcllm train`` commands would
do, without paying the launch three times. Rank 0 prints one JSON line: each run's metrics
records.
"""

import json
import sys
from pathlib import Path

from hpcllm.config import load_config
from hpcllm.observe import read_metrics
from hpcllm.train.trainer import Trainer


def train(data: str, run: Path, steps: int, overrides: list[str]) -> None:
    sets = [*overrides, f"data.path={data}", f"run.dir={run}", f"train.steps={steps}"]
    with Trainer(load_config(None, sets)) as trainer:
        trainer.run(progress=False)


def main() -> None:
    data, run, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    overrides = json.loads(sys.argv[4])
    train(data, run / "whole", steps, overrides)
    train(data, run / "split", steps // 2, overrides)
    train(data, run / "split", steps, overrides)
    print(json.dumps({name: read_metrics(run / name) for name in ("whole", "split")}), flush=True)


if __name__ == "__main__":
    main()
