"""Data-parallel engines behind one interface (``parallel.dp_engine``).

An engine wraps the model for forward/backward, says how to skip gradient reduction during
accumulation, and finishes the reduction before the optimizer steps. This version has
PyTorch DDP; Horovod and the single-parameter-server baseline plug in behind the same methods.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from hpcllm.errors import UserError


class DDPEngine:
    """PyTorch DistributedDataParallel over the grid's data-parallel group.

    Gradients are all-reduced in buckets while backward runs; during gradient accumulation
    the reduction is skipped (``no_sync``) until the last micro-batch. With d = 1 the model is
    used as it is.
    """

    name = "ddp"

    def __init__(self, model: nn.Module, grid: Any, bucket_mb: float) -> None:
        self.model = model
        self.module: nn.Module = model
        if grid.dp > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.module = DistributedDataParallel(
                model, device_ids=[grid.device] if grid.device.type == "cuda" else None,
                process_group=grid.dp_group, bucket_cap_mb=bucket_mb,
                gradient_as_bucket_view=True)

    def accumulate(self, last_micro_batch: bool) -> Any:
        """Return the context for one micro-batch's backward (no reduction unless last)."""
        if last_micro_batch or self.module is self.model:
            return contextlib.nullcontext()
        return self.module.no_sync()

    def finish_gradients(self) -> None:
        """Wait for the gradient reduction (DDP finishes it inside the last backward)."""


def build_engine(name: str, model: nn.Module, grid: Any, bucket_mb: float) -> DDPEngine:
    """Return the data-parallel engine ``parallel.dp_engine`` names."""
    if name == "ddp":
        return DDPEngine(model, grid, bucket_mb)
    raise UserError(f"parallel.dp_engine: {name} is not available yet in this version; "
                    "use ddp")
