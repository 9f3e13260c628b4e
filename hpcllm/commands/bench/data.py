"""``hpcllm bench data``: reader throughput in tokens/s per rank."""

from __future__ import annotations

import argparse
from pathlib import Path

from hpcllm.commands.args import positive


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Add the target's parser to ``targets``."""
    data = targets.add_parser(
        "data",
        help="reader throughput in tokens/s per rank",
        description="Read micro-batches from prepared shards as fast as possible on every "
        "rank at once (each rank its own data-parallel part) and print tokens/s per rank.",
    )
    data.add_argument("dir", type=Path, metavar="DIR", help="a folder written by prepare")
    data.add_argument("--seq-len", type=positive, default=1024, help="[default: 1024]")
    data.add_argument("--micro-batch-size", type=positive, default=8, help="[default: 8]")
    data.add_argument(
        "--steps", type=positive, default=2000, help="micro-batches timed per rank [default: 2000]"
    )
    data.add_argument(
        "--warmup", type=int, default=20, help="micro-batches read before timing [default: 20]"
    )
    data.add_argument(
        "--blend",
        metavar="BLEND",
        help="also time a blend's reader beside DIR's, as data.blend takes it: "
        "'[[DIR1, W1], [DIR2, W2]]' or Megatron's 'W1 DIR1 W2 DIR2'",
    )
    data.add_argument("--json", action="store_true", help="print JSON")
    data.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Read micro-batches on every rank and print tokens/s per rank."""
    from hpcllm.bench import data
    from hpcllm.config import blend_sources, parse_override

    blend = None
    if args.blend is not None:
        blend = blend_sources("--blend", parse_override(f"data.blend={args.blend}")[2])
    return data.run(
        args.dir,
        seq_len=args.seq_len,
        micro_batch_size=args.micro_batch_size,
        steps=args.steps,
        warmup=args.warmup,
        as_json=args.json,
        blend=blend,
    )
