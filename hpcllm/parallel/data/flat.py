"""Flat buffers and broadcasts that several data-parallel engines share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Return the tensors' values, detached, one after the other in one 1-D tensor."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``targets``, in order (their shapes)."""
    offset = 0
    for target in targets:
        n = target.numel()
        target.copy_(flat[offset : offset + n].view_as(target))
        offset += n


def broadcast_parameters(params: Sequence[torch.Tensor], root: int, group: Any) -> None:
    """Give every rank of ``group`` the world rank ``root``'s values of ``params``, in one
    broadcast of their flattened values."""
    with torch.no_grad():
        flat = flatten(params)
        dist.broadcast(flat, src=root, group=group)
        unflatten_into(flat, [p.data for p in params])
