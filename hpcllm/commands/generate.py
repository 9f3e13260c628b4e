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
        help="a run folder (with checkpoints/, and tokenizer.json for --prompt)",
    )
    step_arg(gen, "sample from")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text to continue")
    prompt.add_argument(
        "--prompt-ids",
        type=_ids,
        metavar="ID,ID,...",
        help="token ids to continue, without a tokenizer; prints ids (comma-separated)",
    )
    gen.add_argument(
        "--tokenizer",
        type=Path,
        metavar="PATH",
        help="a tokenizer.json or a Hugging Face tokenizer folder (tokenizer.json + "
        "tokenizer_config.json) [default: RUN_DIR's]",
    )
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


def _ids(text: str) -> list[int]:
    """Parse ``--prompt-ids``: comma-separated non-negative integers."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated token ids") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"{text!r}: token ids are not negative")
    return ids


def run(args: argparse.Namespace) -> int:
    """Print the prompt's continuation (text, or with --prompt-ids, ids)."""
    from hpcllm.errors import UserError
    from hpcllm.generate import generate, generate_ids

    sampling = {
        "tokens": args.tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "seed": args.seed,
        "step": args.step,
        "allow_unverified": args.allow_unverified,
    }
    if args.prompt_ids is not None:
        if args.tokenizer is not None:
            raise UserError("--prompt-ids samples ids without a tokenizer; drop --tokenizer")
        print(",".join(map(str, generate_ids(args.checkpoint, args.prompt_ids, **sampling))))
    else:
        print(generate(args.checkpoint, args.prompt, tokenizer=args.tokenizer, **sampling))
    return 0
