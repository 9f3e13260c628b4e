"""``hpcllm bench moe``: an MoE step's tokens/s and the all-to-all's time by ep and top_k."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from hpcllm.commands.args import add_config_args, positive


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Add the target's parser to ``targets``."""
    moe = targets.add_parser(
        "moe",
        help="an MoE step's tokens/s and all-to-all time by ep and top_k, DDP and Horovod",
        description="Train the config's MoE model (the mixtral-tiny preset when the config "
        "names no experts) for a few steps on d ranks (mpirun) at each expert-parallel size "
        "and top_k, under each engine; prints tokens/s and the seconds per step in the MoE "
        "all-to-alls, and writes bench_moe.json, bench_moe.png and bench_moe.txt to --out.",
    )
    add_config_args(moe)
    moe.add_argument(
        "--dp",
        type=positive,
        default=None,
        help="data-parallel size, the ranks of every case [default: the GPUs here, or 2 on a CPU]",
    )
    moe.add_argument(
        "--ep",
        type=positive,
        nargs="+",
        default=None,
        help="[default: every divisor of d that divides the experts]",
    )
    moe.add_argument("--top-k", type=positive, nargs="+", default=None, help="[default: 1 2]")
    moe.add_argument(
        "--engines",
        nargs="+",
        default=["ddp", "horovod"],
        choices=["ddp", "horovod"],
        help="[default: both]",
    )
    moe.add_argument("--steps", type=positive, default=None, help="steps per run [default: 20]")
    moe.add_argument(
        "--warmup", type=int, default=None, help="first steps left out of the rates [default: 5]"
    )
    moe.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="the smallest run that fills every column: d = 2, ep 1 2, top_k 1 2, 4 steps "
        "of a 32-token mixtral-tiny, on the CPU (the options given still win)",
    )
    moe.add_argument(
        "--out",
        type=Path,
        default=Path("runs/bench-moe"),
        help="folder for the runs and results [default: runs/bench-moe]",
    )
    moe.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run every case; refuse a d this node cannot hold."""
    import torch

    from hpcllm.bench import moe
    from hpcllm.bench.runs import synthetic_unless_data
    from hpcllm.errors import UserError

    if args.cpu_smoke:
        # Before anything asks torch about CUDA, and for the ranks it launches: the CPU.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    gpu = torch.cuda.is_available()
    overrides = list(args.overrides)
    given = {"steps": args.steps, "warmup": args.warmup, "top_ks": args.top_k, "dp": args.dp}
    given["eps"] = args.ep
    chosen = {**moe.DEFAULTS, **(moe.SMOKE if args.cpu_smoke else {})}
    chosen.update({k: v for k, v in given.items() if v is not None})
    steps, warmup, dp, eps, top_ks = (
        chosen["steps"], chosen["warmup"], chosen["dp"], chosen["eps"], chosen["top_ks"]
    )  # fmt: skip
    if args.cpu_smoke:
        overrides = [*moe.SMOKE_SETS, *overrides]
    devices = torch.cuda.device_count() if gpu else len(os.sched_getaffinity(0))
    dp = dp or (devices if gpu else 2)
    if dp < 2:
        why = "--dp 1 was given" if args.dp else "this node has one GPU"
        raise UserError(
            f"bench moe needs d >= 2 (the ep ranks are carved out of d) and {why}; give "
            "--dp 2 or more (on a GPU node, up to its GPUs)"
        )
    if gpu and dp > devices:
        raise UserError(
            f"bench moe runs d = {dp} ranks on this node, one GPU each, and it has {devices}; "
            f"give --dp up to {devices}"
        )
    return moe.run(
        args.config,
        synthetic_unless_data(args.config, overrides),
        dp,
        args.engines,
        eps,
        top_ks,
        steps,
        warmup,
        args.out,
    )
