"""``hpcllm bench prepare``: prepare throughput at several rank counts, beside the reader's."""

from __future__ import annotations

import argparse
from pathlib import Path

from hpcllm.commands.args import at_least, positive

FILES = 64  # the synthetic corpus's files when --files is not given


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Add the target's parser to ``targets``."""
    prep = targets.add_parser(
        "prepare",
        help="prepare throughput at several rank counts, beside the reader's",
        description="Run `hpcllm prepare` for each tokenizer at each rank count (through "
        "mpirun when > 1) and print MB of text per second and tokens per second per rank side "
        "by side; then time the shard reader on one of the prepared folders and print how many "
        "prepare ranks make tokens as fast as one reader takes them.",
    )
    source = prep.add_mutually_exclusive_group()
    source.add_argument(
        "--corpus",
        choices=["python-stdlib"],
        help="a built-in corpus [default: python-stdlib, when neither --input nor "
        "--synthetic-gb is given]",
    )
    source.add_argument(
        "--input",
        nargs="+",
        metavar="PATH",
        help="your own text files, folders or quoted globs, as `hpcllm prepare --input` takes them",
    )
    source.add_argument(
        "--synthetic-gb",
        type=at_least(float, 1e-6, "a size in GB of at least 1e-6"),
        metavar="G",
        help="write a synthetic corpus of about G GB of word-like text into DIR/corpus first "
        "(the same bytes every time; reused when already there) and prepare that",
    )
    prep.add_argument(
        "--files",
        type=positive,
        default=None,
        metavar="N",
        help=f"files of the synthetic corpus (--synthetic-gb only) [default: {FILES}]",
    )
    prep.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="DIR",
        help="scratch folder for the prepared copies (and the synthetic corpus)",
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
    """Prepare the corpus at each rank count and tokenizer; print its rates and the reader's."""
    from hpcllm.errors import UserError

    if args.files is not None and args.synthetic_gb is None:
        raise UserError("--files sizes the synthetic corpus: give it with --synthetic-gb")
    from hpcllm.bench import prepare

    return prepare.run(
        args.out,
        ranks=tuple(args.ranks),
        tokenizers=tuple(args.tokenizers),
        vocab_size=args.vocab_size,
        as_json=args.json,
        corpus=args.corpus,
        inputs=tuple(args.input or ()),
        synthetic_gb=args.synthetic_gb,
        files=args.files or FILES,
        threads_per_rank=args.threads_per_rank,
    )
