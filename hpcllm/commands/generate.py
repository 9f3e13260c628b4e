"""``hpcllm generate``: sample text from a run's checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from hpcllm.commands.args import non_negative, positive, step_arg


def add_parser(verbs: argparse._SubParsersAction) -> None:
    """Add the command's parser to ``verbs``."""
    gen = verbs.add_parser(
        "generate",
        help="sample text from a run's checkpoint",
        description="Load RUN_DIR's newest checkpoint (or --step N's), of any layout: "
        "tensor-parallel slices and pipeline stages are merged in memory on one process; "
        "then continue a prompt.",
    )
    gen.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        metavar="RUN_DIR",
        help="a run folder (with checkpoints/ and tokenizer.json)",
    )
    step_arg(gen, "sample from")
    gen.add_argument("--prompt", required=True, help="text to continue")
    gen.add_argument("--tokens", type=positive, default=100, help="new tokens [default: 100]")
    gen.add_argument(
        "--temperature",
        type=non_negative,
        default=0.8,
        help="0 picks the most likely token [default: 0.8]",
    )
    gen.add_argument("--top-k", type=positive, default=50, help="[default: 50]")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed [default: 0]")
    gen.add_argument(
        "--allow-unverified",
        action="store_true",
        help="load a checkpoint that has no manifest (format 1, or damaged) without checking it",
    )
    gen.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the prompt's continuation."""
    from hpcllm.generate import generate

    print(
        generate(
            args.checkpoint,
            args.prompt,
            tokens=args.tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
            step=args.step,
            allow_unverified=args.allow_unverified,
        )
    )
    return 0
