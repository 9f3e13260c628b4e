"""``hpcllm bench allreduce``: all-reduce bandwidth through MPI, torch.distributed and Horovod."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hpcllm.commands.args import positive


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Add the target's parser to ``targets``."""
    allr = targets.add_parser(
        "allreduce",
        help="all-reduce bandwidth through MPI, torch.distributed and Horovod",
        description="Under mpirun: all-reduce one float32 buffer through mpi4py, "
        "torch.distributed and Horovod and print algbw/busbw (nccl-tests definitions).",
    )
    allr.add_argument("--bytes", type=positive, default=8 << 20, help="[default: 8 MiB]")
    allr.add_argument("--iters", type=positive, default=50, help="[default: 50]")
    allr.add_argument("--warmup", type=int, default=5, help="[default: 5]")
    allr.add_argument("--json-out", type=Path, default=None, help="also write JSON here")
    allr.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress on stderr (a bar on a terminal, else a line per transport)",
    )
    allr.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """All-reduce through each transport; rank 0 prints (and writes) the table."""
    from hpcllm.bench import allreduce

    result = allreduce.bench_allreduce(
        args.bytes, args.iters, args.warmup, progress=not args.no_progress
    )
    if result is not None:
        print(allreduce.render_allreduce(result))
        if args.json_out:
            args.json_out.write_text(json.dumps(result, indent=2))
    return 0
