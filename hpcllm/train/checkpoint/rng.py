"""Random states in a checkpoint: every generator a step may draw from, in types that
``torch.load(weights_only=True)`` reads."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from hpcllm.parallel.random import set_tp_stream_state, tp_stream_state


def rng_state(device: torch.device) -> dict[str, Any]:
    """Return every RNG state a step may draw from, in types ``weights_only`` loading reads.

    Python's state is a tuple of ints (and None or a float), which it reads as is; numpy's
    tuple holds an ndarray, so its parts are stored by name, the keys as an int64 tensor.
    """
    state = {
        "torch": torch.get_rng_state(),
        "numpy": numpy_state(np.random.get_state()),
        "python": random.getstate(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    tp_cpu, tp_cuda = tp_stream_state()
    if tp_cpu is not None:  # this tp rank's own stream (dropout in split regions)
        state["tp_stream"] = {"torch": tp_cpu}
        if tp_cuda is not None:
            state["tp_stream"]["cuda"] = tp_cuda
    return state


def numpy_state(state: tuple[Any, ...]) -> dict[str, Any]:
    bit_generator, keys, pos, has_gauss, cached_gaussian = state
    return {
        "bit_generator": bit_generator,
        "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    saved = state["numpy"]
    np.random.set_state(
        (
            saved["bit_generator"],
            saved["keys"].numpy().astype(np.uint32),
            saved["pos"],
            saved["has_gauss"],
            saved["cached_gaussian"],
        )
    )
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    stream = state.get("tp_stream")
    if stream is not None:  # else (older checkpoints) the stream keeps its fresh seed
        _, tp_cuda = tp_stream_state()
        if device.type == "cuda" and stream.get("cuda") is not None:
            tp_cuda = stream["cuda"]
        set_tp_stream_state((stream["torch"], tp_cuda))


class RandomStates:
    """The random states as a named part of a checkpoint (``rng``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        return rng_state(self.device)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_rng_state(state, self.device)
