"""Under mpirun with 2 ranks, fp16: an inf gradient on one rank only, at step 2.

Usage: fp16_overflow.py MODE DATA RUN_DIR SMALL_OVERRIDES_JSON, MODE one of

- ``pp``: p = 2, the inf in the last stage's ln_f gradient (not the tied embedding's copy,
  whose gradients were already summed);
- ``zero``: d = 2 with the distributed optimizer, the inf in dp rank 1's part of the reduced
  gradient, which no other rank sees (the first of the optimizer's ``main_grads()``: the
  gradients its step reads, whatever the engine).

Prints one JSON line per rank: how many steps it skipped, whether step 2 left its weights
unchanged, whether later steps moved them, and its final loss scale.
"""

import json
import sys

import torch

from hpcllm.config import load_config
from hpcllm.train.trainer import Trainer

LAYOUTS = {
    "pp": ["parallel.pp=2", "model.n_layer=4"],
    "zero": ["parallel.distributed_optimizer=true"],
}


def inject(trainer: Trainer, mode: str, model: torch.nn.Module, optimizer) -> None:
    if mode == "pp" and trainer.grid.pp_rank == 1:
        list(model.parameters())[-1].grad.view(-1)[0] = float("inf")
    if mode == "zero" and trainer.grid.dp_rank == 1:
        optimizer.main_grads()[0].view(-1)[0] = float("inf")


def main() -> None:
    mode, data, run, small = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    cfg = load_config(
        None,
        [
            *small,
            f"data.path={data}",
            f"run.dir={run}",
            "train.steps=4",
            "train.precision=fp16",
            "train.eval_interval=0",
            *LAYOUTS[mode],
        ],
    )
    before = {}
    trainer = None

    def hook(step, model, optimizer):
        before[step] = [p.detach().clone() for p in model.parameters()]
        if step == 2:
            inject(trainer, mode, model, optimizer)

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
