"""``hpcllm bench device``: what hpcllm plan assumes of this GPU, measured."""

from __future__ import annotations

import argparse


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Add the target's parser to ``targets``."""
    dev = targets.add_parser(
        "device",
        help="what hpcllm plan assumes of this GPU, measured: a gpu_spec for a cluster file",
        description="Measure GEMM throughput by shape, causal attention and copy bandwidth on "
        "this GPU and write them as the gpu_spec of a cluster file, so hpcllm plan prices "
        "this GPU from its own numbers; arguments after 'device' go to the benchmark (--help "
        "there). --cpu-smoke runs it tiny on the CPU.",
        add_help=False,
    )
    dev.add_argument("device_args", nargs=argparse.REMAINDER)
    dev.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Hand the words after ``device`` to the benchmark's own parser."""
    from hpcllm.bench import device

    return device.main(list(args.device_args))
