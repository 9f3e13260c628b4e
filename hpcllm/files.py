"""Files that appear whole or not at all, and survive a node crash once written.

Readers (a resumed run, ``hpcllm train`` reading a manifest, ``hpcllm timeline``) only ever
see a final name, so every writer goes through a hidden sibling and a rename. The fsyncs make
the data reach the disk before the rename, and the rename itself durable: without them a node
crash (not just a killed process) could leave the final name pointing at data that never left
the page cache.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hpcllm.user_error import UserError


def fs_error(operation: str, path: Path, err: OSError) -> UserError:
    """Return a one-line UserError for a failed file-system ``operation`` on ``path``."""
    reason = err.strerror or str(err)
    return UserError(f"cannot {operation} {path}: {reason}")


@contextmanager
def fs_errors(operation: str, path: Path) -> Iterator[None]:
    """Turn an OSError inside into :func:`fs_error`'s one line."""
    try:
        yield
    except OSError as err:
        raise fs_error(operation, path, err) from None


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's data and metadata to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_replace(src: Path, dst: Path) -> None:
    """Rename ``src`` (a file or a folder) to ``dst`` after its data reached the disk.

    The folder holding ``dst`` is flushed too, so the rename outlives a crash.
    """
    fsync_path(src)
    os.replace(src, dst)
    fsync_path(dst.parent)


# The host is part of a partial name: on a file system shared by nodes, a process id says
# whether its writer is alive only on the writer's own host.
HOST = socket.gethostname()
_PARTIAL = re.compile(r"^\.(?P<name>.+)\.partial-(?P<host>.+)-(?P<pid>\d+)$")


def partial_path(path: Path) -> Path:
    """Return the hidden sibling that ``path`` is written to before it is renamed into place.

    ``.NAME.partial-HOST-PID``: the host and process id keep two writers of the same name
    apart, and tell :func:`sweep_partials` whether the writer is still alive.
    """
    return path.with_name(f".{path.name}.partial-{HOST}-{os.getpid()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _say(message: str) -> None:
    print(f"hpcllm: {message}", file=sys.stderr, flush=True)


def sweep_partials(folder: Path, say: Callable[[str], None] = _say) -> list[Path]:
    """Remove the partial files and folders (:func:`partial_path`) in ``folder`` whose writer, a
    process of this host, has ended (killed before its rename); return them.

    A partial of another host, or of a live process, is left alone: it may be being written.
    Each removal is one line through ``say``.
    """
    removed = []
    if not Path(folder).is_dir():
        return removed
    for entry in sorted(Path(folder).iterdir()):
        match = _PARTIAL.match(entry.name)
        if match is None or match["host"] != HOST or _alive(int(match["pid"])):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        say(f"removed {entry}, left by process {match['pid']} of this host, which has ended")
        removed.append(entry)
    return removed


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` holds either its old content or all of it.

    Text is written as UTF-8. The partial file is removed if writing fails.
    """
    path = Path(path)
    partial = partial_path(path)
    try:
        with open(partial, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        durable_replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def umask() -> int:
    """Return the process's umask without changing it (Linux reports it in /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: read it by setting it, and put it back at once
    os.umask(mask)
    return mask


def honour_umask(path: Path) -> None:
    """Give a file the mode ``open()`` would have (0666 less the umask).

    For files that a library writes with a mode of its own (safetensors writes 0600).
    """
    os.chmod(path, 0o666 & ~umask())


@contextmanager
def new_folder(final: Path) -> Iterator[Path]:
    """Yield a hidden folder to fill; it becomes ``final`` only if the block completes.

    ``final`` must not exist, or be an empty folder. Every file is flushed to disk before the
    rename, so a reader (or a crash) sees the whole folder or none of it.
    """
    final = Path(final)
    if final.exists() and not (final.is_dir() and not any(final.iterdir())):
        raise UserError(f"{final} exists and is not an empty folder; name a new folder")
    sweep_partials(final.parent)  # what a killed writer of a folder here left
    partial = partial_path(final)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        yield partial
        for path in partial.rglob("*"):
            if path.is_file():
                fsync_path(path)
        if final.exists():
            final.rmdir()
        durable_replace(partial, final)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
