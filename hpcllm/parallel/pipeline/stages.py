"""The GPT cut into pipeline stages, and the work the runtime asks of them.

Stage k of S = p·v holds a contiguous run of blocks; the first also holds the embedding, the
last the final LayerNorm and the output layer, which is tied to the embedding. When those
two stages sit on different ranks each keeps a copy of the embedding and, as Megatron-LM
does, their gradients are all-reduced between the two before the optimizer step, so the
copies stay equal. The last stage's copy is marked ``pipeline_duplicate`` so the global
gradient norm counts it once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpcllm.config import ModelConfig
from hpcllm.model.gpt import GPT
from hpcllm.parallel.tensor import defer_weight_grads, deferrable_weight_grads, weight_grads


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
) -> nn.ModuleList:
    """Return this pipeline rank's v model chunks (chunk c is stage c·p + rank)."""
    stages = p * v
    split = split_layers(cfg.n_layer, stages, layers)
    chunks = []
    for chunk in range(v):
        stage = chunk * p + rank
        part = GPT(
            cfg,
            vocab_size,
            tp_group=tp_group,
            seed=seed,
            sequence_parallel=sequence_parallel,
            layers=split[stage],
            pre=stage == 0,
            post=stage == stages - 1,
        )
        part.stage = stage
        if part.post and not part.pre and p > 1:
            part.wte.weight.pipeline_duplicate = True
        chunks.append(part)
    return nn.ModuleList(chunks)


def embedding_group(grid: Any) -> Any:
    """Return the torch group of this rank's first and last pipeline stage (None if p = 1).

    Every rank takes part in creating every such group, as ``new_group`` requires.
    """
    if grid.pp == 1:
        return None
    mine = None
    for members in grid.layout.groups("pp"):
        ranks = sorted({members[0], members[-1]})
        group = dist.new_group(ranks)
        if grid.rank in ranks:
            mine = group
    return mine


def sync_tied_embedding(chunks: nn.ModuleList, group: Any) -> None:
    """Sum the embedding's gradient over its first-stage and last-stage copies."""
    if group is None:
        return
    for chunk in chunks:
        if (chunk.pre or chunk.post) and not (chunk.pre and chunk.post):
            grad = chunk.wte.weight.grad
            if grad is None:
                grad = chunk.wte.weight.grad = torch.zeros_like(chunk.wte.weight)
            dist.all_reduce(grad, group=group)


class GPTStageWork:
    """The GPT chunks of one rank doing a step's forwards and backwards for the runtime.

    ``batches[i]`` is micro-batch i's (ids, labels); the loss of each micro-batch is divided
    by m, so the gradients of a step are those of the mean loss over its micro-batches.
    ``engine`` (a data-parallel engine) supplies the chunks' forward modules and backward,
    so that its gradient reduction starts with each chunk's last backward.

    With ``split_backward`` (zb-h1) B computes the input gradient and every parameter's
    gradient except the linear layers' weights, whose GEMMs it parks
    (:func:`~hpcllm.parallel.tensor.defer_weight_grads`), and frees the graph; W computes those
    GEMMs and hands all the micro-batch's parameter gradients to autograd at once, so each
    parameter's gradient hook (DDP, Horovod) fires once per micro-batch, in W.
    """

    def __init__(
        self,
        chunks: nn.ModuleList,
        engine: Any,
        batches: Sequence[tuple],
        autocast: Callable[[], Any] = contextlib.nullcontext,
        scale: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss,
        split_backward: bool = False,
    ) -> None:
        self.chunks, self.engine, self.batches = chunks, engine, batches
        self.m = len(batches)
        self.autocast, self.scale = autocast, scale
        self.split_backward = split_backward
        self.losses: dict[int, torch.Tensor] = {}
        self._saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._deferred: dict[tuple[int, int], tuple[list, list]] = {}
        # Backward passes still to come per chunk: the last one starts the dp reduction.
        self._left = [self.m] * len(chunks)

    def forward(self, chunk: int, microbatch: int, x: torch.Tensor | None) -> torch.Tensor | None:
        part = self.chunks[chunk]
        ids, labels = self.batches[microbatch]
        inputs = ids if part.pre else x
        if inputs is None:
            raise RuntimeError(f"stage {part.stage} got no input for micro-batch {microbatch}")
        with (
            self.engine.pipeline_forward(chunk),
            self.autocast(),
            deferrable_weight_grads(self.split_backward),
        ):
            module = self.engine.pipeline_modules[chunk]
            hidden = module(inputs, labels) if part.post else module(inputs)
        keep = torch.is_grad_enabled()  # evaluation keeps nothing for a backward
        if part.post:
            self.losses[microbatch] = hidden.detach()
            if keep:
                self._saved[(microbatch, chunk)] = (x, self.scale(hidden / self.m))
            return None
        if keep:
            self._saved[(microbatch, chunk)] = (x, hidden)
        return hidden.detach()

    def backward(
        self, chunk: int, microbatch: int, grad: torch.Tensor | None, weights: bool
    ) -> torch.Tensor | None:
        x, out = self._saved.pop((microbatch, chunk))
        if weights:
            self._backward(chunk, [out], [grad])
            return None if x is None else x.grad
        params = [p for p in self.chunks[chunk].parameters() if p.requires_grad]
        inputs = ([x] if x is not None else []) + params
        # Recomputed blocks (model.recompute) must rebuild the forward's deferrable layers.
        with defer_weight_grads() as parked, deferrable_weight_grads():
            grads = torch.autograd.grad(out, inputs, grad, allow_unused=True)
        if x is not None:
            gx, grads = grads[0], grads[1:]
        else:
            gx = None
        ready = [(p, g) for p, g in zip(params, grads, strict=True) if g is not None]
        self._deferred[(microbatch, chunk)] = (parked, ready)
        return gx

    def backward_weight(self, chunk: int, microbatch: int) -> None:
        parked, ready = self._deferred.pop((microbatch, chunk))
        summed: dict[int, list] = {}
        for param, grad in ready + weight_grads(parked):
            if id(param) in summed:
                summed[id(param)][1] = summed[id(param)][1] + grad
            else:
                summed[id(param)] = [param, grad]
        # Through autograd (expand_as feeds each parameter's AccumulateGrad), so the engines'
        # gradient hooks see every parameter once.
        params = [p for p, _ in summed.values()]
        self._backward(chunk, [p.expand_as(p) for p in params], [g for _, g in summed.values()])

    def _backward(
        self, chunk: int, outs: list[torch.Tensor], grads: list[torch.Tensor | None]
    ) -> None:
        self._left[chunk] -= 1
        self.engine.pipeline_backward(chunk, outs, grads, last=self._left[chunk] == 0)


class StageForward(nn.Module):
    """A chunk as one module a DDP wrapper can run: token ids (first stage) or the previous
    stage's activation in; the activation, or on the last stage the loss, out."""

    def __init__(self, part: GPT) -> None:
        super().__init__()
        self.part = part

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.part.embed(inputs) if self.part.pre else inputs
        hidden = self.part.run_blocks(hidden)
        return self.part.head(hidden, labels) if self.part.post else hidden
