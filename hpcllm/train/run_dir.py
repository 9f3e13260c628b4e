"""The run folder: one run at a time, and nothing an earlier run wrote is ever deleted.

A run takes the folder's lock before it writes anything there (rank 0, for the whole job):
:mod:`hpcllm.folder_lock`'s ``fcntl`` lock on ``RUN_DIR/.hpcllm.lock``, which holds the
holder's host and pid. A second job on the same folder exits 2 naming the first. The kernel
drops an ``fcntl`` lock when its process dies, so a lock file left by a dead job is taken over
(with a warning). Where the file system has no ``fcntl`` locks (some Lustre and NFS mounts),
the lock is the exclusive creation of ``RUN_DIR/.hpcllm.lock.excl`` instead; such a file left
by a dead job on this host is taken over, one from another host must be removed by hand (the
message says which file).

``run.resume: none`` over a folder that holds checkpoints refuses, unless ``run.overwrite:
true``: then the old run moves aside to ``RUN_DIR.old-YYYYmmdd-HHMMSS`` whole, never deleted.
File-system failures (missing or read-only parent, no permission, a file where a folder
should be, a full disk) are one line naming the path and the operation.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hpcllm.errors import UserError
from hpcllm.files import fs_error as fs_error  # run_dir.fs_error: the run's callers use it
from hpcllm.files import fs_errors
from hpcllm.folder_lock import (
    EXCLUSIVE_LOCK,
    LOCK,
    FolderLock,
    Wording,
    alive_here,
    describe,
    take,
)

# The files beside the checkpoints that say what a run's token ids mean: its tokenizer (and a
# Hugging Face tokenizer's BOS/EOS), the synthetic-data record, the config.json of a Hugging
# Face import (its BOS/EOS ids when it came without a tokenizer). A re-cut carries them.
IMPORTED_CONFIG = "hf_config.json"  # the config.json of a Hugging Face import
MEANING_FILES = ("tokenizer.json", "tokenizer_config.json", "synthetic-data.json", IMPORTED_CONFIG)


def copy_meaning_files(source: Path, folder: Path) -> None:
    """Copy ``source``'s :data:`MEANING_FILES` that exist into ``folder`` (with the umask's
    modes, not the sources')."""
    for name in MEANING_FILES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, Path(folder) / name)


def has_metrics(run_dir: Path) -> bool:
    """Return whether ``run_dir`` holds the logged metrics of an earlier run."""
    path = run_dir / "metrics.jsonl"
    return path.is_file() and path.stat().st_size > 0


def has_checkpoints(run_dir: Path) -> bool:
    """Return whether ``run_dir`` holds a finished checkpoint of an earlier run (or its
    ``latest``): one a run could continue from. An unfinished one (``.step_N.partial``, a save
    that was killed) is not: a run that would resume from it starts over."""
    folder = run_dir / "checkpoints"
    return folder.is_dir() and any(
        p.name.startswith("step_") or p.name == "latest" for p in folder.iterdir()
    )


def unfinished_checkpoints(run_dir: Path) -> list[Path]:
    """Return the checkpoints a killed save left unfinished in ``run_dir``."""
    folder = run_dir / "checkpoints"
    return sorted(folder.glob(".step_*.partial")) if folder.is_dir() else []


def lock_holder(run_dir: Path) -> str | None:
    """Return who holds ``run_dir``'s lock file, and whether it still runs (when that can be
    told from here); None where there is no lock file."""
    try:
        text = (run_dir / LOCK).read_text()
    except OSError:
        return None
    alive = alive_here(text)
    state = {True: "running", False: "not running: the next run takes the lock over"}
    known = f" ({state[alive]})" if alive is not None else ""
    return f"{run_dir / LOCK} held by {describe(text)}{known}"


@dataclass
class RunLock:
    """This job's hold on a run folder; :meth:`release` when the run ends."""

    held: FolderLock
    users: int = 1  # trainers of this process holding it (the lock is the process's)
    moved_aside: Path | None = None  # where claim() moved an earlier run

    @property
    def path(self) -> Path:
        """Return the lock file."""
        return self.held.path

    def undo_move(self) -> None:
        """Put an earlier run that :func:`claim` moved aside back (a run that failed to start).

        Called after :meth:`release`, which removed the new folder if the run left it empty.
        """
        if self.moved_aside is None:
            return
        original = self.path.parent
        if not original.exists():
            with contextlib.suppress(OSError):
                self.moved_aside.rename(original)
        self.moved_aside = None

    def release(self) -> None:
        """Give the folder up, leaving no lock file, once its last user in this process does.

        The lock file is removed while still held, so a job that starts later finds none; a
        folder this run created and left empty (a run rejected during set-up) goes too.
        """
        if self.users == 0:
            return
        self.users -= 1
        if self.users:
            return
        _HELD.pop(self.path.parent.resolve(), None)
        self.held.release()


_WORDING = Wording(writer="run", folder="run folder", instead="give this run another run.dir")

# Folders this process holds: a second trainer of the same process (tests, notebooks) shares
# the hold instead of locking itself out.
_HELD: dict[Path, RunLock] = {}


def lock(run_dir: Path, warn: Callable[[str], None]) -> RunLock:
    """Take ``run_dir``'s lock (creating the folder), or raise a UserError naming its holder."""
    held = _HELD.get(run_dir.resolve())
    if held is not None and held.users:
        held.users += 1
        return held
    taken = RunLock(take(run_dir, warn, _WORDING))
    _HELD[run_dir.resolve()] = taken
    return taken


def move_aside(run_dir: Path) -> Path:
    """Rename ``run_dir`` to ``RUN_DIR.old-YYYYmmdd-HHMMSS`` (a free name); return the new path."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{n}")
    with fs_errors("move the earlier run aside to", target):
        run_dir.rename(target)
    return target


def claim(run_dir: Path, resume: str, overwrite: bool, warn: Callable[[str], None]) -> RunLock:
    """Make ``run_dir`` this run's (rank 0 only): lock it, moving an earlier run aside if asked.

    An earlier run (checkpoints, or logged metrics) that this run would not continue
    (``resume: none``, or no checkpoint to resume from) refuses unless ``overwrite``; then the
    earlier run is locked first (it must not be running), moved aside whole, and a fresh
    folder is locked. Should this run fail to start, :meth:`RunLock.undo_move` puts it back.
    """
    checkpoints = has_checkpoints(run_dir)
    earlier = checkpoints or has_metrics(run_dir)
    if earlier and (resume == "none" or not checkpoints):
        if not overwrite:
            unfinished = unfinished_checkpoints(run_dir)
            killed = (
                f" (only {unfinished[-1].name}, a save that did not finish)" if unfinished else ""
            )
            what = (
                "checkpoints of an earlier run and run.resume is none; set run.resume=auto "
                "to continue it,"
                if checkpoints
                else "the metrics of an earlier run but no checkpoint to continue from"
                + killed
                + "; set"
            )
            raise UserError(
                f"{run_dir} holds {what} run.overwrite=true to move it aside "
                f"({run_dir.name}.old-<time>) and start over, or another run.dir"
            )
        earlier = lock(run_dir, warn)
        try:
            moved = move_aside(run_dir)
        finally:
            earlier.release()
        for name in (LOCK, EXCLUSIVE_LOCK):
            with contextlib.suppress(OSError):
                (moved / name).unlink()
        warn(f"moved the earlier run in {run_dir} aside to {moved}")
        held = lock(run_dir, warn)
        held.moved_aside = moved
        return held
    return lock(run_dir, warn)
