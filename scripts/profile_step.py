"""Where one hpcllm training step spends its time, by torch.profiler: the GPU kernels and CPU ops.

Builds the trainer as ``hpcllm bench step`` does for a shape (one micro-batch per step, the
prepared data of data.path), runs warm-up steps (compilation, auto's timings), then profiles
``--steps`` steps and prints: the wall time per step, the GPU's busy time per step (the sum of
kernel times; far below the wall time means the CPU cannot launch fast enough), and the
operators with the most GPU time and the most CPU time.

    python scripts/profile_step.py --shape gpt2-124m [--set model.compile=full] [--out FILE]

``--plain`` profiles the benchmark's plain PyTorch GPT-2 under ``torch.compile`` instead, on
the same batches, so that the two tables can be read side by side kernel for kernel.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from hpcllm.bench.step import SHAPES, _plain_step
from hpcllm.config import load_config
from hpcllm.train.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="gpt2-124m", choices=sorted(SHAPES))
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--out", type=Path, help="also write the report here")
    parser.add_argument(
        "--plain", action="store_true", help="profile plain GPT-2 + torch.compile instead"
    )
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="hpcllm-profile-") as scratch:
        cfg = load_config(
            None,
            [
                *SHAPES[args.shape],
                *args.overrides,
                f"train.precision={'bf16' if cuda else 'fp32'}",
                "train.global_batch_size=null",
                "train.eval_interval=0",
                "train.eval_iters=1",
                f"run.dir={scratch}",
                "run.resume=none",
                "run.tensorboard=false",
            ],
        )
        with Trainer(cfg) as trainer:
            reader = iter(trainer.reader)
            step = lambda: trainer.train_step(reader, wait=False)  # noqa: E731
            if args.plain:
                device = trainer.device
                batches = [
                    (b.input_ids.to(device), b.labels.to(device))
                    for b in (next(reader) for _ in range(8))
                ]
                step = (
                    _plain_step(cfg, trainer.padded_vocab, device, batches, cuda)[-1]
                    or (_plain_step(cfg, trainer.padded_vocab, device, batches, False)[0])
                )
            sync = torch.cuda.synchronize if cuda else (lambda: None)
            for _ in range(args.warmup):
                step()
            sync()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) as prof:
                began = time.perf_counter()
                for _ in range(args.steps):
                    step()
                sync()
                wall_ms = (time.perf_counter() - began) * 1e3 / args.steps
            reader.close()
    events = prof.key_averages()
    kernel_us = sum(
        e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA
    )
    lines = [
        f"{'plain + torch.compile ' if args.plain else ''}"
        f"{args.shape} {' '.join(args.overrides)}: wall {wall_ms:.1f} ms/step, GPU kernels "
        f"{kernel_us / 1e3 / args.steps:.1f} ms/step busy",
    ]
    if cuda:
        lines += [
            "",
            "by GPU time:",
            events.table(sort_by="self_cuda_time_total", row_limit=args.rows),
        ]
    lines += ["", "by CPU time:", events.table(sort_by="self_cpu_time_total", row_limit=args.rows)]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
