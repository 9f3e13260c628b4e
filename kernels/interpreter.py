"""Whether Triton's interpreter runs the kernels (on the CPU), as ``TRITON_INTERPRET`` asks."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """Return whether ``TRITON_INTERPRET`` asks for Triton's interpreter (kernels on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
