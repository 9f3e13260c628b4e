"""``hpcllm bench collectives``: the collectives, size by size, under mpirun or srun."""

from __future__ import annotations

import argparse


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Add the target's parser to ``targets``."""
    coll = targets.add_parser(
        "collectives",
        help="all-reduce, all-gather, reduce-scatter, all-to-all and send/recv bandwidth by "
        "message size, through torch.distributed, MPI and Horovod",
        description="Under mpirun or srun (2 or more ranks): time each collective at each "
        "message size through each transport and print nccl-tests' algbw and busbw. Across "
        "nodes it measures the between-node tables that hpcllm bench report --merge adds to a "
        "cluster file (jobs/collectives.sh runs both). Arguments after 'collectives' go to "
        "the benchmark (--help there).",
        add_help=False,
    )
    coll.add_argument("collectives_args", nargs=argparse.REMAINDER)
    coll.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Hand the words after ``collectives`` to the benchmark's own parser."""
    from hpcllm.bench import collectives

    return collectives.main(list(args.collectives_args))
