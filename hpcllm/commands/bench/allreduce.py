"""``hpcllm bench allreduce``: gone into ``hpcllm bench collectives``; says which command to run.

Unlisted in ``hpcllm bench --help``; every word after it is refused with the same line.
"""

from __future__ import annotations

import argparse

from hpcllm.errors import UserError

REPLACED_BY = (
    "hpcllm bench allreduce is now part of hpcllm bench collectives: run "
    "mpirun -np N hpcllm bench collectives --collectives all_reduce --sizes BYTES "
    "[--iters 50] [--json PATH] (add reduce_scatter,all_gather to --collectives for what the "
    "distributed optimizer moves)"
)


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Add the target's parser to ``targets``: any words, no help entry."""
    # A prefix no word starts with: --bytes and the rest are words too, not unknown options.
    gone = targets.add_parser("allreduce", add_help=False, prefix_chars="\0")
    gone.add_argument("words", nargs=argparse.REMAINDER)
    gone.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Refuse with the command that replaced this one."""
    raise UserError(REPLACED_BY)
