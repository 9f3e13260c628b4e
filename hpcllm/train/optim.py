"""AdamW with decay on matrices only, warm-up + cosine LR, the linear scaling rule, precision.

Large-batch data parallelism (Goyal et al., 2017): scale the LR with the global batch and
warm up to it. ``train.lr_scaling: linear`` multiplies ``train.lr`` by global batch /
``train.lr_reference_batch``, the batch the LR was tuned for.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from hpcllm.config import TrainConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def peak_lr(train: TrainConfig, global_batch: int) -> float:
    """Return the LR after warm-up, scaled by the linear rule when asked."""
    if train.lr_scaling == "linear":
        return train.lr * global_batch / train.lr_reference_batch
    return train.lr


def lr_at(step: int, train: TrainConfig, global_batch: int) -> float:
    """Return the LR of step ``step`` (0-based): linear warm-up, then cosine to the minimum."""
    top = peak_lr(train, global_batch)
    bottom = train.min_lr * top / train.lr
    if step < train.warmup_steps:
        return top * (step + 1) / train.warmup_steps
    decay_steps = (train.lr_decay_steps or train.steps) - train.warmup_steps
    if decay_steps <= 0:
        return top
    progress = min(1.0, (step - train.warmup_steps) / decay_steps)
    return bottom + 0.5 * (top - bottom) * (1 + math.cos(math.pi * progress))


def build_optimizer(
    model: nn.Module, train: TrainConfig, device: torch.device
) -> torch.optim.AdamW:
    """Return AdamW over ``model``: weight decay on matrices (≥ 2-D) only, fused.

    Fused (one multi-tensor kernel, on CUDA and CPU alike) also takes a skipped step's verdict
    on the device (:meth:`~hpcllm.parallel.data.optimizer.MixedPrecisionOptimizer.step`).
    """
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.adam_eps, fused=True
    )


# How a param group runs, not what it computes: a checkpoint's values are not restored.
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load ``state`` into ``optimizer``, keeping the optimizer's implementation (fused, …).

    ``load_state_dict`` takes every setting of the saved param groups, so a checkpoint of a
    foreach optimizer would turn a fused one back into foreach.
    """
    keep = [{k: g[k] for k in IMPLEMENTATION_KEYS if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, implementation in zip(optimizer.param_groups, keep, strict=True):
        group.update(implementation)


def build_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """Return a GradScaler, enabled for fp16 only (bf16 has fp32's range and needs none)."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def autocast(precision: str, device: torch.device) -> Any:
    """Return the autocast context for ``precision`` (disabled for fp32); weights stay fp32."""
    return torch.autocast(device.type, dtype=DTYPES[precision], enabled=precision != "fp32")


def step_autocast_cache(precision: str, device: torch.device) -> Any:
    """Return a context around a whole step that keeps autocast's weight casts between forwards.

    torch drops autocast's cache of half-precision weight copies when the outermost autocast
    context exits, so with one context per forward every micro-batch casts every weight again.
    A disabled autocast context around the step keeps one nesting level open: each weight is
    cast once per step (its fp32 value does not change until the optimizer steps), and the
    backwards between the forwards still run outside autocast.
    """
    return torch.autocast(device.type, enabled=False) if precision != "fp32" else nullcontext()
