"""One writer at a time in a folder: a training run in its run folder, ``hpcllm prepare`` in its
``--out``.

A writer takes the folder's lock before it writes anything there: an ``fcntl`` lock on
``FOLDER/.hpcllm.lock``, which holds the holder's host, pid and start time. A second writer is
refused in one line naming the first. The kernel drops an ``fcntl`` lock when its process dies,
so a lock file left by a dead writer is taken over (with a warning). Where the file system has
no ``fcntl`` locks (some Lustre and NFS mounts), the lock is the exclusive creation of
``FOLDER/.hpcllm.lock.excl`` instead; such a file left by a dead writer of this host is taken
over, one from another host must be removed by hand (the message says which file).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hpcllm.files import fs_error, fs_errors
from hpcllm.user_error import UserError

LOCK = ".hpcllm.lock"
EXCLUSIVE_LOCK = ".hpcllm.lock.excl"
# errnos meaning "this file system has no fcntl locks"
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


@dataclass(frozen=True)
class Wording:
    """How a lock's messages name its writers and its folder."""

    writer: str  # "run": "RUN_DIR is in use by another run (...)"
    folder: str  # "run folder": "cannot create the run folder RUN_DIR: ..."
    instead: str  # "give this run another run.dir": the way out of a refusal


@dataclass
class FolderLock:
    """This process's hold on a folder; :meth:`release` gives it up."""

    path: Path  # the lock file
    fd: int | None  # the fcntl-locked file, or None for the exclusive-create file
    created_folder: bool = False  # take() created the folder

    def release(self) -> None:
        """Give the folder up, leaving no lock file.

        The lock file is removed while still held, so a writer that starts later finds none; a
        folder that :func:`take` created and that is still empty (a writer refused during its
        set-up) goes too.
        """
        with contextlib.suppress(OSError):
            self.path.unlink()
        if self.fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
                os.close(self.fd)
            self.fd = None
        if self.created_folder:
            self.created_folder = False
            with contextlib.suppress(OSError):
                self.path.parent.rmdir()  # only if empty


def holder_record() -> dict[str, object]:
    """Return what a lock file says of its holder: this process."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}


def describe(text: str) -> str:
    """Return the holder a lock file's ``text`` names, as ``pid N on HOST since TIME``."""
    try:
        holder = json.loads(text)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"]))
        return f"pid {holder['pid']} on {holder['host']} since {when}"
    except (ValueError, KeyError, TypeError):
        return "an unknown process"


def alive_here(text: str) -> bool | None:
    """Return whether the holder in ``text`` runs on this host (None: another host, unknown)."""
    try:
        holder = json.loads(text)
    except ValueError:
        return False
    if not isinstance(holder, dict):
        return False
    if holder.get("host") != socket.gethostname():
        return None
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, TypeError, ValueError):
        return True
    return True


def read_lock(path: Path) -> str:
    """Return a lock file's text ('' where there is none or it cannot be read)."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def take(folder: Path, warn: Callable[[str], None], wording: Wording) -> FolderLock:
    """Take ``folder``'s lock (creating the folder), or raise a UserError naming its holder.

    The holder of a lock left by a dead process is named through ``warn`` as it is taken over.
    """
    created = not folder.exists()
    with fs_errors(f"create the {wording.folder}", folder):
        folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK
    while True:
        with fs_errors("open the lock file", path):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            previous = read_lock(path)
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UserError(
                    f"{folder} is in use by another {wording.writer} ({describe(previous)}); "
                    f"wait for it, or {wording.instead}"
                ) from None
            if err.errno in _NO_LOCKS:
                held = _exclusive_lock(folder, warn, wording)
                held.created_folder = created
                with contextlib.suppress(OSError):
                    path.unlink()
                return held
            raise fs_error("lock", path, err) from None
        if os.fstat(fd).st_ino == os.stat(path).st_ino:
            break
        # The holder removed the file between our open and our lock (it was releasing): the
        # lock we got is on a file nobody else will look at. Start over.
        os.close(fd)
    previous = read_lock(path)
    if previous.strip():
        warn(f"taking over the lock of {folder} from {describe(previous)}, no longer running")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder_record()).encode(), 0)
    except OSError as err:
        os.close(fd)  # and with it the lock
        raise fs_error("write the lock file", path, err) from None
    return FolderLock(path, fd, created)


def _exclusive_lock(folder: Path, warn: Callable[[str], None], wording: Wording) -> FolderLock:
    """The lock of a file system without fcntl locks: create a file that must not exist."""
    path = folder / EXCLUSIVE_LOCK
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            previous = read_lock(path)
            alive = alive_here(previous)
            if alive is False:
                warn(f"taking over the lock of {folder} from {describe(previous)}, gone")
                with fs_errors("remove the stale lock file", path):
                    path.unlink()
                continue
            where = "" if alive else f"; if that job has ended, remove {path}"
            raise UserError(
                f"{folder} is in use by another {wording.writer} ({describe(previous)}){where}"
            ) from None
        except OSError as err:
            raise fs_error("create the lock file", path, err) from None
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(holder_record()))
        return FolderLock(path, None)
    raise UserError(f"cannot take the lock {path}: it keeps reappearing")
