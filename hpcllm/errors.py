"""User errors: one clear line on stderr and exit code 2, on every rank, never a hang.

:class:`UserError` itself is defined in :mod:`hpcllm.user_error`, below launcher detection,
which raises it too; import it from here.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

from hpcllm.launcher import detect_launcher, error_comm, launch_rank
from hpcllm.user_error import USER_ERROR_EXIT, UserError


def _wait_for_all_ranks(timeout_s: float = 30.0) -> None:
    """Return once every MPI rank got here; abort the job if they do not within ``timeout_s``.

    An error that was meant to be seen by every rank but was not (a bug) then ends the job
    instead of leaving the other ranks waiting forever.
    """
    try:
        launch = detect_launcher()
    except UserError:  # srun without PMI: MPI cannot start, and srun waits for every task
        return
    if launch.world_size == 1:
        return
    comm = error_comm()
    request = comm.Ibarrier()
    deadline = time.monotonic() + timeout_s
    while not request.Test():
        if time.monotonic() > deadline:
            sys.stderr.flush()
            comm.Abort(USER_ERROR_EXIT)
        time.sleep(0.01)


STDOUT_CLOSED_EXIT = 141


def _stdout_closed() -> bool:
    """Return whether stdout's reader went away (a broken pipe's usual cause); if so, silence
    stdout.

    Where the error was raised says nothing, so stdout itself is asked. Python flushes stdout
    again at exit, which would print "Exception ignored ... Broken pipe": stdout is pointed at
    /dev/null first.
    """
    try:
        sys.stdout.flush()
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        # A pipe whose reading end is closed polls as an error.
        if not any(event & select.POLLERR for _, event in poller.poll(0)):
            return False
    except BrokenPipeError:
        pass
    except (OSError, ValueError, AttributeError):
        return False
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return True


def _abort_mpi_job(code: int) -> None:
    """Abort every rank of the MPI job if MPI is running with more than one rank."""
    mpi_module = sys.modules.get("mpi4py.MPI")
    if mpi_module is None:
        return
    mpi = mpi_module
    if mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.Get_size() > 1:
        sys.stderr.flush()
        mpi.COMM_WORLD.Abort(code)


def _report_user_error(message: str, same_on_all_ranks: bool) -> int:
    """Print ``message`` once per job (or with its rank) and return exit code 2."""
    rank = launch_rank()
    if not same_on_all_ranks:
        print(f"hpcllm: error (rank {rank}): {message}", file=sys.stderr, flush=True)
        _abort_mpi_job(USER_ERROR_EXIT)
    else:
        if rank == 0:
            print(f"hpcllm: error: {message}", file=sys.stderr, flush=True)
        _wait_for_all_ranks()
    return USER_ERROR_EXIT


def run_reporting_errors(main: Callable[[], int | None]) -> int:
    """Run ``main`` and turn a UserError into one stderr line and exit code 2.

    Any other exception prints its traceback and, under MPI with several ranks, aborts the job
    so that ranks blocked in a collective do not hang forever.
    """
    try:
        code = int(main() or 0)
        # Output still in the buffer is written here, not at exit, where a reader that went
        # away would be reported as "Exception ignored ... BrokenPipeError".
        sys.stdout.flush()
        return code
    except UserError as err:
        return _report_user_error(str(err), err.same_on_all_ranks)
    except KeyboardInterrupt:
        return 130
    except Exception as err:
        if isinstance(err, BrokenPipeError) and _stdout_closed():
            # The reader of our output went away (`hpcllm plan | head`): stop quietly, as
            # the Unix tools do when SIGPIPE ends them (128 + 13), the other ranks with us.
            _abort_mpi_job(STDOUT_CLOSED_EXIT)
            return STDOUT_CLOSED_EXIT
        if _lost_a_peer(err):
            return _report_lost_peer(err)
        traceback.print_exc()
        sys.stderr.flush()
        _abort_mpi_job(1)
        return 1


# What torch's collectives say when the rank at the other end has gone (it died, or aborted
# the job after its own error).
_PEER_GONE = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "remote process exited",
    "NCCL communicator was aborted",
)


def _lost_a_peer(err: BaseException) -> bool:
    # torch's collectives raise RuntimeError (DistBackendError is one); a local OSError such
    # as BrokenPipeError (stdout closed by `| head`) is not a peer's fault.
    if not isinstance(err, RuntimeError):
        return False
    return any(marker in str(err) for marker in _PEER_GONE)


def _report_lost_peer(err: BaseException, grace_s: float = 3.0) -> int:
    """A collective failed because another rank went away: let that rank's message stand.

    The rank that failed first is aborting the job (its own error, or the launcher noticing
    its death); give the launcher ``grace_s`` to end this rank quietly, then say in one line
    what happened here, without a traceback that would bury the first rank's message.
    """
    time.sleep(grace_s)
    reason = str(err).splitlines()[0][-160:]
    print(
        f"hpcllm: error (rank {launch_rank()}): another rank of the job went away during a "
        f"collective ({reason}); its own message says why",
        file=sys.stderr,
        flush=True,
    )
    _abort_mpi_job(1)
    return 1


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
