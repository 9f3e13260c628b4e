"""Turns a hang into an abort that says what this rank waited on: one watchdog thread per rank.

A rank that stops (SIGSTOP, a dead node, a wedged GPU) leaves the others in a collective or
a point-to-point receive for as long as the backend lets them: gloo's 30 minutes by default,
MPI's forever. The training thread marks each blocking phase with :func:`waiting`, for
example ``waiting("recv activation", axis="pp", peer=3, microbatch=5)``, and may add fields
for everything inside with :func:`at` (``at(step=12)``). The thread started by :func:`start`
checks about once a second and, when this rank has been in a waiting phase with no mark
entered or left for ``timeout_s`` seconds, prints one line naming that phase and every field
around it, appends it with the marks and every thread's Python traceback to
``hang-rank<R>.txt``, and aborts the whole job.

Progress is any entry into or exit from a mark, or a :func:`progress` call (each chunk a
checkpoint writes), so a long step made of many short waits never fires. Time where the
innermost mark is an :func:`at` or there is none (computing) never counts, nor time this
process itself spent stopped (a suspended job resumes); a wait that also computes (a whole
step) gets ``allow_s`` on top of the timeout. torch's and
Horovod's own timeouts, set to :func:`backstop_s`, end the job a little later if the watchdog
did not.

The marks are the training thread's: one stack, written by that thread only, read by the
watchdog. A mark costs two attribute writes and a list append or pop; with no watchdog
started it is a shared no-op.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The exit code of a job the watchdog ends.
HANG_EXIT = 1


@dataclass(frozen=True)
class Phase:
    """One mark: what the rank waits on (None: fields only), where (axis, peer, step…), since."""

    what: str | None
    where: dict[str, Any]
    started: float = field(default_factory=time.monotonic)
    allow_s: float = 0.0  # what the phase may take beyond the timeout (it computes too)


def describe(stack: tuple[Phase, ...]) -> str:
    """Return ``what (k=v, …)`` of the innermost mark, a wait, with the fields of all of them.

    The innermost mark's own fields come first; an outer one adds those it alone has
    (typically the step), so a receive reads ``recv activation (axis=pp, peer=3, step=12)``.
    """
    fields: dict[str, Any] = {}
    for phase in reversed(stack):
        for key, value in phase.where.items():
            fields.setdefault(key, value)
    where = ", ".join(f"{key}={value}" for key, value in fields.items())
    return f"{stack[-1].what} ({where})" if where else stack[-1].what


def backstop_s(timeout_s: float) -> float:
    """Return the timeout for torch's and Horovod's own checks, a little after the watchdog's.

    Both end a stalled job too, but with a backend's traceback; later, they leave the
    watchdog, which names the phase, to speak first, and still catch a wait it cannot see.
    """
    return timeout_s + max(5.0, timeout_s / 10)


def abort_job(code: int) -> None:
    """End the whole job: MPI_Abort when MPI runs with more than one rank, else this process."""
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        if mpi.COMM_WORLD.Get_size() > 1:
            mpi.COMM_WORLD.Abort(code)
    os._exit(code)


class Watchdog:
    """A daemon thread that aborts the job when this rank waits with no progress.

    ``timeout_s`` is read at every check, so it may be changed while the thread runs.
    ``fired`` holds the line it printed.
    """

    def __init__(
        self,
        timeout_s: float,
        rank: int,
        report_dir: Path | None = None,
        abort: Callable[[int], None] | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"the watchdog's timeout must be above 0 s, got {timeout_s}")
        self.timeout_s = timeout_s
        self.rank = rank
        self.report_dir = report_dir
        self.abort = abort or abort_job
        self.fired: str | None = None
        self._stack: list[Phase] = []
        # Written before a push and after a pop, so that the watchdog, which reads the stack
        # first, never pairs a new mark with the time of an old change.
        self._changed = time.monotonic()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hpcllm-watchdog", daemon=True)

    def enter(self, phase: Phase) -> None:
        """Push a mark (the training thread's only)."""
        self._changed = phase.started
        self._stack.append(phase)

    def leave(self) -> None:
        """Pop the innermost mark."""
        if self._stack:
            self._stack.pop()
        self._changed = time.monotonic()

    def progress(self) -> None:
        """Note progress inside a mark (a chunk of a long write) without leaving it."""
        self._changed = time.monotonic()

    def stop(self) -> None:
        """End the thread and wait for it (at most one check interval)."""
        self._stopped.set()
        atexit.unregister(self.stop)
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _interval(self) -> float:
        return min(1.0, self.timeout_s / 10)

    def _watch(self) -> None:
        credited, credit = self._changed, 0.0
        checked = time.monotonic()
        while not self._stopped.wait(self._interval()):
            now = time.monotonic()
            late, checked = now - checked - self._interval(), now
            stack = tuple(self._stack)
            changed = self._changed
            if changed != credited:
                credited, credit = changed, 0.0
            if late > 1.0:
                # This process was stopped (SIGSTOP, a suspended job) or starved: the time
                # it lost is not its peers' fault, and a resumed job must go on.
                credit += late
            idle = now - changed - credit
            waits = stack and stack[-1].what is not None
            budget = self.timeout_s + (stack[-1].allow_s if stack else 0.0)
            if waits and idle > budget and changed == self._changed:
                self._fire(stack, idle)
                return

    def _fire(self, stack: tuple[Phase, ...], idle: float) -> None:
        line = (
            f"hpcllm: error (rank {self.rank}): no progress for {idle:.0f} s while waiting on "
            f"{describe(stack)}; aborting the job"
        )
        self.fired = line
        print(line, file=sys.stderr, flush=True)
        self._report(line, stack)
        self.abort(HANG_EXIT)

    def _report(self, line: str, stack: tuple[Phase, ...]) -> None:
        """Append the line, the marks and every thread's traceback to the rank's report."""
        if self.report_dir is None:
            return
        now = time.monotonic()
        marks = "".join(
            f"  {'  ' * depth}{phase.what or 'at'} {phase.where} "
            f"entered {now - phase.started:.1f} s ago\n"
            for depth, phase in enumerate(stack)
        )
        # A report that cannot be written (full disk, dead mount) must not stop the abort.
        with contextlib.suppress(Exception):
            self.report_dir.mkdir(parents=True, exist_ok=True)
            path = self.report_dir / f"hang-rank{self.rank:05d}.txt"
            with open(path, "a") as report:
                report.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\nmarks:\n{marks}")
                report.flush()
                faulthandler.dump_traceback(report, all_threads=True)


_ACTIVE: list[Watchdog] = []  # the started one, if any
_IDLE = contextlib.nullcontext()


class _Mark:
    """The context of one :func:`waiting` or :func:`at` while a watchdog runs."""

    __slots__ = ("dog", "phase")

    def __init__(self, dog: Watchdog, phase: Phase) -> None:
        self.dog = dog
        self.phase = phase

    def __enter__(self) -> None:
        self.dog.enter(self.phase)

    def __exit__(self, *_: object) -> None:
        self.dog.leave()


def waiting(what: str, allow_s: float = 0.0, **where: Any) -> AbstractContextManager[None]:
    """Return a context that marks this rank as blocked on ``what`` (at ``where``) inside it.

    A phase that also computes or writes (a whole step, a save) passes ``allow_s``, what it
    may legitimately take on top of the timeout (the trainer passes twice the longest such
    phase so far), so only a wait well past its usual length fires.
    """
    if not _ACTIVE:
        return _IDLE
    return _Mark(_ACTIVE[0], Phase(what, where, allow_s=allow_s))


def progress() -> None:
    """Note progress without a mark (each chunk of a checkpoint write); cheap, no-op idle."""
    if _ACTIVE:
        _ACTIVE[0].progress()


def at(**where: Any) -> AbstractContextManager[None]:
    """Return a context that adds ``where`` to the waits inside it; it is not a wait itself."""
    if not _ACTIVE:
        return _IDLE
    return _Mark(_ACTIVE[0], Phase(None, where))


def start(
    timeout_s: float,
    rank: int,
    report_dir: Path | None = None,
    abort: Callable[[int], None] | None = None,
) -> Watchdog:
    """Return a running watchdog for this rank, replacing any started before.

    ``report_dir`` receives ``hang-rank<R>.txt`` when it fires; ``abort`` (default
    :func:`abort_job`) is called with the exit code. It stops at :meth:`Watchdog.stop` or at
    interpreter exit.
    """
    for old in _ACTIVE:
        old.stop()
    dog = Watchdog(timeout_s, rank, report_dir, abort)
    _ACTIVE[:] = [dog]
    atexit.register(dog.stop)
    dog._thread.start()
    return dog
