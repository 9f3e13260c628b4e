"""A file on a full disk, for injecting ENOSPC into writers without root or a device node.

``/dev/full`` would do the same, but not every machine has it (a minimal container's /dev
may lack it), and opening it for writing where it is missing creates a plain file there.
"""

from __future__ import annotations

import errno
import io
import os
from typing import Any


class _NoSpace(io.FileIO):
    """Opens like a file; every write fails as on a full disk."""

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def open_on_full_disk(path: Any, mode: str = "w", *args: Any, **kwargs: Any) -> Any:
    """Return what ``open(path, mode)`` returns, except that writing fails with ENOSPC."""
    raw = _NoSpace(path, "w")
    buffered = io.BufferedWriter(raw)
    if "b" in mode:
        return buffered
    return io.TextIOWrapper(buffered, encoding=kwargs.get("encoding") or "utf-8")
