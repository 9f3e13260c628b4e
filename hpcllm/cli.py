"""The ``hpcllm`` command: builds the top parser, hands each verb to its module in
:mod:`hpcllm.commands`, and ends the process."""

from __future__ import annotations

import argparse
import sys

from hpcllm import __version__
from hpcllm.commands import add_parsers
from hpcllm.commands.args import Parser
from hpcllm.commands.bench import own_parser
from hpcllm.errors import end, run_reporting_errors


def build_parser() -> argparse.ArgumentParser:
    """Return the ``hpcllm`` parser with every command's (no command's dependencies imported)."""
    parser = Parser(
        prog="hpcllm",
        description="Train GPT-style models with tensor, pipeline and data parallelism, "
        "started by mpirun or srun.",
    )
    parser.add_argument("--version", action="version", version=f"hpcllm {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    add_parsers(verbs)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``hpcllm`` command line and return its exit code (the command is :func:`run`)."""

    words = sys.argv[1:] if argv is None else argv

    def parse_and_run() -> int:
        whole = own_parser(words)
        if whole is not None:
            return whole(words[2:])
        args = build_parser().parse_args(words)
        code = args.run(args)
        _end_torch_distributed()
        return code

    return run_reporting_errors(parse_and_run)


def run() -> None:
    """The ``hpcllm`` command (and ``python -m hpcllm``): :func:`main`, then :func:`end`."""
    end(main())


def _end_torch_distributed() -> None:
    """Destroy torch.distributed's process groups, if a command started them.

    destroy_process_group frees the groups torch's registry held last; the command's own
    objects are unreachable now but for reference cycles, and collecting them destroys the
    groups they held, which joins those groups' worker threads.
    """
    if "torch.distributed" not in sys.modules:  # a command that never imported torch
        return
    import gc

    from hpcllm import topology

    topology.shutdown()
    gc.collect()
