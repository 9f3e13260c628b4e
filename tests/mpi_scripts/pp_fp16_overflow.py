"""Under mpirun with 2 ranks (p = 2): an inf gradient on the last stage only, under fp16.

Usage: pp_fp16_overflow.py DATA RUN_DIR SMALL_OVERRIDES_JSON. Prints one JSON line per rank:
which steps it skipped, whether step 2 left its weights unchanged, and its final loss scale.
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
            "parallel.pp=2",
            "model.n_layer=4",
        ],
    )
    before = {}
    trainer = None

    def hook(step, model):
        before[step] = [p.detach().clone() for p in model.parameters()]
        if step == 2 and trainer.grid.pp_rank == 1:
            # ln_f (not the tied embedding copy, whose grads were already summed)
            list(model.parameters())[-1].grad.view(-1)[0] = float("inf")

    trainer = Trainer(cfg, grad_hooks=[hook])
    trainer.run(progress=False)
    after = [p.detach().clone() for p in trainer.model.parameters()]
    before[4] = after
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
