"""``hpcllm bench sync``: synchronous vs asynchronous vs local updates, with and without a
straggler."""

from __future__ import annotations

import argparse
from pathlib import Path

from hpcllm.commands.args import add_config_args, positive


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Add the target's parser to ``targets``."""
    syncb = targets.add_parser(
        "sync",
        help="synchronous vs asynchronous vs local updates, with and without a straggler",
        description="Train the config's model for the same number of samples at d ranks "
        "(mpirun) under synchronous ddp and ps, ps-async at each staleness bound and "
        "local-sgd at each H, each without and with a dialled straggler, and print samples/s, "
        "its ratio to the same strategy without the straggler, the final losses and the mean "
        "staleness. Writes bench_sync.json, bench_sync.png and bench_sync.txt to --out.",
    )
    add_config_args(syncb)
    syncb.add_argument("--dp", type=positive, default=2, help="ranks [default: 2]")
    syncb.add_argument(
        "--engines",
        nargs="+",
        default=["ddp", "ps", "ps-async", "local-sgd"],
        choices=["ddp", "ps", "ps-async", "local-sgd"],
        help="strategies to compare: ps-async once per --staleness, local-sgd once per "
        "--local-steps [default: all four]",
    )
    syncb.add_argument(
        "--steps", type=positive, default=60, help="global batches per run [default: 60]"
    )
    syncb.add_argument(
        "--log-every",
        type=positive,
        default=15,
        help="steps between sync points (logged steps), the first interval left out of the "
        "rates [default: 15]",
    )
    syncb.add_argument(
        "--staleness",
        type=int,
        nargs="+",
        default=[1, 4],
        help="ps-async max_staleness values [default: 1 4]",
    )
    syncb.add_argument(
        "--local-steps",
        type=positive,
        nargs="+",
        default=[2, 8],
        help="local-sgd averaging periods H [default: 2 8]",
    )
    syncb.add_argument("--straggler-rank", type=int, default=1, help="the slow rank [default: 1]")
    syncb.add_argument(
        "--straggler-factor",
        type=float,
        default=3.0,
        help="how many times as long its compute takes [default: 3]",
    )
    syncb.add_argument(
        "--repeats", type=positive, default=1, help="runs of each case, median [default: 1]"
    )
    syncb.add_argument(
        "--out",
        type=Path,
        default=Path("runs/bench-sync"),
        help="folder for the runs and results [default: runs/bench-sync]",
    )
    syncb.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run every strategy with and without the straggler."""
    from hpcllm.bench import sync
    from hpcllm.errors import UserError

    if args.dp < 2:
        raise UserError("bench sync compares data-parallel strategies: give --dp 2 or more")
    if not 0 <= args.straggler_rank < args.dp:
        raise UserError(f"--straggler-rank {args.straggler_rank} is not a rank of --dp {args.dp}")
    if args.straggler_factor < 1:
        raise UserError(f"--straggler-factor must be at least 1, got {args.straggler_factor:g}")
    if any(k < 0 for k in args.staleness):
        raise UserError("--staleness values must be >= 0")
    # The runs need the config's data: a missing folder is one line here, not in every run.
    from hpcllm.config import load_config
    from hpcllm.datasets.synthetic import load_data

    data = load_config(args.config, args.overrides).data
    if data.blend is not None:
        from hpcllm.datasets.blend import Blend

        Blend(data.blend)
    else:
        load_data(data.synthetic, data.path, None, data.seed)
    return sync.run(
        args.config,
        args.overrides,
        args.dp,
        args.steps,
        args.log_every,
        args.staleness,
        args.local_steps,
        args.straggler_rank,
        args.straggler_factor,
        args.repeats,
        args.out,
        args.engines,
    )
