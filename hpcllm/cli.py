"""The ``hpcllm`` command: builds the top parser, hands each verb to its module in
:mod:`hpcllm.commands`, and ends the process."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import NoReturn

from hpcllm import __version__
from hpcllm.commands import add_parsers
from hpcllm.commands.args import Parser
from hpcllm.commands.bench import own_parser
from hpcllm.errors import run_reporting_errors


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


def end(code: int) -> NoReturn:
    """End the process with ``code``: through :func:`exit_process` where
    :func:`hpcllm.topology.init` started torch.distributed, else as Python does.

    Every program that trains under a launcher ends here: the ``hpcllm`` command,
    ``python -m hpcllm.bench.collectives``, and a script of one's own around ``Trainer``
    should too (the test suite's scripts do, through ``tests/script_runner.py``).
    """
    topology = sys.modules.get("hpcllm.topology")
    if topology is not None and topology.was_started():
        exit_process(code)
    sys.exit(code)


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


def exit_process(code: int) -> NoReturn:
    """End the process with ``code`` without the interpreter's finalisation.

    A Gloo process group can outlive destroy_process_group and a garbage collection (the
    world group does, once a trainer has run), and with it its worker threads. Those threads
    run the Python callbacks chained on a collective's future (DDP's communication hooks:
    torch's default all-reduce hook and hpcllm's timing hook), then release them; one that
    reaches such a callback when Python finalises needs the GIL, which a finalising
    interpreter refuses by ending the thread inside C++: the rank aborts (SIGABRT, "terminate
    called without an active exception") after a run that succeeded. So the process ends the
    way finalisation would have, minus that: Python's exit handlers (the watchdog's stop,
    Horovod's shutdown), MPI_Finalize where MPI was started, Python's and C's buffered output
    flushed, then ``os._exit``, whatever a step of that raises.
    """
    import atexit
    import ctypes

    try:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        atexit._run_exitfuncs()
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).fflush(None)  # what C extensions printed (NCCL_DEBUG, ...)
        os._exit(code)
