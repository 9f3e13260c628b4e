"""Under mpirun: short training runs at several expert-parallel layouts, in one launch.

Usage: ep_runs.py DATA SCRATCH RUNS_JSON

RUNS_JSON is a list of ``[name, folder, overrides]``: each trains in SCRATCH/folder (a folder
given twice resumes there) as ``hpcllm train --set ...`` would. Each rank saves its gradients
after the first step of every run that starts fresh, after the engine's reduction, to
SCRATCH/name/grads-rank{R}.pt, keyed by chunk and whole-model name; expert tensors are
gathered whole over the ep group, so every layout's file compares with ep = 1's at the same
t and p. Rank 0 prints one JSON line: each run's metrics records (the folder's, so far).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hpcllm.config import load_config
from hpcllm.observe import read_metrics
from hpcllm.parallel.data.experts import is_expert
from hpcllm.train.trainer import Trainer


def main() -> None:
    data, scratch = sys.argv[1], Path(sys.argv[2])
    done = {}
    for name, folder, overrides in json.loads(sys.argv[3]):
        # The overrides come after DATA, so a run may read other data.
        sets = [f"data.path={data}", *overrides, f"run.dir={scratch / folder}"]
        fresh = not (scratch / folder).exists()
        holder: dict = {}

        def hook(step, chunks, optimizer, holder=holder, name=name, fresh=fresh) -> None:
            if step != 0 or not fresh:
                return
            grid = holder["trainer"].grid
            grads = {}
            for i, chunk in enumerate(chunks):
                for key, p in chunk.named_parameters():
                    grad = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                    if is_expert(p):
                        parts = [torch.empty_like(grad) for _ in range(grid.ep)]
                        dist.all_gather(parts, grad.contiguous(), group=grid.groups.ep)
                        grad = torch.cat(parts)
                    grads[f"{i}.{key}"] = grad
            out = scratch / name
            out.mkdir(parents=True, exist_ok=True)
            torch.save(grads, out / f"grads-rank{grid.rank}.pt")

        with Trainer(load_config(None, sets), grad_hooks=[hook]) as trainer:
            holder["trainer"] = trainer
            trainer.run(progress=False)
        done[name] = read_metrics(scratch / folder)
    if dist.is_initialized():
        dist.barrier()
    print(json.dumps(done), flush=True)


if __name__ == "__main__":
    main()
