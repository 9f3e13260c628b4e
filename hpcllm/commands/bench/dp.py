"""``hpcllm bench dp``: DDP vs Horovod vs parameter server, fp32 and mixed precision."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from hpcllm.commands.args import add_config_args, positive


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Add the target's parser to ``targets``."""
    dpb = targets.add_parser(
        "dp",
        help="DDP vs Horovod vs parameter server, fp32 and mixed precision",
        description="Train the config's model for a few steps as a single-rank baseline and "
        "with each data-parallel engine at each d (mpirun), in each precision, with the "
        "micro-batch per rank fixed; then all-reduce a gradient-sized buffer through MPI, "
        "torch.distributed and Horovod. Prints the comparison table and writes "
        "bench_dp.json, bench_dp.png and bench_dp.txt to --out.",
    )
    add_config_args(dpb)
    dpb.add_argument(
        "--dp",
        type=positive,
        nargs="+",
        default=None,
        help="data-parallel sizes [default: 2 up to the cores or GPUs here]",
    )
    dpb.add_argument(
        "--engines",
        nargs="+",
        default=["ddp", "horovod", "ps", "ddp-zero", "horovod-zero"],
        choices=["ddp", "horovod", "ps", "ddp-zero", "horovod-zero"],
        help="ddp-zero and horovod-zero: that engine with the distributed optimizer "
        "(parallel.distributed_optimizer) [default: all five]",
    )
    dpb.add_argument(
        "--precisions",
        nargs="+",
        default=None,
        choices=["fp32", "bf16", "fp16"],
        help="[default: fp32 and fp16 on GPU; fp32 and bf16 on a CPU with native bf16 "
        "arithmetic (avx512_bf16/amx_bf16), else fp32 only]",
    )
    dpb.add_argument("--steps", type=positive, default=30, help="steps per run [default: 30]")
    dpb.add_argument(
        "--warmup", type=int, default=5, help="first steps left out of the rates [default: 5]"
    )
    dpb.add_argument(
        "--out",
        type=Path,
        default=Path("runs/bench-dp"),
        help="folder for the runs and results [default: runs/bench-dp]",
    )
    dpb.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run every engine at each d and precision; refuse d this node cannot hold."""
    import torch

    from hpcllm.bench import dp
    from hpcllm.errors import UserError

    gpu = torch.cuda.is_available()
    devices = torch.cuda.device_count() if gpu else len(os.sched_getaffinity(0))
    dps = args.dp or list(range(2, devices + 1))
    if not dps:
        raise UserError(
            "bench dp needs d >= 2 and this node has one GPU, so there is nothing to "
            "compare; run it on a node with more GPUs"
        )
    if gpu and max(dps) > devices:
        # Its ranks start on this node (mpirun -np d), one GPU each: NCCL refuses two ranks
        # on one GPU.
        raise UserError(
            f"bench dp runs d = {max(dps)} ranks on this node, one GPU each, and it has "
            f"{devices}; give --dp up to {devices}"
        )
    from hpcllm.bench.runs import synthetic_unless_data

    precisions = args.precisions  # None: what the machine runs fast (dp.default_precisions)
    return dp.run(
        args.config,
        synthetic_unless_data(args.config, args.overrides),
        dps,
        args.engines,
        precisions,
        args.steps,
        args.warmup,
        args.out,
    )
