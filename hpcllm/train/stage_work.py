"""The model chunks of one rank doing the forwards and backwards a pipeline schedule asks for.

:class:`ChunkWork` is the :class:`~hpcllm.parallel.pipeline.runtime.StageWork` the trainer
hands the runtime for every layout and every family: with p = v = 1 it is one chunk holding
the whole model and the schedule is plain gradient accumulation. The trainer's step and its
validation build it in one place, :meth:`hpcllm.train.parallelize.ParallelModel.stage_work`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpcllm import observe, watchdog
from hpcllm.model import moe
from hpcllm.model.documents import DocumentMasks
from hpcllm.parallel.context import ContextParallel
from hpcllm.parallel.data.engine import Engine
from hpcllm.parallel.tensor.deferred import (
    defer_weight_grads,
    deferrable_weight_grads,
    weight_grads,
)


class ChunkWork:
    """The model chunks of one rank doing a step's forwards and backwards for the runtime.

    ``batches[i]`` is micro-batch i's (ids, labels), as this rank's model takes them when
    ``batches`` is a :class:`StageBatches` (with its forward's keywords and loss weight);
    the loss of each micro-batch is divided by m, so the gradients of a step are those of
    the mean loss over its micro-batches.
    ``engine`` (a data-parallel engine) supplies each forward's context and runs each
    backward, so that its gradient reduction starts with each chunk's last backward;
    ``modules`` are what :meth:`Engine.wrap` returned for the chunks (the chunks themselves
    by default). Each action runs inside an NVTX range named for it (``forward mb3``).

    With ``split_backward`` (zb-h1) B computes the input gradient and every parameter's
    gradient except the linear layers' weights, whose GEMMs it parks
    (:func:`~hpcllm.parallel.tensor.deferred.defer_weight_grads`), and frees the graph;
    W computes those GEMMs and hands all the micro-batch's parameter gradients to autograd at
    once, so each parameter's gradient hook (DDP, Horovod) fires once per micro-batch, in W.
    """

    def __init__(
        self,
        chunks: nn.ModuleList,
        engine: Engine,
        batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        modules: Sequence[nn.Module] | None = None,
        autocast: Callable[[], Any] = contextlib.nullcontext,
        scale: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss,
        split_backward: bool = False,
    ) -> None:
        self.chunks, self.engine = chunks, engine
        self.batches = batches if isinstance(batches, StageBatches) else StageBatches(batches)
        self.modules = list(chunks) if modules is None else list(modules)
        # NVTX names say the chunk only when a rank holds several.
        # NVTX names that read as the schedule: "forward mb3 stage 5 chunk 1".
        self._names = [
            f" stage {getattr(chunk, 'stage', c)}" + (f" chunk {c}" if len(chunks) > 1 else "")
            for c, chunk in enumerate(chunks)
        ]
        self.m = len(batches)
        self.autocast, self.scale = autocast, scale
        self.split_backward = split_backward
        self.losses: dict[int, torch.Tensor] = {}
        self._saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._deferred: dict[tuple[int, int], tuple[list, list]] = {}
        # Backward passes still to come per chunk: the last one starts the dp reduction.
        self._left = [self.m] * len(chunks)
        # Each forward's MoE auxiliary losses, backpropagated with its output.
        self._moe = [moe.layers_of(chunk) for chunk in chunks]
        self._aux: dict[tuple[int, int], torch.Tensor] = {}

    def forward(self, chunk: int, microbatch: int, x: torch.Tensor | None) -> torch.Tensor | None:
        with observe.nvtx_range(f"forward mb{microbatch}{self._names[chunk]}"):
            return self._forward(chunk, microbatch, x)

    def backward(
        self, chunk: int, microbatch: int, grad: torch.Tensor | None, weights: bool
    ) -> torch.Tensor | None:
        with observe.nvtx_range(f"backward mb{microbatch}{self._names[chunk]}"):
            return self._backward_pass(chunk, microbatch, grad, weights)

    def _with_aux(
        self, key: tuple[int, int], out: torch.Tensor, grad: torch.Tensor | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Return the backward's roots and their gradients: the forward's output, and the
        auxiliary losses its MoE layers left, whose gradient is what the main loss is
        multiplied by (1/m and the loss scale) on every stage alike."""
        aux = self._aux.pop(key, None)
        if aux is None:
            return [out], [grad]
        scale = self.scale(torch.full((), 1.0 / self.m, device=aux.device))
        return [out, aux], [grad, scale.to(aux.dtype)]

    def backward_weight(self, chunk: int, microbatch: int) -> None:
        with observe.nvtx_range(f"weight gradients mb{microbatch}{self._names[chunk]}"):
            self._backward_weight(chunk, microbatch)

    def _forward(self, chunk: int, microbatch: int, x: torch.Tensor | None) -> torch.Tensor | None:
        part = self.chunks[chunk]
        ids, labels = self.batches[microbatch]
        inputs = ids if part.pre else x
        if inputs is None:
            raise RuntimeError(f"stage {part.stage} got no input for micro-batch {microbatch}")
        keywords = self.batches.keywords(microbatch)
        with (
            self.engine.forward_context(chunk),
            self.autocast(),
            deferrable_weight_grads(self.split_backward),
        ):
            module = self.modules[chunk]
            hidden = module(inputs, labels, **keywords) if part.post else module(inputs, **keywords)
        weight = self.batches.loss_weight(microbatch) if part.post else None
        if weight is not None:
            hidden = hidden * weight
        keep = torch.is_grad_enabled()  # evaluation keeps nothing for a backward
        aux = moe.take_aux_losses(self._moe[chunk])
        if keep and aux is not None:
            self._aux[(microbatch, chunk)] = aux
        if part.post:
            self.losses[microbatch] = hidden.detach()
            if keep:
                self._saved[(microbatch, chunk)] = (x, self.scale(hidden / self.m))
            return None
        if keep:
            self._saved[(microbatch, chunk)] = (x, hidden)
        return hidden.detach()

    def _backward_pass(
        self, chunk: int, microbatch: int, grad: torch.Tensor | None, weights: bool
    ) -> torch.Tensor | None:
        x, out = self._saved.pop((microbatch, chunk))
        outs, grads_in = self._with_aux((microbatch, chunk), out, grad)
        if weights:
            self._backward(chunk, outs, grads_in)
            return None if x is None else x.grad
        params = [p for p in self.chunks[chunk].parameters() if p.requires_grad]
        inputs = ([x] if x is not None else []) + params
        # Recomputed blocks (model.recompute) must rebuild the forward's deferrable layers.
        with defer_weight_grads() as parked, deferrable_weight_grads():
            grads = torch.autograd.grad(outs, inputs, grads_in, allow_unused=True)
        if x is not None:
            gx, grads = grads[0], grads[1:]
        else:
            gx = None
        ready = [(p, g) for p, g in zip(params, grads, strict=True) if g is not None]
        self._deferred[(microbatch, chunk)] = (parked, ready)
        return gx

    def _backward_weight(self, chunk: int, microbatch: int) -> None:
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
        self.engine.backward(chunk, outs, grads, last=self._left[chunk] == 0)


class StageBatches(Sequence[tuple[torch.Tensor, torch.Tensor]]):
    """Micro-batches as this rank's model takes them, made when first used: the labels that
    take no loss masked (``documents.mask_loss``), each sequence cut to this context-parallel
    rank's two chunks (:meth:`ContextParallel.cut`), the forward's keywords (the packed
    documents, ``documents.reset_attention``) and the loss's weight.

    Under context parallelism with masked labels each rank's chunks hold their own number of
    labels that count: its loss (the mean over its own) is weighted by cp x its count / the
    sample's, so the mean over the group, which the gradients' average takes, is the
    sample's mean over every label that counts.
    """

    def __init__(
        self,
        batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        context: ContextParallel | None = None,
        documents: DocumentMasks | None = None,
    ) -> None:
        self.batches, self.documents = batches, documents
        self.context = context if context is not None and context.active else None
        self._made: dict[int, tuple[tuple[torch.Tensor, torch.Tensor], dict, Any]] = {}

    def __len__(self) -> int:
        return len(self.batches)

    def _make(self, index: int) -> tuple[tuple[torch.Tensor, torch.Tensor], dict, Any]:
        if index not in self._made:
            ids, labels = self.batches[index]
            keywords, weight = {}, None
            if self.documents is not None:
                labels = self.documents.labels(ids, labels)
                keywords = self.documents.keywords(ids)
            if self.context is not None:
                whole = labels
                ids, labels = self.context.cut(ids), self.context.cut(labels)
                if self.documents is not None and self.documents.mask_loss:
                    counted = (whole >= 0).sum().clamp(min=1)
                    weight = (labels >= 0).sum() * self.context.size / counted
            self._made[index] = ((ids, labels), keywords, weight)
        return self._made[index]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return self._make(index)[0]

    def keywords(self, index: int) -> dict[str, torch.Tensor]:
        """Return micro-batch ``index``'s keywords for every stage's forward."""
        return self._make(index)[1]

    def loss_weight(self, index: int) -> torch.Tensor | None:
        """Return what micro-batch ``index``'s loss is multiplied by (None: 1)."""
        return self._make(index)[2]


class MicroBatches(Sequence[tuple[torch.Tensor, torch.Tensor]]):
    """A step's ``count`` micro-batches as (ids, labels) on ``device``, read when first used.

    The schedule asks for micro-batch k at its first forward, so reading interleaves with
    compute as in a plain accumulation loop, and the reader's prefetch queue keeps filling
    while the earlier micro-batches run. ``data_time`` adds up the time spent reading.
    """

    def __init__(self, batches: Iterator[Any], count: int, device: torch.device) -> None:
        self._batches, self._count, self._device = batches, count, device
        self._read: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.data_time = 0.0

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self._count:
            raise IndexError(index)
        while len(self._read) <= index:
            started = time.perf_counter()
            # A reader stuck on its files (a stalled file system) is named as such, not as
            # the step around it.
            with (
                observe.nvtx_range(f"data mb{len(self._read)}"),
                watchdog.waiting("micro-batch from the data reader", microbatch=len(self._read)),
            ):
                batch = next(self._batches)
                self._read.append(
                    (
                        batch.input_ids.to(self._device, non_blocking=True),
                        batch.labels.to(self._device, non_blocking=True),
                    )
                )
            self.data_time += time.perf_counter() - started
        return self._read[index]


def stage_loss_sum(work: ChunkWork, pp_group: Any, device: torch.device) -> torch.Tensor:
    """Return the sum of the losses of ``work``'s micro-batches, on every pipeline stage."""
    loss_sum = torch.zeros((), device=device)
    for loss in work.losses.values():
        loss_sum += loss.float()
    if pp_group is not None:  # only the last stage has the losses
        with watchdog.waiting("loss all-reduce", axis="pp"):
            dist.all_reduce(loss_sum, group=pp_group)
    return loss_sum
