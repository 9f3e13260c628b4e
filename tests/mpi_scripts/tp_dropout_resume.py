"""Under mpirun with 2 ranks, t = 2, dropout 0.1: a resumed run against an uninterrupted one.

Usage: tp_dropout_resume.py DATA RUN_DIR SMALL_OVERRIDES_JSON

Trains 3 steps in one go, then 2 steps and (a new trainer, resuming) up to 3, all in one
launch. Prints one JSON line per rank: each run's loss and gradient norm by step.
"""

import json
import sys
from pathlib import Path

from hpcllm.config import load_config
from hpcllm.observe import read_metrics
from hpcllm.train.trainer import Trainer


def train(data: str, run: Path, steps: int, small: list[str]) -> None:
    cfg = load_config(
        None,
        [
            *small,
            "model.dropout=0.1",
            "parallel.tp=2",
            f"data.path={data}",
            f"run.dir={run}",
            f"train.steps={steps}",
            "train.lr_decay_steps=3",
            "train.eval_interval=0",
        ],
    )
    with Trainer(cfg) as trainer:
        trainer.run(progress=False)


def main() -> None:
    data, run, small = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    train(data, run / "whole", 3, small)
    train(data, run / "split", 2, small)
    train(data, run / "split", 3, small)
    out = {
        name: {r["step"]: [r["loss"], r["grad_norm"]] for r in read_metrics(run / name)}
        for name in ("whole", "split")
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
