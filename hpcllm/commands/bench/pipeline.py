"""``hpcllm bench pipeline``: pipeline schedules: measured bubble against theory."""

from __future__ import annotations

import argparse
from pathlib import Path

from hpcllm.commands.args import positive


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Add the target's parser to ``targets``."""
    pipe = targets.add_parser(
        "pipeline",
        help="pipeline schedules: measured bubble against theory",
        description="Under mpirun with p ranks (one pipeline): run each schedule through the "
        "real runtime with fixed-cost (sleeping) stages, or the tiny GPT, and print the "
        "measured bubble next to (p-1)/m and (p-1)/(v*m), step-time ratios against 1f1b and "
        "the peak number of live activations per rank.",
    )
    pipe.add_argument(
        "--schedules",
        nargs="+",
        default=["gpipe", "1f1b", "interleaved", "zb-h1"],
        choices=["gpipe", "1f1b", "interleaved", "zb-h1"],
    )
    pipe.add_argument(
        "--microbatches",
        type=positive,
        nargs="+",
        default=[4, 8, 16],
        help="micro-batches per step, m [default: 4 8 16]",
    )
    pipe.add_argument(
        "--vpp",
        type=positive,
        default=2,
        help="virtual stages per rank for interleaved [default: 2]",
    )
    pipe.add_argument(
        "--forward-ms",
        type=float,
        default=40.0,
        help="synthetic forward time per stage; backward is twice it [default: 40]",
    )
    pipe.add_argument("--model", choices=["synthetic", "gpt"], default="synthetic")
    pipe.add_argument("--steps", type=positive, default=3, help="[default: 3]")
    pipe.add_argument("--warmup", type=int, default=1, help="[default: 1]")
    pipe.add_argument(
        "--timeline-dir",
        type=Path,
        default=None,
        help="draw each run's measured timeline (PNG + Chrome trace) here",
    )
    pipe.add_argument("--json-out", type=Path, default=None, help="also write JSON here")
    pipe.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run each schedule at each m and print measured against theoretical bubble."""
    from hpcllm.bench import pipeline

    pipeline.run(
        args.schedules,
        args.microbatches,
        args.vpp,
        args.forward_ms / 1000.0,
        args.steps,
        args.warmup,
        args.model,
        args.timeline_dir,
        args.json_out,
    )
    return 0
