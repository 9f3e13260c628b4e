"""``hpcllm bench cp``: activation bytes per rank and step time by sequence length and cp."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from hpcllm.commands.args import add_config_args, positive


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Add the target's parser to ``targets``."""
    cp = targets.add_parser(
        "cp",
        help="context parallelism: activation bytes per rank and step time by length and cp",
        description="Train the config's model (the llama-tiny preset when the config names "
        "none) for a few steps of one sequence at each length and context-parallel size cp, "
        "on cp ranks (mpirun); prints the activation bytes the largest rank saves for the "
        "backward (counted with saved_tensors_hooks) and the step time, and writes "
        "bench_cp.json, bench_cp.png and bench_cp.txt to --out.",
    )
    add_config_args(cp)
    cp.add_argument(
        "--seq", type=positive, nargs="+", default=None, help="[default: 2048 4096 8192]"
    )
    cp.add_argument("--cp", type=positive, nargs="+", default=None, help="[default: 1 2 4]")
    cp.add_argument("--steps", type=positive, default=None, help="steps per case [default: 4]")
    cp.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="first steps left out of the time; the first timed one is counted [default: 2]",
    )
    cp.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="the smallest run that fills every column: lengths 128 256, cp 1 2, 2 steps, "
        "on the CPU (the options given still win)",
    )
    cp.add_argument(
        "--out",
        type=Path,
        default=Path("runs/bench-cp"),
        help="folder for the runs and results [default: runs/bench-cp]",
    )
    cp.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run every case; refuse a cp this node cannot hold."""
    import torch

    from hpcllm.bench import cp
    from hpcllm.bench.runs import synthetic_unless_data
    from hpcllm.errors import UserError

    if args.cpu_smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch asks, and for the ranks
    chosen = {**cp.DEFAULTS, **(cp.SMOKE if args.cpu_smoke else {})}
    given = {"seqs": args.seq, "cps": args.cp, "steps": args.steps, "warmup": args.warmup}
    chosen.update({k: v for k, v in given.items() if v is not None})
    if torch.cuda.is_available() and max(chosen["cps"]) > torch.cuda.device_count():
        raise UserError(
            f"bench cp runs cp ranks on this node, one GPU each, and it has "
            f"{torch.cuda.device_count()}; give --cp up to that"
        )
    return cp.run(
        args.config,
        synthetic_unless_data(args.config, list(args.overrides)),
        chosen["seqs"],
        chosen["cps"],
        chosen["steps"],
        chosen["warmup"],
        args.out,
    )
