"""The FLOPs of a training step: pure arithmetic, shared by the trainer and the planner.

Each model family gives its own count (:attr:`hpcllm.families.Family.step_flops`); GPT-2's
follows Narayanan et al. (SC21), eq. 3 (:mod:`hpcllm.families.gpt2`). ``tflops_per_gpu``
counts the work done (recomputation included, as the paper reports it); ``mfu`` divides the
model's FLOPs (no recomputation) by the device's peak, as Chowdhery et al. (PaLM) define it.
"""

from __future__ import annotations

from typing import Any

from hpcllm import families


def model_step_flops(model: Any, batch: int, vocab: int, recompute: str = "none") -> float:
    """Return the FLOPs of one training step on ``batch`` sequences of ``model`` (a
    ``cfg.model``), with every size its family reads (GQA's kv heads, the MLP's width)."""
    return families.get(model.arch).step_flops(batch, families.shape(model, vocab), recompute)
