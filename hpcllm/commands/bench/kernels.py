"""``hpcllm bench kernels``: fused Triton kernels against eager PyTorch and torch.compile (GPU)."""

from __future__ import annotations

import argparse


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Add the target's parser to ``targets``."""
    kern = targets.add_parser(
        "kernels",
        help="fused Triton kernels against eager PyTorch and torch.compile (GPU)",
        description="Time each fused op against eager PyTorch and torch.compile, then a "
        "gpt2-124m training step with fused kernels on and off; arguments after 'kernels' go "
        "to the benchmark (--help there). --cpu-smoke runs it tiny under Triton's "
        "interpreter.",
        add_help=False,
    )
    kern.add_argument("kernel_args", nargs=argparse.REMAINDER)
    kern.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Hand the words after ``kernels`` to the benchmark's own parser."""
    from hpcllm.bench import kernels

    return kernels.main(list(args.kernel_args))
