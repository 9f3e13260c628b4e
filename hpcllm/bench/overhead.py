"""``hpcllm bench overhead``: hpcllm's training step against a plain PyTorch loop.

Both train the same GPT (same initial weights) on the same batch shapes with the same AdamW,
precision, accumulation and clipping, one process. They run in alternating blocks of steps,
so drifts of a noisy machine hit both alike; the ratio of median step times is the cost of
what hpcllm adds to every step (data reader, LR schedule, AMP scaler, engine, the pipeline
runtime that runs every layout, one stage here, NVTX ranges, the stop-signal all-reduce).
Logging every ``log_interval`` steps is not timed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from hpcllm.config import Config
from hpcllm.model.gpt import GPT
from hpcllm.train.optim import autocast, build_optimizer
from hpcllm.train.trainer import Trainer


def _plain_loop(
    cfg: Config, vocab: int, device: torch.device, batches: list[Any], accumulation: int
) -> Callable[[], float]:
    """Return a closure running one step of a textbook PyTorch training loop."""
    t = cfg.train
    model = GPT(cfg.model, vocab, seed=t.seed).to(device).train()
    optimizer = build_optimizer(model, t, device)
    scaler = torch.amp.GradScaler(device.type, enabled=t.precision == "fp16")
    position = [0]

    def step() -> float:
        for _ in range(accumulation):
            ids, labels = batches[position[0] % len(batches)]
            position[0] += 1
            with autocast(t.precision, device):
                loss = model(ids, labels)
            scaler.scale(loss / accumulation).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def _alternate(
    trainer: Trainer, cfg: Config, steps: int, rounds: int, warmup: int
) -> dict[str, list[float]]:
    """Return the step times of hpcllm's step and the plain loop, run in alternating blocks."""
    device = trainer.device
    batches = iter(trainer.reader)
    # The plain loop gets the same batch shapes, read up front (it does no data loading).
    sample = [next(batches) for _ in range(8)]
    plain_batches = [(b.input_ids.to(device), b.labels.to(device)) for b in sample]
    plain = _plain_loop(cfg, trainer.vocab_size, device, plain_batches, trainer.accumulation)

    def ours() -> None:
        # The loop's per-step work too: the stop-signal agreement (an all-reduce).
        trainer.train_step(batches)
        trainer._stop_requested()

    times: dict[str, list[float]] = {"hpcllm": [], "plain": []}
    for _ in range(warmup):
        ours()
        plain()
    for _ in range(rounds):
        for name, fn in (("hpcllm", ours), ("plain", plain)):
            for _ in range(steps):
                start = time.perf_counter()
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[name].append(time.perf_counter() - start)
    batches.close()
    return times


def bench_overhead(cfg: Config, steps: int, rounds: int, warmup: int = 3) -> dict[str, Any]:
    """Return median step times of hpcllm and the plain loop, and their ratio."""
    with Trainer(cfg) as trainer:
        if trainer.grid.world_size != 1:
            raise ValueError("the overhead benchmark runs as one process")
        times = _alternate(trainer, cfg, steps, rounds, warmup)
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {
        "steps_each": steps * rounds,
        "median_step_s": medians,
        "ratio": medians["hpcllm"] / medians["plain"],
        "tokens_per_step": trainer.tokens_per_step,
        "device": str(trainer.device),
        "precision": cfg.train.precision,
    }
