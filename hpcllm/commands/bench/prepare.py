"""``hpcllm bench prepare``: prepare throughput in MB/s at several rank counts."""

from __future__ import annotations

import argparse
from pathlib import Path

from hpcllm.commands.args import positive


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Add the target's parser to ``targets``."""
    prep = targets.add_parser(
        "prepare",
        help="prepare throughput in MB/s at several rank counts",
        description="Run `hpcllm prepare` on a built-in corpus for each tokenizer at each rank "
        "count (through mpirun when > 1) and print MB of text per second side by side.",
    )
    prep.add_argument(
        "--corpus",
        default="python-stdlib",
        choices=["python-stdlib"],
        help="[default: python-stdlib]",
    )
    prep.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="DIR",
        help="scratch folder for the prepared copies",
    )
    prep.add_argument(
        "--ranks",
        type=positive,
        nargs="+",
        default=[1, 2],
        help="rank counts to run [default: 1 2]",
    )
    prep.add_argument(
        "--tokenizers",
        nargs="+",
        default=["byte", "bpe"],
        choices=["byte", "bpe"],
        help="[default: byte bpe]",
    )
    prep.add_argument("--vocab-size", type=positive, default=8192, help="[default: 8192]")
    prep.add_argument(
        "--threads-per-rank",
        type=positive,
        default=None,
        help="tokenizer threads per rank (RAYON_NUM_THREADS) [default: the "
        "node's cores shared among its ranks]",
    )
    prep.add_argument("--json", action="store_true", help="print JSON")
    prep.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Prepare the corpus at each rank count and tokenizer; print MB/s."""
    from hpcllm.bench import prepare

    return prepare.run(
        args.corpus,
        args.out,
        tuple(args.ranks),
        tuple(args.tokenizers),
        args.vocab_size,
        args.json,
        args.threads_per_rank,
    )
