"""Files that appear whole or not at all, and survive a node crash once written.

Readers (a resumed run, ``hpcllm train`` reading a manifest, ``hpcllm timeline``) only ever
see a final name, so every writer goes through a hidden sibling and a rename. The fsyncs make
the data reach the disk before the rename, and the rename itself durable: without them a node
crash (not just a killed process) could leave the final name pointing at data that never left
the page cache.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hpcllm.user_error import UserError


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


def partial_path(path: Path) -> Path:
    """Return the hidden sibling that ``path`` is written to before it is renamed into place.

    The process id keeps two processes that write the same name from sharing a partial file;
    ``.NAME.partial-PID`` is what ``hpcllm prepare`` sweeps away before it starts again.
    """
    return path.with_name(f".{path.name}.partial-{os.getpid()}")


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
