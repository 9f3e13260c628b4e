"""The FLOPs of a training step: pure arithmetic, shared by the trainer and the planner.

Each model family gives its own count (:attr:`hpcllm.families.Family.step_flops`); GPT-2's
follows Narayanan et al. (SC21), eq. 3 (:mod:`hpcllm.families.gpt2`). ``tflops_per_gpu``
counts the work done (recomputation included, as the paper reports it); ``mfu`` divides the
model's FLOPs (no recomputation) by the device's peak, as Chowdhery et al. (PaLM) define it.
"""

from __future__ import annotations

from typing import Any

from hpcllm import families
from hpcllm.config import moe_layers


def model_step_flops(model: Any, batch: int, vocab: int, recompute: str = "none") -> float:
    """Return the FLOPs of one training step on ``batch`` sequences of ``model`` (a
    ``cfg.model``), with every size its family reads (GQA's kv heads, the MLP's width), and
    its mixture-of-experts blocks (:func:`moe_flops_delta`)."""
    family = families.get(model.arch)
    shape = families.shape(model, vocab)
    return family.step_flops(batch, shape, recompute) + moe_flops_delta(model, batch, recompute)


def moe_flops_delta(model: Any, batch: int, recompute: str = "none") -> float:
    """Return what the MoE blocks of ``model`` add to a step's FLOPs over the dense model's.

    Each MoE block trades its dense MLP (width f, m matrices: 2·m·T·h·f forward for T tokens)
    for the router (2·T·h·E), the k experts each token goes to (2·m·T·h·k·fₑ), the shared
    expert (2·m·T·h·fₛ) and its gate (2·T·h): the active parameters' work, as MFU counts it
    (Switch Transformers; Megatron-Core's MoE FLOPs). Dropped tokens are still counted.
    Backward is twice the forward; full recomputation adds a forward.
    """
    blocks = len(moe_layers(model))
    if not blocks:
        return 0.0
    family = families.get(model.arch)
    shape = families.shape(model, 1)
    h, m, tokens = shape.hidden, family.mlp_matrices, batch * shape.seq
    dense = shape.ffn or 4 * h
    routed = model.moe_top_k * (model.moe_ffn_size or dense)
    forward = (
        2.0
        * tokens
        * h
        * (
            model.moe_experts
            + m * (routed + model.moe_shared_ffn_size - dense)
            + (1 if model.moe_shared_gate else 0)
        )
    )
    return blocks * forward * (4 if recompute == "full" else 3)
