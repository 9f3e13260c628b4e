"""Under mpirun: the ps-async and local-sgd engines on known batches, their weights saved.

Usage: mpirun -np D python async_equivalence.py OUT_DIR MODE

MODE k0: the ps engine and ps-async at max_staleness 0, 3 steps each, with SGD and AdamW;
saves ``{ps,k0}-{sgd,adamw}-rank{R}.pt``.
MODE rr: ps-async at max_staleness 1 and 2 with the round-robin order, a segment of 2 steps
then one of 1, AdamW with an LR that changes each step; saves ``rr-k{K}-rank{R}.pt`` holding
the weights and both segments' stats; then at max_staleness 1 one segment of 2 steps in
which worker 1's first gradient is NaN (``rr-nan-rank{R}.pt``), and one in which every
worker's second gradient is (``rr-nan-step-rank{R}.pt``).
MODE local: local-sgd with AdamW at H = 1, H = 4 and H = 4 averaging the moments too, by ddp
(torch) and at H = 4 by Horovod, 8 steps; and SGD without clipping at H = 1 beside the ddp
engine, 3 steps; saves ``local-{case}-rank{R}.pt``.

Worker (dp rank) i's k-th gradient is always on slice i of ``global_batch(k, MICRO * d)``;
the pytest side replays the same algorithm in one process.
"""

import sys
from pathlib import Path

import torch
from dp_equivalence import MICRO, VOCAB, global_batch, make_optimizer, model_config

from hpcllm import topology
from hpcllm.config import load_config
from hpcllm.model.gpt import GPT
from hpcllm.parallel.data.builder import build_engine
from hpcllm.train.optim import build_scaler

CLIP = 1.0


def rr_lr(step: int) -> float:
    return 1e-2 * (step + 1) / 4


def my_batch(grid, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, labels = global_batch(k, MICRO * grid.dp)
    mine = slice(grid.dp_rank * MICRO, (grid.dp_rank + 1) * MICRO)
    return ids[mine], labels[mine]


def setup(grid, engine_name: str, kind: str, sets: list[str], clip: float = CLIP):
    parallel = load_config(None, sets).parallel
    model = GPT(model_config(), VOCAB, seed=7)
    optimizer = make_optimizer(kind, model, "fp32")
    engine = build_engine(engine_name, grid, parallel)
    (module,) = engine.wrap([model])
    optimizer = engine.build_optimizer(optimizer, build_scaler("fp32", grid.device), clip, 1)
    engine.broadcast_state()
    return model, module, optimizer, engine


def sync_steps(grid, engine_name, kind, sets, steps, clip=CLIP) -> torch.nn.Module:
    """The trainer's step for engines that step one at a time."""
    model, module, optimizer, engine = setup(grid, engine_name, kind, sets, clip)
    for k in range(steps):
        ids, labels = my_batch(grid, k)
        with engine.forward_context(0):
            loss = module(ids, labels)
        engine.backward(0, [loss], [None], True)
        engine.finalize_grads()
        optimizer.step()
        optimizer.zero_grad()
    return model


class Worker:
    """One rank's side of a ps-async segment: known batches, an optional poisoned gradient."""

    def __init__(self, grid, model, module, lr_of_step, poison) -> None:
        self.grid, self.model, self.module = grid, model, module
        self.lr_of_step, self.poison = lr_of_step, poison
        self.count = 0

    def local_gradient(self):
        for p in self.model.parameters():
            p.grad = None
        ids, labels = my_batch(self.grid, self.count)
        self.count += 1
        loss = self.module(ids, labels)
        loss.backward()
        if self.poison is not None and self.poison(self.grid.dp_rank, self.count - 1):
            next(self.model.parameters()).grad.view(-1)[0] = float("nan")  # not finite
        return loss.detach(), 0.0, 0.0

    def lr(self, step: int) -> float:
        return self.lr_of_step(step)


def segments(grid, kind, sets, lengths, lr_of_step, poison=None) -> tuple[torch.nn.Module, list]:
    model, module, optimizer, engine = setup(grid, "ps-async", kind, sets)
    worker = Worker(grid, model, module, lr_of_step, poison)
    stats, done = [], 0
    for n in lengths:
        s = engine.run_segment(done, n, worker)
        extra = {"skipped_steps": s.skipped_steps, "bad_steps_in_a_row": s.bad_steps_in_a_row}
        stats.append(s.metrics() | {"loss": s.loss} | extra)
        done += n
    return model, stats


def save(model, path: Path, **extra) -> None:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save({"weights": state, **extra}, path)


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    grid = topology.init()
    rank = grid.rank
    if mode == "k0":
        for kind in ("sgd", "adamw"):
            save(sync_steps(grid, "ps", kind, [], 3), out / f"ps-{kind}-rank{rank}.pt")
            lr = 0.1 if kind == "sgd" else 1e-2  # make_optimizer's, which ps keeps
            model, _ = segments(
                grid, kind, ["parallel.max_staleness=0"], [3], lambda step, lr=lr: lr
            )
            save(model, out / f"k0-{kind}-rank{rank}.pt")
    elif mode == "rr":
        for k in (1, 2):
            sets = [f"parallel.max_staleness={k}", "parallel.ps_async_order=round-robin"]
            model, stats = segments(grid, "adamw", sets, [2, 1], rr_lr)
            save(model, out / f"rr-k{k}-rank{rank}.pt", stats=stats)
        # Worker 1's first gradient is NaN: that update is skipped and counted, no more.
        sets = ["parallel.max_staleness=1", "parallel.ps_async_order=round-robin"]
        model, stats = segments(grid, "adamw", sets, [2], rr_lr, lambda r, k: (r, k) == (1, 0))
        save(model, out / f"rr-nan-rank{rank}.pt", stats=stats)
        # Every worker's second gradient is NaN: the segment's last d updates, one step's worth.
        model, stats = segments(grid, "adamw", sets, [2], rr_lr, lambda r, k: k == 1)
        save(model, out / f"rr-nan-step-rank{rank}.pt", stats=stats)
    elif mode == "local":
        cases = {
            "h1": ["parallel.local_sgd_steps=1"],
            "h4": ["parallel.local_sgd_steps=4"],
            "h4-moments": [
                "parallel.local_sgd_steps=4",
                "parallel.local_sgd_average_optimizer=true",
            ],
            "h4-horovod": ["parallel.local_sgd_steps=4", "parallel.local_sgd_engine=horovod"],
        }
        for case, sets in cases.items():
            model = sync_steps(grid, "local-sgd", "adamw", sets, 8)
            save(model, out / f"local-{case}-rank{rank}.pt")
        sgd = sync_steps(grid, "local-sgd", "sgd", ["parallel.local_sgd_steps=1"], 3, clip=0.0)
        save(sgd, out / f"local-sgd-h1-rank{rank}.pt")
        save(sync_steps(grid, "ddp", "sgd", [], 3, clip=0.0), out / f"local-ddp-rank{rank}.pt")
    topology.shutdown()


if __name__ == "__main__":
    main()
