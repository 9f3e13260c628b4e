"""Run a Python script as ``__main__`` and end its process as the ``hpcllm`` command does.

Usage: python tests/script_runner.py SCRIPT [ARGS...]

:func:`mpirun.python` starts every script of the suite (``tests/mpi_scripts/*.py``) through
this. The script sees the command line, ``sys.path[0]`` and ``__name__`` that ``python SCRIPT
ARGS`` gives it; its exit code (falling off the end: 0, an uncaught exception: its traceback
and 1, ``SystemExit``: its code) then goes to :func:`hpcllm.errors.end`, which ends a process
that started torch.distributed without the interpreter's finalisation, where a Gloo worker
thread still running or releasing a Python callback (DDP's communication hooks) aborted the
rank after a run that succeeded (docs/reliability.md, "A clean end").
"""

from __future__ import annotations

import runpy
import sys
import traceback
from pathlib import Path


def exit_code(stop: SystemExit) -> int:
    """Return the exit code Python gives ``SystemExit(stop.code)``, printing a message code."""
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code
    print(stop.code, file=sys.stderr)
    return 1


def main() -> None:
    """Run ``sys.argv[1]`` with the arguments after it; end through :func:`hpcllm.errors.end`."""
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = str(Path(script).resolve().parent)
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = exit_code(stop)
    except BaseException:  # what the interpreter would print, and its exit code
        traceback.print_exc()
        code = 1
    from hpcllm.cli import end

    end(code)


if __name__ == "__main__":
    main()
