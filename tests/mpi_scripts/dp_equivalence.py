"""Under mpirun: train a small GPT 3 steps with each data-parallel engine, save the weights.

Usage: mpirun -np D python dp_equivalence.py OUT_DIR PRECISION OPTIMIZER ENGINE[,ENGINE...]

OPTIMIZER is sgd (momentum 0.9) or adamw (the trainer's). ENGINE is ddp, horovod or ps, or
ddp+zero / horovod+zero: that engine with the distributed optimizer, in buckets of 10 kB so
that the model spans several (each padded to a multiple of d).

For every engine and accumulation in {1, 2}, each rank trains on its slice of the same global
batches (global_batch() below) and saves its parameters to
OUT_DIR/{engine}-a{accumulation}-rank{rank}.pt. The pytest side compares them with one
process trained on the whole global batch.
"""

import sys
from pathlib import Path

import torch

from hpcllm import topology
from hpcllm.config import ModelConfig, load_config
from hpcllm.model.gpt import GPT
from hpcllm.parallel.data.builder import build_engine
from hpcllm.train.optim import autocast, build_optimizer, build_scaler

STEPS, MICRO, SEQ, VOCAB = 3, 2, 16, 100


def model_config() -> ModelConfig:
    return ModelConfig(preset=None, n_layer=2, n_head=2, d_model=32, seq_len=SEQ)


def train_config(precision: str):
    return load_config(
        None,
        [
            "train.lr=1e-2",
            "train.weight_decay=0.1",
            "train.grad_clip=1.0",
            f"train.precision={precision}",
        ],
    ).train


def make_optimizer(kind: str, model: torch.nn.Module, precision: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return build_optimizer(model, train_config(precision), torch.device("cpu"))


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    out, precision, kind = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    engines = sys.argv[4].split(",")
    grid = topology.init()
    train = train_config(precision)
    for spec in engines:
        name, _, zero = spec.partition("+")
        sets = ["parallel.distributed_optimizer=true", "parallel.ddp_bucket_mb=0.01"]
        parallel = load_config(None, sets if zero else []).parallel
        for accumulation in (1, 2):
            model = GPT(model_config(), VOCAB, seed=7)
            optimizer = make_optimizer(kind, model, precision)
            scaler = build_scaler(precision, grid.device)
            engine = build_engine(name, grid, parallel)
            (module,) = engine.wrap([model])
            optimizer = engine.build_optimizer(optimizer, scaler, train.grad_clip, accumulation)
            per_rank = MICRO * accumulation
            for step in range(STEPS):
                ids, labels = global_batch(step, per_rank * grid.dp)
                mine = slice(grid.dp_rank * per_rank, (grid.dp_rank + 1) * per_rank)
                ids, labels = ids[mine], labels[mine]
                for micro in range(accumulation):
                    part = slice(micro * MICRO, (micro + 1) * MICRO)
                    with engine.forward_context(0), autocast(precision, grid.device):
                        loss = module(ids[part], labels[part])
                    last = micro == accumulation - 1
                    engine.backward(0, [scaler.scale(loss / accumulation)], [None], last)
                engine.finalize_grads()
                optimizer.step()
                optimizer.zero_grad()
            torch.save(
                {k: v.detach().clone() for k, v in model.state_dict().items()},
                out / f"{spec}-a{accumulation}-rank{grid.rank}.pt",
            )
    topology.shutdown()


if __name__ == "__main__":
    main()
