"""Random streams for dropout under tensor parallelism.

Two streams, as Megatron-LM keeps them:

- the default torch generator, seeded alike on every tp rank of a pipeline stage, draws the
  dropout of regions whose activations are replicated across the tp group (the residual
  stream without sequence parallelism, the embedding); the masks must then be identical, or
  the replicas would diverge;
- the tensor-parallel stream, seeded differently on each tp rank, draws the dropout of regions
  whose activations are split across the group (attention heads, and every sequence-parallel
  region); identical masks there would correlate the shards' noise.

:func:`tp_rng` swaps the tensor-parallel stream in for the default one. Activation
recomputation must replay both streams: torch's checkpoint restores the default one, and
:func:`recompute_context` (its ``context_fn``) restores the tensor-parallel one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

# Megatron-LM's offset between the default seed and the tensor-parallel one.
TP_SEED_OFFSET = 2718


class _Tracker:
    """The tensor-parallel stream's saved states (CPU, and the current CUDA device's)."""

    def __init__(self) -> None:
        self.cpu: torch.Tensor | None = None
        self.cuda: torch.Tensor | None = None

    @property
    def seeded(self) -> bool:
        return self.cpu is not None

    def states(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.cpu, self.cuda

    def restore(self, states: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
        self.cpu, self.cuda = states


_TRACKER = _Tracker()


def seed_streams(
    seed: int, tp_rank: int = 0, pp_rank: int = 0, device: torch.device | None = None
) -> None:
    """Seed the default stream (same on tp ranks) and the tensor-parallel one (per tp rank).

    Pipeline stages get different streams; data-parallel replicas share them, as in
    Megatron-LM (their data differs). On a CUDA ``device`` (the current one) its generator is
    seeded too.
    """
    default_seed = seed + 100 * pp_rank
    tp_seed = default_seed + TP_SEED_OFFSET + tp_rank
    on_cuda = device is not None and device.type == "cuda"
    torch.manual_seed(tp_seed)  # seeds the CPU and every CUDA generator
    _TRACKER.restore((torch.get_rng_state(), torch.cuda.get_rng_state() if on_cuda else None))
    torch.manual_seed(default_seed)


def tp_stream_state() -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Return the tensor-parallel stream's state (CPU, CUDA) for :func:`set_tp_stream_state`."""
    return _TRACKER.states()


def set_tp_stream_state(state: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
    """Put back a state that :func:`tp_stream_state` returned."""
    _TRACKER.restore(state)


def _cuda_state() -> torch.Tensor | None:
    return torch.cuda.get_rng_state() if _TRACKER.cuda is not None else None


@contextlib.contextmanager
def tp_rng(group: Any) -> Iterator[None]:
    """Draw from the tensor-parallel stream inside the block (a no-op with one tp rank)."""
    if group is None or torch.distributed.get_world_size(group) == 1:
        yield
        return
    if not _TRACKER.seeded:
        raise RuntimeError(
            "dropout in a tensor-parallel region needs hpcllm.parallel.random.seed_streams() first"
        )
    cpu, cuda = torch.get_rng_state(), _cuda_state()
    torch.set_rng_state(_TRACKER.cpu)
    if cuda is not None and _TRACKER.cuda is not None:
        torch.cuda.set_rng_state(_TRACKER.cuda)
    try:
        yield
    finally:
        _TRACKER.restore((torch.get_rng_state(), _cuda_state()))
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)


class _Replay:
    """Puts the tensor-parallel stream back to ``saved`` for a recomputation, then restores it.

    A class, not a generator: a checkpointed block is recomputed once per backward pass that
    reaches it, and zb-h1 runs two (input gradients, then weight gradients).
    """

    def __init__(self, saved: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
        self.saved = saved
        self.now: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []

    def __enter__(self) -> None:
        self.now.append(_TRACKER.states())
        _TRACKER.restore(self.saved)

    def __exit__(self, *_: object) -> None:
        _TRACKER.restore(self.now.pop())


def recompute_context() -> tuple[
    contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]
]:
    """``context_fn`` for ``torch.utils.checkpoint``: recompute with the tp stream's state then.

    Called when the checkpointed forward starts; every recomputation in backward draws the
    same tensor-parallel masks as that forward did, and the stream continues afterwards from
    where it stood before the recomputation.
    """
    return contextlib.nullcontext(), _Replay(_TRACKER.states())
