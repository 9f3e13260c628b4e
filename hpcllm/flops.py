"""The FLOPs of a GPT training step: pure arithmetic, shared by the trainer and the planner.

FLOPs follow Narayanan et al. (SC21), eq. 3: a GPT step on B sequences of s tokens with l
layers, hidden size h and vocabulary V costs

    72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))      without recomputation,
    96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))      with full recomputation (one more forward of
                                                 every layer; the output layer is not redone).

Selective recomputation redoes only the attention core, 4·B·s²·h per layer. ``tflops_per_gpu``
counts the work done (recomputation included, as the paper reports it); ``mfu`` divides the
model's FLOPs (the 72· count) by the device's peak, as Chowdhery et al. (PaLM) define it.
"""

from __future__ import annotations


def step_flops(
    batch: int, seq_len: int, n_layer: int, d_model: int, vocab: int, recompute: str = "none"
) -> float:
    """Return the FLOPs of one training step on ``batch`` sequences (Megatron's count)."""
    b, s, layers, h, v = batch, seq_len, n_layer, d_model, vocab
    if recompute == "full":
        return 96.0 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    flops = 72.0 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))
    if recompute == "selective":
        flops += 4.0 * b * s * s * h * layers
    return flops
