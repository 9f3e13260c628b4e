"""What a rank's memory holds for training, by part: weights, gradients, optimizer state.

The same parts ``hpcllm plan`` predicts (:func:`hpcllm.plan.costs.memory_parts`), counted from
the tensors themselves, so a user sees what the distributed optimizer saves. Activations are
not tensors that live between steps: on CUDA the step's peak allocation less these parts
stands for them (``peak_other``); on CPU there is no allocator to ask.
"""

from __future__ import annotations

from typing import Any

import torch

from hpcllm.parallel.data.engine import Engine
from hpcllm.parallel.data.optimizer import MixedPrecisionOptimizer


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | MixedPrecisionOptimizer) -> int:
    """Return the bytes of the optimizer's state tensors as they are now."""
    return sum(_bytes(state.values()) for state in optimizer.state.values())


def adamw_state_bytes(optimizer: torch.optim.Optimizer | MixedPrecisionOptimizer) -> int:
    """Return the bytes AdamW's state will hold once it has stepped (it is made lazily):
    two fp32 moments per element and one fp32 step per tensor."""
    return sum(2 * p.numel() * 4 + 4 for group in optimizer.param_groups for p in group["params"])


def memory_parts(
    engine: Engine, optimizer: MixedPrecisionOptimizer, device: torch.device
) -> dict[str, int]:
    """Return this rank's bytes of weights, gradients and optimizer state (and on CUDA the
    step's peak allocation beyond them, ``peak_other``).

    Before the optimizer's first step its state is counted as it will be
    (:func:`adamw_state_bytes`); a rank that never steps (the parameter server's workers)
    holds none.
    """
    weights, gradients = engine.buffer_bytes()
    if not optimizer.holds_state:
        state = 0
    elif optimizer.state:
        state = optimizer_state_bytes(optimizer) + engine.master_bytes()
    else:
        state = adamw_state_bytes(optimizer) + engine.master_bytes()
    parts = {"weights": weights, "gradients": gradients, "optimizer": state}
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        parts["peak_other"] = max(0, peak - weights - gradients - state)
    return parts


def describe(parts: dict[str, int], dp: int, distributed: bool) -> str:
    """Return the parts as one line of MB, for the banner."""
    text = (
        f"weights {parts['weights'] / 1e6:.1f} MB, gradients {parts['gradients'] / 1e6:.1f} MB, "
        f"optimizer state {parts['optimizer'] / 1e6:.1f} MB"
    )
    if distributed:
        text += f" (1/{dp} of it per rank: distributed optimizer)"
    return text
