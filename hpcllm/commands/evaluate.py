"""``hpcllm evaluate``: a checkpoint's loss and perplexity on a prepared dataset."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hpcllm.commands.args import positive, step_arg


def add_parser(verbs: argparse._SubParsersAction) -> None:
    """Add the command's parser to ``verbs``."""
    ev = verbs.add_parser(
        "evaluate",
        help="a checkpoint's loss and perplexity on a prepared dataset",
        description="Merge RUN_DIR's newest checkpoint (or --step N's), of any layout, into "
        "one model on one process and print its mean loss and perplexity over micro-batches "
        "of PATH's split, read in the order the trainer's validation reads them.",
    )
    ev.add_argument(
        "--checkpoint", type=Path, required=True, metavar="RUN_DIR", help="a run folder"
    )
    step_arg(ev, "evaluate")
    ev.add_argument(
        "--data",
        type=Path,
        required=True,
        metavar="PATH",
        help="prepared shards (hpcllm prepare --out PATH), tokenized as the run's data",
    )
    ev.add_argument("--split", choices=("val", "train"), default="val", help="[default: val]")
    ev.add_argument(
        "--micro-batch-size",
        type=positive,
        metavar="B",
        help="samples per micro-batch [default: the run's train.micro_batch_size]",
    )
    ev.add_argument(
        "--iters",
        type=positive,
        metavar="N",
        help="micro-batches [default: every whole micro-batch of the split]",
    )
    ev.add_argument(
        "--seq-len",
        type=positive,
        metavar="N",
        help="tokens per sample [default: the run's model.seq_len]; at most that for GPT-2's "
        "learned positions, any for Llama's rotary ones (beyond the trained length the loss "
        "says how the model extrapolates)",
    )
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    ev.add_argument(
        "--allow-unverified",
        action="store_true",
        help="load a checkpoint that has no manifest (format 1, or damaged) without checking it",
    )
    ev.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the loss and perplexity (one line, or JSON)."""
    import dataclasses

    from hpcllm.evaluate import evaluate

    result = evaluate(
        args.checkpoint,
        args.data,
        step=args.step,
        split=args.split,
        micro_batch_size=args.micro_batch_size,
        iters=args.iters,
        allow_unverified=args.allow_unverified,
        seq_len=args.seq_len,
    )
    print(json.dumps(dataclasses.asdict(result)) if args.json else result.line())
    return 0
