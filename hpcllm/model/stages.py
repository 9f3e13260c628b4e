"""A model cut into pipeline stages: which blocks each stage holds, and the tied embedding.

Stage k of S = p·v holds a contiguous run of blocks; the first also holds the embedding, the
last the final LayerNorm and the output layer, which is tied to the embedding. When those
two stages sit on different ranks each keeps a copy of the embedding and, as Megatron-LM
does, their gradients are all-reduced between the two before the optimizer step, so the
copies stay equal. The last stage's copy is the stage copy (:mod:`hpcllm.parallel.roles`), so
the global gradient norm counts it once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from hpcllm import families
from hpcllm.config import ModelConfig
from hpcllm.model import build
from hpcllm.parallel.roles import tie_across_stages


def split_layers(n_layer: int, stages: int, given: Sequence[int] | None = None) -> list[range]:
    """Return each stage's block indices: ``given`` counts per stage, or as even as can be.

    With uneven division the earlier stages take one block fewer (the first holds the
    embedding, the last the output layer, so the middle ones may take the extra blocks);
    raises ValueError when the counts do not add up.
    """
    if given:
        counts = list(given)
        if len(counts) != stages or sum(counts) != n_layer or min(counts) < 1:
            raise ValueError(
                f"parallel.pipeline_layers {counts} must give each of the {stages} stages "
                f"(p x vpp) at least one block, adding up to model.n_layer {n_layer}"
            )
    else:
        if n_layer < stages:
            raise ValueError(
                f"model.n_layer {n_layer} is fewer than the {stages} pipeline "
                f"stages (p x vpp); every stage needs a block"
            )
        base, extra = divmod(n_layer, stages)
        counts = [base + (1 if k >= stages - extra else 0) for k in range(stages)]
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def build_chunks(
    cfg: ModelConfig,
    vocab_size: int,
    *,
    p: int,
    rank: int,
    v: int,
    tp_group: Any,
    seed: int,
    sequence_parallel: bool,
    layers: Sequence[int] | None = None,
    ep: Any = None,
) -> nn.ModuleList:
    """Return this pipeline rank's v model chunks (chunk c is stage c·p + rank), holding the
    experts ``ep`` (an :class:`~hpcllm.model.moe.ExpertParallel`) gives this rank."""
    stages = p * v
    split = split_layers(cfg.n_layer, stages, layers)
    family = families.get(cfg.arch)
    chunks = []
    for chunk in range(v):
        stage = chunk * p + rank
        part = build(
            cfg,
            vocab_size,
            tp_group=tp_group,
            seed=seed,
            sequence_parallel=sequence_parallel,
            layers=split[stage],
            pre=stage == 0,
            post=stage == stages - 1,
            ep=ep,
        )
        part.stage = stage
        if (part.pre or part.post) and p > 1 and family.ties(cfg):
            _mark_tied(part, family)
        chunks.append(part)
    return nn.ModuleList(chunks)


def _mark_tied(part: nn.Module, family: families.Family) -> None:
    """Give the tensors the family ties across the first and last stage (its rules' stage
    ``first+last``) the tied sum: their gradient is complete only once both stages have
    summed theirs, and the last stage's copy is counted once in the gradient norm."""
    for name, param in part.named_parameters():
        if family.rule(name).stage == "first+last":
            tie_across_stages(param, stage_copy=part.post and not part.pre)


def chunks_state_dict(chunks: nn.ModuleList, pp: int) -> dict[str, Any]:
    """Return the chunks' weights keyed as checkpoints hold them.

    With one pipeline stage the keys are the whole model's (``blocks.3.attn.qkv.weight``); a
    pipeline rank's keys start with the chunk's index (``0.blocks.3.attn.qkv.weight``).
    :mod:`hpcllm.train.reshard` reads both.
    """
    return chunks[0].state_dict() if pp == 1 else chunks.state_dict()


def load_chunks_state_dict(chunks: nn.ModuleList, pp: int, state: dict[str, Any]) -> None:
    """Load weights that :func:`chunks_state_dict` gave into ``chunks``."""
    (chunks[0] if pp == 1 else chunks).load_state_dict(state)
