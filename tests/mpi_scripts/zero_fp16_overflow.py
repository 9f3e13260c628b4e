"""Under mpirun (d ranks, distributed optimizer, fp16): an inf gradient on dp rank 1 only.

Usage: zero_fp16_overflow.py DATA RUN_DIR SMALL_OVERRIDES_JSON [KEY=VALUE ...]. Prints one JSON
line per rank: how many steps it skipped, whether step 2 left its weights unchanged, whether
later steps moved them, and its final loss scale.
"""

import json
import sys

import torch

from hpcllm.config import load_config
from hpcllm.train.trainer import Trainer


def main() -> None:
    data, run, small = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    cfg = load_config(
        None,
        [
            *small,
            f"data.path={data}",
            f"run.dir={run}",
            "train.steps=4",
            "train.precision=fp16",
            "train.eval_interval=0",
            "parallel.distributed_optimizer=true",
            *sys.argv[4:],
        ],
    )
    before = {}
    trainer = None

    def hook(step, model):
        before[step] = [p.detach().clone() for p in model.parameters()]
        if step == 2 and trainer.grid.dp_rank == 1:
            # This rank's part of the reduced gradient: no other rank sees the inf.
            trainer.engine.zero.parts[0].grad.view(-1)[0] = float("inf")

    trainer = Trainer(cfg, grad_hooks=[hook])
    trainer.run(progress=False)
    before[4] = [p.detach().clone() for p in trainer.model.parameters()]
    unchanged = all(torch.equal(a, b) for a, b in zip(before[2], before[3], strict=True))
    moved = not all(torch.equal(a, b) for a, b in zip(before[3], before[4], strict=True))
    print(
        json.dumps(
            {
                "rank": trainer.grid.rank,
                "skipped_steps": trainer.skipped_steps,
                "step2_unchanged": unchanged,
                "moved_after": moved,
                "scale": trainer.scaler.get_scale(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
