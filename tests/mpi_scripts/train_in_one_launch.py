"""Under mpirun: several short training runs, one after another, in one launch.

Usage: train_in_one_launch.py DATA RUN_DIR RUNS_JSON

RUNS_JSON maps a run's name to its config overrides; each trains in RUN_DIR/NAME, as
``hpcllm train --set ...`` would, without paying a launch per run. Rank 0 prints one JSON
line: each run's metrics records and summary (``{"records": [...], "summary": {...}}``).
"""

import json
import sys
from pathlib import Path

from hpcllm.config import load_config
from hpcllm.observe import read_metrics
from hpcllm.train.trainer import Trainer


def main() -> None:
    data, run = sys.argv[1], Path(sys.argv[2])
    runs = json.loads(sys.argv[3])
    done = {}
    for name, overrides in runs.items():
        # The overrides come after DATA, so a run may read other data.
        sets = [f"data.path={data}", *overrides, f"run.dir={run / name}"]
        with Trainer(load_config(None, sets)) as trainer:
            summary = trainer.run(progress=False)
        done[name] = {"records": read_metrics(run / name), "summary": summary}
    print(json.dumps(done), flush=True)


if __name__ == "__main__":
    main()
