"""Turn a config and a rank's place in the grid into its part of the model, ready to train.

:func:`parallelize` applies, in this order, everything that makes a model parallel (the
order torchtitan's ``parallelize`` keeps, and the one place to add a step such as
compilation):

1. the random streams, so that every rank draws the whole model's weights alike and each
   pipeline stage (and, in split regions, each tp rank) its own dropout;
2. the stage cut: this rank's v chunks, built with its tensor-parallel group (with p = v = 1
   one chunk, the whole GPT); the last stage's copy of the tied embedding is marked as the
   duplicate, so the gradient norm counts it once;
3. the schedule of one training step and the channel to the neighbouring stages, sized by the
   activation a stage declares it passes on (no channel with one stage);
4. compilation (``model.compile``): each transformer block and the output head compiled on
   its own (``blocks``), or each chunk whole (``full``); see :func:`compile_chunks`;
5. the data-parallel engine's wrap of the chunks;
6. the optimizer, which the engine builds over AdamW and the loss scaler
   (:meth:`Engine.build_optimizer <hpcllm.parallel.data.engine.Engine.build_optimizer>`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hpcllm.config import Config
from hpcllm.errors import UserError
from hpcllm.model.documents import DocumentMasks
from hpcllm.model.stages import build_chunks, split_layers
from hpcllm.parallel.context import ContextParallel
from hpcllm.parallel.data.builder import build_engine
from hpcllm.parallel.data.engine import Engine
from hpcllm.parallel.data.experts import TimedAllToAll
from hpcllm.parallel.data.optimizer import MixedPrecisionOptimizer
from hpcllm.parallel.pipeline.runtime import Channel
from hpcllm.parallel.pipeline.schedule import Action, check_sizes, rank_actions
from hpcllm.parallel.random import seed_streams
from hpcllm.topology import Grid, ProcessGroups
from hpcllm.train.optim import autocast, build_optimizer, build_scaler
from hpcllm.train.stage_work import ChunkWork, StageBatches


@dataclass
class ParallelModel:
    """One rank's part of the model and what trains it."""

    chunks: nn.ModuleList  # the weights this rank holds; checkpoints save these
    forward_modules: list[nn.Module]  # what runs each chunk's forward (the engine's wrap)
    engine: Engine
    optimizer: MixedPrecisionOptimizer  # steps: unscale, clip, skip on inf/NaN (its scaler)
    schedule: str  # the schedule the actions follow (1f1b with one stage)
    actions: list[Action]  # this rank's actions for one training step
    channel: Channel | None  # point-to-point to the neighbouring stages (None if p = 1)
    groups: ProcessGroups  # the grid's process groups
    context: ContextParallel = field(default_factory=ContextParallel)  # cp: what this rank cuts
    # The packed documents' masks (data.reset_attention_at_eos, data.mask_eod_loss); None: off.
    documents: DocumentMasks | None = None

    @property
    def pp_group(self) -> Any:
        """Return the pipeline's group, None with one stage (nothing to exchange)."""
        return self.groups.pp if self.channel is not None else None

    @property
    def split_backward(self) -> bool:
        """Return whether the schedule runs weight gradients apart (W actions, zb-h1)."""
        return self.schedule == "zb-h1"

    @property
    def parameters(self) -> list[nn.Parameter]:
        """Return this rank's parameters, in the optimizer's order of chunks."""
        return list(self.chunks.parameters())

    def stage_work(
        self,
        batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        precision: str,
        device: torch.device,
        scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> ChunkWork:
        """Return the work of this rank's chunks on ``batches`` under ``precision``'s autocast:
        a training step's when ``scale`` (the loss scaler's) is given, else an evaluation's."""
        return ChunkWork(
            self.chunks,
            self.engine,
            StageBatches(batches, self.context, self.documents),
            modules=self.forward_modules,
            autocast=lambda: autocast(precision, device),
            scale=scale or (lambda loss: loss),
            split_backward=scale is not None and self.split_backward,
        )


def check_pipeline(cfg: Config, accumulation: int | None) -> None:
    """Refuse, in one line, a pipeline the schedule cannot run.

    ``accumulation`` (micro-batches per step) None checks all but the micro-batch count.
    """
    parallel = cfg.parallel
    if parallel.pp == 1:
        if parallel.vpp > 1:
            raise UserError("parallel.vpp > 1 needs a pipeline (parallel.pp > 1)")
        return
    if parallel.schedule == "interleaved" and parallel.vpp < 2:
        raise UserError(
            "parallel.schedule: interleaved needs parallel.vpp >= 2 virtual stages per rank"
        )
    if parallel.schedule != "interleaved" and parallel.vpp > 1:
        raise UserError(
            f"parallel.vpp {parallel.vpp} needs parallel.schedule: interleaved "
            f"(not {parallel.schedule})"
        )
    try:
        if accumulation is not None:
            check_sizes(parallel.schedule, parallel.pp, accumulation, parallel.vpp)
        split_layers(cfg.model.n_layer, parallel.pp * parallel.vpp, parallel.pipeline_layers)
    except ValueError as err:
        raise UserError(
            f"{err} (the micro-batches per step are train.global_batch_size / "
            f"(micro_batch_size x d) = {accumulation})"
        ) from None


def one_gpu(world_size: int, recompute: str) -> bool:
    """Return whether ``compile: auto`` may compile each chunk whole: one rank holds the whole
    model (no gradient reduction to overlap) and nothing is recomputed (see
    :func:`resolve_compile`)."""
    return world_size == 1 and recompute == "none"


def resolve_compile(
    setting: str, device: torch.device, schedule: str, one_gpu: bool = False
) -> str:
    """Return what ``model.compile`` compiles here: ``none``, ``blocks`` or ``full``.

    ``auto`` is ``none`` off CUDA (CPU compilation costs more start-up than it saves on small
    models); on CUDA it is ``full`` where ``one_gpu`` (one rank holds the whole model and
    nothing recomputes: no gradient reduction to overlap with the backward, no activation
    checkpoint inside the graph), and ``blocks`` elsewhere. Measured on an H100, gpt2-124m
    at micro-batch 16: ``full`` 37.8 ms/step, ``blocks`` 42.5 (each block's graph entry and
    exit cost the host more than the GPU's work hides; docs/benchmarks.md). zb-h1 parks
    weight-gradient GEMMs from inside the backward, which a compiled backward cannot do:
    ``auto`` leaves it uncompiled and an explicit choice is refused.
    """
    if setting == "auto":
        if device.type != "cuda" or schedule == "zb-h1":
            return "none"
        return "full" if one_gpu else "blocks"
    if setting != "none" and schedule == "zb-h1":
        raise UserError(
            f"model.compile: {setting} cannot run parallel.schedule: zb-h1 (its split backward "
            "defers weight gradients inside autograd); use model.compile: none or auto"
        )
    return setting


def compiled_how(cfg: Config, device: torch.device, world_size: int) -> str:
    """Return what ``model.compile`` compiles for ``cfg`` on ``device`` in a job of
    ``world_size`` ranks (:func:`resolve_compile` with the run's schedule)."""
    schedule = cfg.parallel.schedule if cfg.parallel.pp > 1 else "1f1b"
    whole = one_gpu(world_size, cfg.model.recompute)
    return resolve_compile(cfg.model.compile, device, schedule, whole)


def check_compile_mode(mode: str, how: str, device_type: str, accumulation: int) -> None:
    """Raise a UserError where ``model.compile_mode`` cannot train what ``how`` compiles.

    ``reduce-overhead`` replays CUDA graphs, each replay writing into the buffers of the one
    before; a step of several micro-batches still needs an earlier micro-batch's outputs in
    its backward, and torch refuses to read them once overwritten (measured on an H100 at 4
    micro-batches: "accessing tensor output of CUDAGraphs that has been overwritten by a
    subsequent run"). The trainer refuses it at start-up, before the run folder is touched, in
    one line, on every rank alike.
    """
    if mode == "reduce-overhead" and how != "none" and device_type == "cuda" and accumulation > 1:
        raise UserError(
            f"model.compile_mode reduce-overhead cannot train {accumulation} micro-batches per "
            "step on a GPU: each CUDA-graph replay overwrites the outputs an earlier "
            "micro-batch's backward reads; use train.global_batch_size = micro_batch_size x d "
            "(one micro-batch) or model.compile_mode default"
        )


def compile_chunks(chunks: nn.ModuleList, how: str, mode: str = "default") -> None:
    """Compile this rank's chunks in place with ``torch.compile`` in ``mode``
    (``model.compile_mode``).

    ``blocks`` compiles each transformer block on its own, and each last stage's head
    (final LayerNorm, output layer, loss; with t = 1: at t > 1 the vocabulary-parallel loss
    and its all-reduces stay eager), as torchtitan does: the blocks share one graph
    (compiled once, whatever the depth), and everything between them stays eager, so tensor-
    parallel collectives, pipeline stages, activation recomputation (``checkpoint`` around a
    compiled block) and the data-parallel engines' gradient hooks work unchanged; each
    block's gradients are ready when its backward ends, so DDP and Horovod still overlap
    communication with the backward. ``full`` compiles each chunk's forward whole: fewer
    graph boundaries, but its parameter gradients all appear at the end of its backward,
    so the gradient reduction no longer overlaps it.
    """
    if how == "none":
        return
    for chunk in chunks:
        if how == "full":
            chunk.compile(mode=mode)
            continue
        for block in chunk.blocks.values():
            block.compile(mode=mode)
        if chunk.post and chunk.tp_group is None:
            chunk.head = torch.compile(chunk.head, mode=mode)


def parallelize(
    cfg: Config,
    grid: Grid,
    vocab_size: int,
    accumulation: int,
    documents: DocumentMasks | None = None,
) -> ParallelModel:
    """Return this rank's chunks, wrapped for data parallelism, with schedule and optimizer.

    ``accumulation`` is the number of micro-batches per step (m); with one pipeline stage
    the schedule is 1f1b, which is then plain gradient accumulation whatever
    ``parallel.schedule`` says. ``documents``: what the micro-batches' end-of-text tokens
    do (:class:`~hpcllm.model.documents.DocumentMasks`; None: nothing).
    """
    parallel, train, device = cfg.parallel, cfg.train, grid.device
    check_pipeline(cfg, accumulation)
    tp_group = grid.groups.tp if parallel.tp > 1 else None

    seed_streams(train.seed, grid.tp_rank, grid.pp_rank, device)
    # Here, not at the top: the model's modules import the kernels (and Triton), which
    # preflight, importing this module, must not.
    from hpcllm.model.moe import ExpertParallel

    ep = ExpertParallel(grid.ep, grid.ep_rank)

    chunks = build_chunks(
        cfg.model,
        vocab_size,
        p=parallel.pp,
        rank=grid.pp_rank,
        v=parallel.vpp,
        tp_group=tp_group,
        seed=train.seed,
        sequence_parallel=parallel.sequence_parallel,
        layers=parallel.pipeline_layers,
        ep=ep,
    ).to(device)
    context = ContextParallel(grid.groups.cp, grid.cp, grid.cp_rank, cfg.model.seq_len)
    for chunk in chunks:
        chunk.use_context(context)

    schedule = parallel.schedule if parallel.pp > 1 else "1f1b"
    actions = rank_actions(schedule, parallel.pp, grid.pp_rank, accumulation, parallel.vpp)
    channel = None
    if parallel.pp > 1:
        channel = Channel(
            prev=grid.pp_prev,
            next=grid.pp_next,
            shape=chunks[0].boundary_shape(train.micro_batch_size),
            dtype=torch.float32,
            device=device,
            tp_group=tp_group,
            scatter_gather=parallel.scatter_gather,
            sequence_parallel=chunks[0].sequence_parallel,
        )
    compile_chunks(chunks, compiled_how(cfg, device, grid.world_size), cfg.model.compile_mode)
    engine = build_engine(parallel.dp_engine, grid, parallel, train.param_dtype)
    modules = engine.wrap(chunks)
    if grid.ep > 1:
        # The MoE layers send tokens with the engine's all-to-all, timed for the metrics.
        engine.all_to_all_timer = TimedAllToAll(engine.all_to_all(), device)
        ep.all_to_all = engine.all_to_all_timer

    optimizer = engine.build_optimizer(
        build_optimizer(chunks, train, device),
        build_scaler(train.precision, device),
        train.grad_clip,
        accumulation,
    )
    return ParallelModel(
        chunks=chunks,
        forward_modules=modules,
        engine=engine,
        optimizer=optimizer,
        schedule=schedule,
        actions=actions,
        channel=channel,
        groups=grid.groups,
        context=context,
        documents=documents,
    )
