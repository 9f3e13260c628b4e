"""Memory per GPU and time per step of one layout of a GPT on a cluster.

What depends on the model is its family's (:mod:`hpcllm.families`): the parameters each stage
holds, one layer's GEMMs, stored activations and split pointwise traffic, whether the linear
layers have biases and the embedding is tied, and the FLOPs of a step. The rest is the
hardware, the layout and the software.

Memory (bytes per GPU, the busiest pipeline rank):

- weights, gradients and optimizer state per parameter the rank holds: hpcllm keeps fp32
  weights and gradients and Adam's two fp32 moments (4 + 4 + 8 bytes); ``weights: mixed``
  (Megatron-LM) keeps 16-bit weights, fp32 gradients and an fp32 master copy with the moments
  (2 + 4 + 12). The distributed optimizer divides the optimizer part by d.
- activations per layer and micro-batch, the family's count in units of s·b·h (16-bit
  bytes) after Korthikanti et al. (2022), a GPT's s·b·h·(10 + 24/t + 5·a·s/(h·t)) without
  sequence parallelism, s·b·h·(34/t + 5·a·s/(h·t)) with it; selective recomputation drops the
  attention core's scores, and so does flash attention, which never stores the s×s scores;
  full recomputation keeps only each layer's input, 2·s·b·h (/t with sequence parallelism),
  plus one layer's worth while it is recomputed. Times the micro-batches the first pipeline
  rank holds at its peak (gpipe: m; 1f1b and zb-h1: p; interleaved: p + (p-1)/v, in stage
  units: the same counts :func:`hpcllm.parallel.pipeline.schedule.peak_in_flight` gives for
  the real schedules), plus the logits of one micro-batch on the last stage.

Time: each stage's forward and backward per micro-batch, from

- every GEMM's FLOPs at the fraction of peak its shape reaches
  (:func:`hpcllm.plan.hardware.gemm_efficiency`); a backward GEMM pair costs twice the
  forward one;
- attention: flash (hpcllm, causal: half the score FLOPs at FlashAttention's efficiency,
  backward 2.5 times the forward), or unfused (Megatron-LM in 2021: two batched GEMMs over
  head_dim, and the scale-mask-softmax and dropout over b·a·s²/t elements in HBM);
- the element-wise ops (norms, dropout-residual adds, the family's split pointwise ops such as
  an MLP's activation; their bytes) at HBM bandwidth;
- the tensor-parallel all-reduces (2 per layer forward, 2 backward, 2 more when recomputed;
  sequence parallelism's all-gather + reduce-scatter move the same bytes), ring cost inside a
  node;

then the pipeline: m micro-batches plus the schedule's bubble (the papers' formulas, from
:func:`hpcllm.parallel.pipeline.simulate.theory_bubble`), point-to-point transfers between
stages on the critical path (over the network when a stage's neighbour sits on another node,
1/t of the bytes each with scatter/gather), the data-parallel all-reduce (ring over d ranks;
hpcllm overlaps it with the last backward, Megatron-LM in 2021 only without a pipeline), and
the optimizer's pass over its state at HBM bandwidth.

Also the backward's bias-gradient sums, the loss's passes over the logits, the tied
embedding's gradient summed between the first and the last stage, and the optimizer's passes,
each in the way the software makes them (:class:`Software`).

Mixtures of experts (:class:`Experts`, from ``model.moe_*``): each MoE block trades its dense
MLP for a router (h·E, fp32), E expert MLPs of the family's own kind (its ``mlp_matrices`` and
``biases``: GPT-2's GeLU with biases, Llama's SwiGLU without) and an optional shared expert.
Every expert counts in the parameters; a token's FLOPs count the router, its top-k experts and
the shared one (:func:`hpcllm.flops.moe_flops_delta`, the trainer's count). Expert
parallelism (``Layout.ep``, ranks carved out of d as Megatron-Core orders them: tp, cp, ep,
dp, pp) gives each rank E/ep of the experts, each split over t; their gradients are
all-reduced over the d/ep ranks holding the same experts, and the distributed optimizer
shards their state over those. Each MoE block sends its T·k routed rows to the experts' ranks
and back (dispatch and combine: two all-to-alls forward, two backward, as Switch Transformer
and GShard count them), priced by :func:`all_to_all_s`.

Context parallelism (``Layout.cp``, ranks next to t as Megatron-Core orders them) splits each
sequence over cp ranks: every per-token cost (GEMMs, pointwise traffic, stored activations,
the logits and loss, the pipeline's transfers) is that of s/cp tokens, and the attention core
of s/cp balanced queries over all s keys does 1/cp of the whole attention's work, cp times
what s/cp tokens alone would. Each layer all-gathers its keys and values over the cp group
(hpcllm's variant, docs/context-parallel.md) and reduce-scatters their gradients, priced as
those collectives on the link a t·cp block sits on, exposed (nothing overlaps them); without
recomputation the whole sequence's keys and values stay stored per layer. Gradients are
all-reduced over the d·cp ranks holding the same weights, and the distributed optimizer shards
over them.

Left out: kernel launch overheads, the embedding's gather, imbalance from the embedding stage,
NCCL's protocol choice, congestion between jobs, and stragglers.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any

from hpcllm import families
from hpcllm.config import BatchPlan, ModelConfig, model_config, moe_layers, padded_vocab
from hpcllm.flops import moe_flops_delta
from hpcllm.parallel.pipeline.simulate import theory_bubble
from hpcllm.plan.hardware import (
    Cluster,
    attention_efficiency,
    bus_factor,
    gemm_efficiency,
    latency_steps,
)
from hpcllm.plan.sources import value
from hpcllm.user_error import UserError

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
RECOMPUTE = ("none", "selective", "full")
SOFTWARE = ("hpcllm", "megatron-2021", "megatron-core")


def _dense_ffn(shape: families.Shape) -> int:
    """Return the dense MLP's width (a Shape's None: 4·hidden)."""
    return shape.ffn or 4 * shape.hidden


@dataclass(frozen=True)
class Experts:
    """The mixture of experts of a model (``model.moe_*``, docs/moe.md): each of ``blocks``
    trades its dense MLP for a router, ``count`` expert MLPs of width ``ffn`` of which each
    token uses ``top_k``, and a shared expert of width ``shared_ffn`` (0: none) that every
    token uses, gated by the token where ``shared_gate``."""

    count: int
    top_k: int
    ffn: int
    blocks: tuple[int, ...]
    shared_ffn: int = 0
    shared_gate: bool = False

    @classmethod
    def of(cls, model: ModelConfig, shape: families.Shape) -> Experts | None:
        """Return the experts of a model config (``cfg.model``) of this shape; None for a
        dense model."""
        if not model.moe_experts:
            return None
        return cls(
            model.moe_experts,
            model.moe_top_k,
            model.moe_ffn_size or _dense_ffn(shape),
            tuple(moe_layers(model)),
            model.moe_shared_ffn_size,
            model.moe_shared_gate,
        )

    def keys(self, shape: families.Shape) -> dict[str, Any]:
        """Return the ``model.*`` keys (without the prefix) that give these experts to a model
        of this shape: every block MoE but those listed dense. The router, its losses and a
        capacity are not priced, so not written."""
        dense = [i for i in range(shape.layers) if i not in self.blocks]
        return {
            "moe_experts": self.count,
            "moe_top_k": self.top_k,
            "moe_ffn_size": None if self.ffn == _dense_ffn(shape) else self.ffn,
            "moe_every": 1,
            "moe_first_dense": 0,
            "moe_dense_layers": dense or None,
            "moe_shared_ffn_size": self.shared_ffn,
            "moe_shared_gate": self.shared_gate,
        }


@dataclass(frozen=True)
class Model:
    """A model to plan: its family (``model.arch``), whose spec prices it (FLOPs, parameters,
    GEMMs, traffic, activations: :mod:`hpcllm.families`), its sizes, and its experts if it
    has MoE blocks."""

    arch: str
    shape: families.Shape
    experts: Experts | None = None

    @classmethod
    def of(cls, arch: str, *sizes: int, **named: Any) -> Model:
        """Return family ``arch``'s dense model of these sizes (``families.Shape``'s fields,
        in its order or by name)."""
        return cls(arch, families.Shape(*sizes, **named))

    @classmethod
    def from_config(cls, model: ModelConfig, vocab: int) -> Model:
        """Return the model of a model config (``cfg.model``) with vocabulary ``vocab``."""
        shape = families.shape(model, vocab)
        return cls(model.arch, shape, Experts.of(model, shape))

    @property
    def family(self) -> families.Family:
        """Return the family's spec."""
        return families.get(self.arch)

    def config(self) -> ModelConfig:
        """Return a model config of this model: the sizes every family shares, the family's
        own keys for the rest of the shape, and the experts' keys."""
        s = self.shape
        return model_config(
            self.arch,
            preset=None,
            n_layer=s.layers,
            n_head=s.heads,
            d_model=s.hidden,
            seq_len=s.seq,
            **self.family.keys_of_shape(s),
            **(self.experts.keys(s) if self.experts else {}),
        )

    def parameters(self) -> int:
        """Return the parameter count (the family's, with the MoE blocks' experts)."""
        count = self.family.parameters(self.shape)
        if self.experts is None:
            return count
        rest, routed = moe_block_parameters(self, 1, 1)
        return round(count + len(self.experts.blocks) * (rest + routed))

    def step_flops(self, batch: int, recompute: str) -> float:
        """Return one step's FLOPs on ``batch`` sequences: the family's count, and what the MoE
        blocks change (:func:`hpcllm.flops.moe_flops_delta`, the trainer's count)."""
        flops = self.family.step_flops(batch, self.shape, recompute)
        if self.experts is not None:
            flops += moe_flops_delta(self.config(), batch, recompute)
        return flops


@dataclass(frozen=True)
class Layout:
    """One way to run a step: the grid, the micro-batch, the schedule, the recomputation."""

    tp: int
    pp: int
    dp: int
    vpp: int = 1
    micro_batch: int = 1
    schedule: str = "1f1b"
    recompute: str = "none"
    sequence_parallel: bool = False
    scatter_gather: bool = True
    ep: int = 1  # expert-parallel ranks carved out of dp
    cp: int = 1  # context-parallel ranks next to tp: each sequence split over them

    @property
    def replicas(self) -> int:
        """Return d·cp, the ranks holding the same weights (their gradients averaged)."""
        return self.dp * self.cp

    @property
    def gpus(self) -> int:
        """Return t·cp·p·d."""
        return self.tp * self.cp * self.pp * self.dp


@dataclass(frozen=True)
class Software:
    """How the training code runs a step (what it computes is the same).

    ``hpcllm()`` is this project; ``megatron_2021()`` the Megatron-LM of the SC21 paper;
    ``megatron_core()`` NVIDIA's Megatron-Core of 2024 with the overlaps its published H100
    runs turn on.
    """

    precision: str = "bf16"
    attention: str = "flash"  # flash | unfused
    weights: str = "fp32"  # fp32 | mixed
    grad_bytes: int = 4  # bytes per gradient element in the data-parallel all-reduce
    dp_overlap: bool = True  # the all-reduce overlaps the last backward
    # ... also with a pipeline (p > 1). Megatron-LM 2021 overlapped through PyTorch's DDP,
    # which its pipelined schedules would have synchronised after every micro-batch (only the
    # schedule without a pipeline accumulates under ``no_sync``): its runs at p > 1 used its
    # own (``--DDP-impl local``), which all-reduces after the backward.
    dp_overlap_with_pipeline: bool = True
    # The distributed optimizer's parameter all-gather overlaps the next step's first forward
    # (Megatron-Core's --overlap-param-gather): the reduce-scatter half of the data-parallel
    # time hides behind the last backward, the all-gather half behind the first forward.
    param_gather_overlap: bool = False
    # Tensor-parallel collectives run under the GEMMs they feed and follow (Transformer
    # Engine's --tp-comm-overlap): exposed only where a layer's exceed its GEMMs.
    tp_overlap: bool = False
    # The interleaved schedule's sends and receives overlap the next chunk's compute
    # (Megatron-Core's default): the steady state exposes none of them.
    p2p_overlap: bool = False
    distributed_optimizer: bool = False
    schedules: tuple[str, ...] = SCHEDULES  # the pipeline schedules the code runs
    interleave_min_pp: int = 2  # the smallest p the interleaved schedule runs at
    # Every stage and every virtual chunk holds the same number of layers (else: as even as
    # can be, the larger ones costing their extra layer).
    even_stages: bool = False
    # The q|k|v projection's bias added in a pass of its own (F.linear on a 3-D input).
    separate_bias_pass: bool = False
    # HBM bytes per logit of the loss, forward and backward (the loss kernels' passes).
    loss_bytes: tuple[int, int] = (4, 12)
    # HBM bytes per parameter of the step after the backward: gradient norm, clipping, Adam.
    optimizer_bytes: int = 40
    # What the code can do at all: sequence parallelism, a distributed optimizer, these
    # recomputations and precisions.
    can_sequence_parallel: bool = True
    can_distribute_optimizer: bool = True
    recomputes: tuple[str, ...] = RECOMPUTE
    precisions: tuple[str, ...] = ("bf16", "fp16", "fp32")

    @property
    def grad_accumulation_bytes(self) -> int:
        """Return the bytes per parameter that adding a micro-batch's gradient moves.

        fp32: the new gradient written and read, the sum read and written (4 × 4); mixed:
        the 16-bit gradient written and read, added into an fp32 main gradient (2 + 2 + 4 + 4).
        """
        return 12 if self.weights == "mixed" else 16

    @classmethod
    def hpcllm(cls, precision: str = "bf16") -> Software:
        """Return hpcllm's way: fp32 weights under autocast, SDPA, DDP overlapping."""
        return cls(precision=precision)

    @classmethod
    def megatron_2021(cls) -> Software:
        """Return Megatron-LM's way in the SC21 paper.

        fp16 weights and gradients; no sequence parallelism or selective recomputation (both
        came in 2022, Korthikanti et al.) and no distributed optimizer; unfused attention,
        the data-parallel all-reduce overlapping the last backward without a pipeline
        (PyTorch's DDP) and after the backward with one (``--DDP-impl local``, as the paper's
        runs chose: ``examples/sc21/run_table_1.sh``); the 1F1B and interleaved schedules
        only (zero-bubble came in 2023), the interleaved one at p > 2 with v dividing the
        layers per stage, and p dividing the layers (Megatron-LM refuses other layouts);
        PyTorch 1.8's ``F.linear`` on a 3-D input adds the q|k|v bias in a pass of its own; the
        vocabulary-parallel cross-entropy in fp32 (the logits cast, max, subtract, exp, sum
        and divide forward: 38 bytes per logit; the gradient formed in place and cast back:
        14); the fp16 optimizer's passes (main gradients from the fp16 ones, unscale and
        inf check, norm, clip, Adam, fp16 weights from the masters: 60 bytes per parameter).
        """
        return cls(
            "fp16",
            "unfused",
            "mixed",
            2,
            True,
            dp_overlap_with_pipeline=False,
            schedules=("1f1b", "interleaved"),
            interleave_min_pp=3,
            even_stages=True,
            separate_bias_pass=True,
            loss_bytes=(38, 14),
            optimizer_bytes=60,
            can_sequence_parallel=False,
            can_distribute_optimizer=False,
            recomputes=("none", "full"),
            precisions=("fp16",),
        )

    @classmethod
    def megatron_core(cls) -> Software:
        """Return Megatron-Core's way (2024; the Megatron-LM README's H100 scaling runs, which
        overlap data-parallel (``--overlap-grad-reduce --overlap-param-gather``),
        tensor-parallel (``--tp-comm-overlap``) and pipeline communication with compute).

        bf16 weights with fp32 main gradients, reduced in fp32, and fp32 master weights and
        moments (the distributed optimizer shards them over d); flash attention; sequence
        parallelism, selective or full recomputation; 1F1B and interleaved schedules with
        uneven stages; the vocabulary-parallel cross-entropy and the fp16/bf16 optimizer's
        passes as in 2021.
        """
        return cls(
            "bf16",
            "flash",
            "mixed",
            4,
            True,
            distributed_optimizer=True,
            param_gather_overlap=True,
            tp_overlap=True,
            p2p_overlap=True,
            schedules=("1f1b", "interleaved"),
            loss_bytes=(38, 14),
            optimizer_bytes=60,
            precisions=("bf16", "fp16"),
        )

    @classmethod
    def named(
        cls, name: str, precision: str | None = None, distributed_optimizer: bool = False
    ) -> Software:
        """Return the software ``name`` (one of :data:`SOFTWARE`) with the precision and
        distributed optimizer asked for; a UserError where that software had neither."""
        if name not in SOFTWARE:
            raise UserError(f"unknown software {name!r}; one of {', '.join(SOFTWARE)}")
        software = {
            "hpcllm": cls.hpcllm,
            "megatron-2021": cls.megatron_2021,
            "megatron-core": cls.megatron_core,
        }[name]()
        if precision is not None:
            if precision not in software.precisions:
                raise UserError(
                    f"--precision {precision}: {name} ran {', '.join(software.precisions)}"
                )
            software = replace(software, precision=precision)
        if distributed_optimizer:
            if not software.can_distribute_optimizer:
                raise UserError(
                    f"--distributed-optimizer: {name} had none (Megatron-LM's came in 2022)"
                )
            software = replace(software, distributed_optimizer=True)
        return software


@dataclass
class Estimate:
    """What one layout costs: time by part, memory by part, throughput."""

    layout: Layout
    step_time_s: float
    tflops_per_gpu: float  # FLOPs done (recomputation counted, as the paper reports)
    mfu: float  # model FLOPs (no recomputation) / peak
    tokens_per_s: float
    bubble: float  # bubble time / step time
    memory_parts_gb: dict[str, float]
    fits: bool
    time_parts_s: dict[str, float]  # compute, bubble, and each axis's exposed communication
    hidden_comm_s: dict[str, float] = field(default_factory=dict)
    all_to_all_pricing: str | None = None  # how the experts' all-to-all was priced; None: dense

    @property
    def memory_gb(self) -> float:
        """Return the memory per GPU, all parts."""
        return sum(self.memory_parts_gb.values())


def rank_parameters(model: Model, layout: Layout) -> float:
    """Return the parameters the first pipeline rank holds, experts included
    (:func:`rank_parameters_by_kind`)."""
    return sum(rank_parameters_by_kind(model, layout))


def rank_parameters_by_kind(model: Model, layout: Layout) -> tuple[float, float]:
    """Return the parameters the first pipeline rank holds: (all but the routed experts,
    the routed experts). Its layers (each split over t as the family says), the embeddings,
    the final layers when it is also the last; its MoE blocks as
    :func:`moe_block_parameters` counts them."""
    t, family, shape = layout.tp, model.family, model.shape
    layers = layout.vpp * math.ceil(shape.layers / (layout.pp * layout.vpp))
    split, whole = family.layer_parameters(shape)
    final = family.last_parameters(shape, t) if layout.pp == 1 else 0
    held = layers * (split / t + whole) + family.first_parameters(shape, t) + final
    blocks = moe_blocks_per_rank(model, layout)
    if not blocks:
        return held, 0.0
    rest, routed = moe_block_parameters(model, t, layout.ep)
    return held + blocks * rest, blocks * routed


def _mlp_parameters(family: families.Family, hidden: int, width: int) -> tuple[int, int]:
    """Return an MLP of this width as the family builds its MLPs and experts: (split over t,
    whole on every rank). Its matrices (``mlp_matrices``: GeLU's 2, SwiGLU's 3), and with
    ``biases`` each matrix's but the last's (split) and the last's (whole)."""
    m, bias = family.mlp_matrices, int(family.biases)
    return m * hidden * width + (m - 1) * width * bias, hidden * bias


def moe_block_parameters(model: Model, t: int, ep: int) -> tuple[float, float]:
    """Return what one MoE block holds on a rank at tensor-parallel t and expert-parallel ep
    beyond a dense block: (the rest, the routed experts).

    The routed experts: E/ep of them (the ep ranks split them in contiguous blocks), each
    matrix and first bias split over t. The rest, on every rank of the ep group: the router
    (h·E, fp32), the experts' last biases (whole, added on the token's own rank), the shared
    expert (split over t as a dense MLP) and its gate, less the dense MLP the block replaces.
    """
    experts, family, h = model.experts, model.family, model.shape.hidden
    if experts is None:
        return 0.0, 0.0
    split, whole = _mlp_parameters(family, h, experts.ffn)
    shared = _mlp_parameters(family, h, experts.shared_ffn) if experts.shared_ffn else (0, 0)
    dense = _mlp_parameters(family, h, _dense_ffn(model.shape))
    rest = (
        experts.count * (h + whole)
        + shared[0] / t
        + shared[1]
        + h * experts.shared_gate
        - dense[0] / t
        - dense[1]
    )
    return rest, experts.count // ep * split / t


def moe_blocks_per_rank(model: Model, layout: Layout) -> int:
    """Return the most MoE blocks a pipeline rank holds: v chunks of at most ⌈L/(p·v)⌉
    consecutive blocks, each taken as the run of that length with the most MoE blocks (the
    stage cut itself, :func:`hpcllm.model.stages.split_layers`, lives with torch)."""
    if model.experts is None:
        return 0
    layers, moe = model.shape.layers, set(model.experts.blocks)
    run = math.ceil(layers / (layout.pp * layout.vpp))
    before = [0, *itertools.accumulate(int(i in moe) for i in range(layers))]
    return layout.vpp * max(before[s + run] - before[s] for s in range(layers - run + 1))


def _bytes_per_value(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def _gemm_s(cluster: Cluster, peak: float, m: int, n: int, k: int, e: int = 2) -> float:
    """Return a GEMM's time: its FLOPs at its shape's efficiency, or its bytes if more.

    The bytes bound matters where one dimension is small: the attention scores (k = the head
    dimension) write s² values per head for 2·head_dim FLOPs each.
    """
    flops = 2.0 * m * n * k
    compute = flops / (peak * 1e12 * gemm_efficiency(cluster.gpu, (m, n, k)))
    return max(compute, _memory_s(cluster, (m * k + k * n + m * n) * e))


def _memory_s(cluster: Cluster, nbytes: float) -> float:
    gpu = cluster.gpu
    return nbytes / (gpu.hbm_gbps * 1e9 * gpu.memory_efficiency)


def collective_s(
    cluster: Cluster,
    link: str,
    collective: str,
    nbytes: float,
    ranks: int,
    members: int = 1,
    latency: bool = True,
) -> float:
    """Return the time of ``collective`` over ``ranks`` GPUs on ``link`` (``intra_node`` or
    ``inter_node``), ``nbytes`` being nccl-tests' size (the all-reduced buffer, the gathered
    output, the message sent).

    From the cluster's measured table of that collective and link where it has one
    (:meth:`Cluster.bus_time_s`, interpolated by size), else from its constant bandwidth and
    latency (a ring: the bus factor's share of the bytes, plus a latency per step).
    ``members``: how many GPUs of the group share each node, each with its own network
    adapter, for a group across nodes: the constant is one adapter's bandwidth (times
    ``members``); a table is measured with every GPU of each node in the job (times
    ``members / gpus_per_node``). A send/recv crosses one adapter either way, and so does an
    all-to-all: each GPU sends its own bytes over its own adapter, every GPU of a node at once
    (each tensor-parallel rank's expert-parallel group runs its own). ``latency``: the
    constants' latency per step counted (a table's smallest size holds its own).
    """
    if ranks <= 1:
        return 0.0
    factor = bus_factor(collective, ranks)
    shared = link == "inter_node" and collective not in ("send_recv", "all_to_all")
    bus = cluster.bus_time_s(link, collective, nbytes)
    if bus is not None:
        return factor * bus * (cluster.gpus_per_node / members if shared else 1.0)
    gbps, latency_us = cluster.link(link)
    gbps *= members if shared else 1
    steps = latency_steps(collective, ranks) if latency else 0
    return factor * nbytes / (gbps * 1e9) + steps * latency_us * 1e-6


def _spans_nodes(cluster: Cluster, ranks_apart: int, count: int) -> bool:
    """Return whether ``count`` ranks ``ranks_apart`` apart reach beyond one node."""
    return ranks_apart * (count - 1) >= cluster.gpus_per_node


@dataclass(frozen=True)
class _Layer:
    """One transformer layer's times for one micro-batch on one GPU."""

    gemm_f: float
    attention_f: float
    attention_b: float
    elementwise_f: float
    tp_f: float  # exposed all-reduce time of one forward
    tp_b: float  # exposed all-reduce time of one backward
    weight_grad: float  # the share of the backward that computes weight (and bias) gradients
    bias_grads: float = 0.0  # the backward's bias-gradient reductions
    ep_f: float = 0.0  # an MoE block's all-to-alls of one forward (dispatch and combine)
    cp_f: float = 0.0  # the keys' and values' all-gather over cp (backward: a reduce-scatter)
    tp_hidden_f: float = 0.0  # tp time one forward hides under its GEMMs
    tp_hidden_b: float = 0.0  # tp time one backward hides under its GEMMs

    @property
    def forward(self) -> float:
        return (
            self.gemm_f + self.attention_f + self.elementwise_f + self.tp_f + self.ep_f + self.cp_f
        )

    def backward(self, recompute: str) -> float:
        # Selective recomputation replays the attention core, the gather included.
        core = self.attention_f + self.cp_f
        redo = {"none": 0.0, "selective": core, "full": self.forward}[recompute]
        own = 2 * self.gemm_f + self.attention_b + 2 * self.elementwise_f + self.bias_grads
        return own + self.tp_b + self.ep_f + self.cp_f + redo


def _layer(model: Model, layout: Layout, cluster: Cluster, software: Software) -> _Layer:
    family, shape = model.family, model.shape
    b, s, h, t = layout.micro_batch, shape.seq, shape.hidden, layout.tp
    heads, head_dim, a = shape.heads // t, shape.head_size, shape.attention_width
    peak = cluster.gpu.peak(software.precision)
    e = _bytes_per_value(software.precision)
    gemms = family.layer_gemms(b * s, shape, t)
    gemm = sum(_gemm_s(cluster, peak, m, n, k, e) for m, n, k in gemms)
    if software.attention == "flash":
        # Causal: half of the 4·b·s²·a/t score and context FLOPs are computed (a: the
        # heads' width, h unless head_dim is free).
        flops = 2.0 * b * s * s * a / t
        efficiency = attention_efficiency(cluster.gpu, s, head_dim)
        attention_f = flops / (peak * 1e12 * efficiency)
        attention_b = value("flash.backward_ratio") * attention_f
    else:
        scores = b * heads * s * s
        bmm = (
            heads
            * b
            * (
                _gemm_s(cluster, peak, s, s, head_dim, e)
                + _gemm_s(cluster, peak, s, head_dim, s, e)
            )
        )
        # Scale-mask-softmax read and written once, dropout read, written, and its mask (1 B);
        # backward: dropout's and softmax's gradients (read 3, write 2 values, and the mask).
        # The context's heads are permuted back into place: b·s·a/t values copied.
        permute = _memory_s(cluster, 2 * b * s * a / t * e)
        attention_f = bmm + _memory_s(cluster, scores * (4 * e + 1)) + permute
        attention_b = 2 * bmm + _memory_s(cluster, scores * (5 * e + 1)) + 2 * permute
    # Norms and dropout-residual adds (replicated over tp unless sequence-parallel), and the
    # family's split pointwise ops (an MLP's activation, a rotation of q and k): values read
    # and written, plus dropout masks.
    replicated = b * s * h / (t if layout.sequence_parallel else 1)
    elementwise = _memory_s(
        cluster,
        replicated * (2 * 2 * e + 2 * (3 * e + 1))
        + b * s * family.split_pointwise_values(shape, t) * e,
    )
    if software.separate_bias_pass:  # the q|k|v output read and written once more
        elementwise += _memory_s(cluster, 2 * b * s * 3 * h / t * e)
    # Backward: each linear's bias gradient sums its output gradient over the tokens. A GEMM
    # narrower at t than whole is column-parallel: its bias is split, summed over all b·s
    # tokens. The others (row-parallel) hold their whole bias, summed over s/t tokens with
    # sequence parallelism, whose reduce-scatter leaves each rank its share of them.
    bias_grads = 0.0
    if family.biases:
        row_tokens = b * s / (t if layout.sequence_parallel else 1)
        whole = family.layer_gemms(b * s, shape, 1)
        values = sum(
            (b * s if n < n_whole else row_tokens) * n
            for (_, n, _), (_, n_whole, _) in zip(gemms, whole, strict=True)
        )
        bias_grads = _memory_s(cluster, values * e)
    # Two all-reduces per layer; under sequence parallelism an all-gather and a
    # reduce-scatter each (the same bytes on a ring).
    link = "inter_node" if _spans_nodes(cluster, 1, t) else "intra_node"
    pair = ("all_gather", "reduce_scatter") if layout.sequence_parallel else ("all_reduce",) * 2
    tp = sum(collective_s(cluster, link, op, b * s * h * e, t) for op in pair)
    tp_f = tp_b = tp
    if software.tp_overlap and layout.sequence_parallel:
        # Under the GEMMs they feed and follow (Transformer Engine's overlap splits sequence
        # parallelism's all-gathers and reduce-scatters); the backward's GEMMs are twice as long.
        tp_f, tp_b = max(0.0, tp - gemm), max(0.0, tp - 2 * gemm)
    # zb-h1's weight pass: the weight GEMMs and the bias gradients.
    return _Layer(
        gemm,
        attention_f,
        attention_b,
        elementwise,
        tp_f,
        tp_b,
        gemm + bias_grads,
        bias_grads,
        tp_hidden_f=tp - tp_f,
        tp_hidden_b=tp - tp_b,
    )


def per_rank_model(model: Model, layout: Layout) -> Model:
    """Return the model as one context-parallel rank computes it: s/cp tokens a sequence (the
    model itself at cp = 1)."""
    if layout.cp == 1:
        return model
    return replace(model, shape=replace(model.shape, seq=model.shape.seq // layout.cp))


def kv_gather_bytes(model: Model, layout: Layout, software: Software) -> float:
    """Return the bytes of one layer's keys and values of the whole sequence on a rank (its
    t-th of the key/value heads): what the cp all-gather hands each rank."""
    shape = model.shape
    # With fewer key/value heads than tp ranks each rank keeps the one its queries use.
    kv = max(shape.head_size, (shape.kv_heads or shape.heads) * shape.head_size // layout.tp)
    return 2 * layout.micro_batch * shape.seq * kv * _bytes_per_value(software.precision)


def _context_layer(
    model: Model, layout: Layout, cluster: Cluster, software: Software, local: _Layer
) -> _Layer:
    """Return a layer's times at cp > 1 from ``local``, its times on s/cp tokens: the
    attention core cp times as long (s/cp queries over s keys), and the keys' and values'
    all-gather (its reverse, a reduce-scatter, in the backward)."""
    cp, t = layout.cp, layout.tp
    nbytes = kv_gather_bytes(model, layout, software)
    if t * cp <= cluster.gpus_per_node:
        gather = collective_s(cluster, "intra_node", "all_gather", nbytes, cp)
    else:
        # Across nodes, t ranks apart: each node holds gpus_per_node / t members of the group,
        # each with its own adapter (as the data-parallel all-reduce's ring).
        members = max(1, cluster.gpus_per_node // t)
        across = collective_s(cluster, "inter_node", "all_gather", nbytes, cp, members)
        inside = collective_s(cluster, "intra_node", "all_gather", nbytes, cp, latency=False)
        gather = max(across, inside)
    return replace(
        local, attention_f=cp * local.attention_f, attention_b=cp * local.attention_b, cp_f=gather
    )


def _mlp_gemms_s(
    cluster: Cluster, peak: float, rows: int, hidden: int, width: int, t: int, m: int, e: int
) -> float:
    """Return the forward GEMMs of an MLP of this width on ``rows`` tokens at t, as the
    families' ``layer_gemms`` give the dense one: m − 1 up (rows, width/t, hidden), one down
    (rows, hidden, width/t)."""
    up = _gemm_s(cluster, peak, rows, width // t, hidden, e)
    return (m - 1) * up + _gemm_s(cluster, peak, rows, hidden, width // t, e)


def all_to_all_bytes(model: Model, layout: Layout, software: Software) -> float:
    """Return what one of an MoE block's all-to-alls moves from each rank: the T·k rows of
    the micro-batch's T tokens (whole on every tp rank), each to the rank holding its expert
    (nccl-tests' size: the rank's own share included)."""
    if model.experts is None:
        return 0.0
    rows = layout.micro_batch * model.shape.seq * model.experts.top_k
    return rows * model.shape.hidden * _bytes_per_value(software.precision)


def all_to_all_s(cluster: Cluster, nbytes: float, t: int, ep: int) -> tuple[float, str]:
    """Return one all-to-all of ``nbytes`` per rank over an expert-parallel group of ep ranks
    t apart, and how it was priced.

    The group is the t·ep ranks nearest each other (Megatron-Core's order: tp, cp, ep, dp,
    pp): inside a node when t·ep ≤ GPUs per node, else across the network. Priced from the
    cluster's ``all_to_all`` table of that link where it has one, else at the link's constant
    bandwidth (the cluster file's, an all-reduce's bus bandwidth) as an all-gather's ring:
    (ep − 1)/ep of the bytes, ep − 1 latencies.
    """
    if ep <= 1:
        return 0.0, "none: at ep = 1 every rank holds every expert"
    link = "intra_node" if t * ep <= cluster.gpus_per_node else "inter_node"
    seconds = collective_s(cluster, link, "all_to_all", nbytes, ep)
    if cluster.bus_time_s(link, "all_to_all", nbytes) is not None:
        return seconds, f"from the cluster's {link} all_to_all table"
    gbps = cluster.link(link)[0]
    return seconds, (
        f"no {link} all_to_all table: priced as an all-gather at {link}_gbps {gbps:g} GB/s"
    )


def _moe_layer(
    model: Model,
    layout: Layout,
    cluster: Cluster,
    software: Software,
    dense: _Layer,
    exchange: float,
) -> _Layer:
    """Return an MoE block's times for one micro-batch: the dense block's, its MLP's GEMMs
    traded for the router's (fp32), the E/ep local experts' on the ep·T·k/E tokens each gets
    at balance, and the shared expert's; the T·k rows gathered and scattered back (each read
    and written); the dispatch's and the combine's all-to-alls (``exchange`` each)."""
    experts, shape, m = model.experts, model.shape, model.family.mlp_matrices
    assert experts is not None
    t, ep, h, rows = layout.tp, layout.ep, shape.hidden, layout.micro_batch * shape.seq
    peak = cluster.gpu.peak(software.precision)
    e = _bytes_per_value(software.precision)
    per_expert = max(1, math.ceil(rows * experts.top_k * ep / experts.count))
    gemm = (
        _gemm_s(cluster, cluster.gpu.peak("fp32"), rows, experts.count, h, 4)
        + experts.count // ep * _mlp_gemms_s(cluster, peak, per_expert, h, experts.ffn, t, m, e)
        - _mlp_gemms_s(cluster, peak, rows, h, _dense_ffn(shape), t, m, e)
    )
    if experts.shared_ffn:
        gemm += _mlp_gemms_s(cluster, peak, rows, h, experts.shared_ffn, t, m, e)
    moved = _memory_s(cluster, 2 * 2 * rows * experts.top_k * h * e)
    return replace(
        dense,
        gemm_f=dense.gemm_f + gemm,
        elementwise_f=dense.elementwise_f + moved,
        weight_grad=dense.weight_grad + gemm,
        ep_f=2 * exchange,
    )


def _dp_allreduce_s(cluster: Cluster, nbytes: float, t: int, d: int) -> float:
    """Return the data-parallel all-reduce: a ring over the d replicas of each shard, t ranks
    apart; across nodes each node holds gpus_per_node / t members of the ring, each with its
    own adapter, and the ring is no faster than its links inside a node."""
    if not _spans_nodes(cluster, t, d):
        return collective_s(cluster, "intra_node", "all_reduce", nbytes, d)
    members = max(1, cluster.gpus_per_node // t)
    across = collective_s(cluster, "inter_node", "all_reduce", nbytes, d, members)
    inside = collective_s(cluster, "intra_node", "all_reduce", nbytes, d, latency=False)
    if cluster.bus_time_s("intra_node", "all_reduce", nbytes) is None:
        # Every step of the ring waits on the network's latency too.
        inside += latency_steps("all_reduce", d) * cluster.inter_node_latency_us * 1e-6
    return max(across, inside)


def _in_flight(layout: Layout, m: int) -> float:
    """Return the activations the first pipeline rank holds at its peak, in stage units."""
    p, v = layout.pp, layout.vpp
    if layout.schedule == "gpipe":
        return m
    if layout.schedule == "interleaved":
        return min(m, p + (p - 1) / v)
    return min(m, p)


def _activation_bytes_per_layer(model: Model, layout: Layout, software: Software) -> float:
    shape, b, t = model.shape, layout.micro_batch, layout.tp
    sbh = shape.seq * b * shape.hidden * _bytes_per_value(software.precision) / 2
    # Selective recomputation keeps no attention scores, as flash attention stores none.
    flash = software.attention == "flash" or layout.recompute == "selective"
    return sbh * model.family.activation_factor(shape, t, layout.sequence_parallel, flash)


def _moe_activation_bytes(model: Model, layout: Layout, software: Software) -> float:
    """Return what an MoE block stores per micro-batch beyond a dense block.

    Its experts' intermediates: top_k expert MLPs of their width and the shared one in place
    of the dense MLP, m 16-bit values per token and unit of width (GeLU's input and output,
    SwiGLU's gate, up and product: the families' count of the dense MLP), split over t; the
    T·k rows gathered for the experts and the experts' outputs (which the router weights'
    gradient reads), whole on every tp rank; the router's fp32 logits and probabilities (T·E
    each).
    """
    experts, shape = model.experts, model.shape
    if experts is None:
        return 0.0
    h, t = shape.hidden, layout.tp
    width = experts.top_k * experts.ffn + experts.shared_ffn - _dense_ffn(shape)
    factor = 2 * model.family.mlp_matrices * width / (h * t) + 2 * 2 * experts.top_k
    sbh = shape.seq * layout.micro_batch * h * _bytes_per_value(software.precision) / 2
    return sbh * factor + shape.seq * layout.micro_batch * experts.count * 2 * 4


def _state_bytes(software: Software) -> tuple[int, int, int]:
    """Return the bytes per parameter of the weights, gradients and optimizer state."""
    return (2, 4, 12) if software.weights == "mixed" else (4, 4, 8)


def memory_parts(
    model: Model, layout: Layout, cluster: Cluster, software: Software, global_batch: int
) -> dict[str, float]:
    """Return the busiest rank's memory in GB by part: weights, gradients, optimizer, the
    routed experts' three together (``experts``, MoE models only), activations, logits.

    The distributed optimizer shards the optimizer state of all but the routed experts over
    d, and the routed experts' over their d/ep expert-data-parallel replicas.
    """
    t, p, v = layout.tp, layout.pp, layout.vpp
    m = BatchPlan.of(global_batch, layout.micro_batch, layout.dp, "--global-batch").accumulation
    whole, model = model, per_rank_model(model, layout)  # s/cp tokens a sequence from here
    shape = model.shape
    layers_per_rank = v * math.ceil(shape.layers / (p * v))
    params, routed = rank_parameters_by_kind(model, layout)
    weight_b, grad_b, optimizer_b = _state_bytes(software)
    expert_optimizer_b: float = optimizer_b
    if software.distributed_optimizer:
        optimizer_b /= layout.replicas
        expert_optimizer_b /= layout.replicas // layout.ep
    per_layer = _activation_bytes_per_layer(model, layout, software)
    if layout.cp > 1:
        # Unfused attention's scores: s/cp queries over s keys, cp times those of s/cp tokens.
        fused = _activation_bytes_per_layer(model, layout, replace(software, attention="flash"))
        per_layer += (layout.cp - 1) * (per_layer - fused)
        if layout.recompute == "none":
            per_layer += kv_gather_bytes(whole, layout, software)  # kept for the backward
    moe_blocks = moe_blocks_per_rank(model, layout)
    per_moe = _moe_activation_bytes(model, layout, software)
    e = _bytes_per_value(software.precision)
    s, b, h = shape.seq, layout.micro_batch, shape.hidden
    if layout.recompute == "full":
        inputs = s * b * h * e / (t if layout.sequence_parallel else 1)
        activations = inputs * layers_per_rank * _in_flight(layout, m) + per_layer + per_moe
    else:
        # _in_flight counts the rank's whole stage (all v chunks) per micro-batch held.
        stored = per_layer * layers_per_rank + moe_blocks * per_moe
        activations = stored * _in_flight(layout, m)
    logits = 2 * s * b * shape.vocab / t * 4  # fp32 logits and their gradient, one micro-batch
    parts = {
        "weights": params * weight_b / 1e9,
        "gradients": params * grad_b / 1e9,
        "optimizer": params * optimizer_b / 1e9,
    }
    if model.experts is not None:
        parts["experts"] = routed * (weight_b + grad_b + expert_optimizer_b) / 1e9
    return {**parts, "activations": activations / 1e9, "logits": logits / 1e9}


def _gradient_sync_s(
    cluster: Cluster, software: Software, layout: Layout, params: float, routed: float
) -> float:
    """Return the step's data-parallel all-reduces: the gradients of all but the routed
    experts over the d replicas of each shard (t ranks apart), the routed experts' over their
    d/ep expert-data-parallel replicas (t·ep ranks apart)."""
    t, d, ep = layout.tp, layout.replicas, layout.ep
    per_parameter: float = software.grad_bytes
    if software.distributed_optimizer:
        # A reduce-scatter of the gradients and an all-gather of the updated weights, each half
        # of an all-reduce's ring: the weights travel in their own precision.
        per_parameter = (software.grad_bytes + _state_bytes(software)[0]) / 2
    seconds = _dp_allreduce_s(cluster, params * per_parameter, t, d) if d > 1 else 0.0
    if routed and d // ep > 1:
        seconds += _dp_allreduce_s(cluster, routed * per_parameter, t * ep, d // ep)
    return seconds


def _optimizer_s(
    cluster: Cluster, software: Software, layout: Layout, params: float, routed: float
) -> float:
    """Return the step after the backward at HBM speed: its passes over the state this rank
    updates (with the distributed optimizer 1/d of it, of the routed experts' 1/(d/ep))."""
    shards, expert_shards = (1, 1)
    if software.distributed_optimizer:
        shards, expert_shards = layout.replicas, layout.replicas // layout.ep
    nbytes = software.optimizer_bytes
    return _memory_s(cluster, params * nbytes / shards + routed * nbytes / expert_shards)


def _p2p_s(cluster: Cluster, layout: Layout, nbytes: float) -> float:
    """Return one micro-batch's pipeline point-to-point time on a rank: an activation of
    ``nbytes`` forward and its gradient back per chunk boundary (v of them), 1/t of it per GPU
    with scatter/gather or sequence parallelism (then, without the latter, an all-gather
    inside the node)."""
    t, p = layout.tp, layout.pp
    if p == 1:
        return 0.0
    link = "inter_node" if _spans_nodes(cluster, t * layout.cp * layout.dp, 2) else "intra_node"
    split = t > 1 and (layout.scatter_gather or layout.sequence_parallel)
    one = collective_s(cluster, link, "send_recv", nbytes / t if split else nbytes, 2)
    if split and not layout.sequence_parallel:  # the all-gather inside the node
        one += collective_s(cluster, "intra_node", "all_gather", nbytes, t, latency=False)
    return 2 * layout.vpp * one


def _hidden_dp_s(
    software: Software, pp: int, dp_time: float, stage_f: float, stage_b: float
) -> float:
    """Return the data-parallel time the software hides: none, the last backward's worth, or
    with the parameter all-gather overlapped (Megatron-Core) the gradients' reduce-scatter
    under the last backward and the weights' all-gather under the next step's first forward,
    each its share of the bytes."""
    if not software.dp_overlap or (pp > 1 and not software.dp_overlap_with_pipeline):
        return 0.0
    if software.param_gather_overlap and software.distributed_optimizer:
        grads, weights = software.grad_bytes, _state_bytes(software)[0]
        gather = dp_time * weights / (grads + weights)
        return min(dp_time - gather, stage_b) + min(gather, stage_f)
    return min(dp_time, stage_b)


def estimate(
    model: Model, layout: Layout, cluster: Cluster, software: Software, global_batch: int
) -> Estimate:
    """Return the time and memory of one training step of ``layout``."""
    t, p, d, v, b = layout.tp, layout.pp, layout.dp, layout.vpp, layout.micro_batch
    m = BatchPlan.of(global_batch, b, d, "--global-batch").accumulation
    peak = cluster.gpu.peak(software.precision)
    e = _bytes_per_value(software.precision)
    whole, model = model, per_rank_model(model, layout)  # s/cp tokens a sequence from here
    family, shape = model.family, model.shape
    layer = _layer(model, layout, cluster, software)
    if layout.cp > 1:
        layer = _context_layer(whole, layout, cluster, software, layer)
    layers_per_rank = v * math.ceil(shape.layers / (p * v))
    # The rank's MoE blocks run as ``moe``, the rest as ``layer``.
    moe_blocks = moe_blocks_per_rank(model, layout)
    moe, pricing = layer, None
    if model.experts is not None:
        nbytes = all_to_all_bytes(model, layout, software)
        exchange, pricing = all_to_all_s(cluster, nbytes, t, layout.ep)
        moe = _moe_layer(model, layout, cluster, software, layer, exchange)
    dense_blocks = layers_per_rank - moe_blocks
    s, h = shape.seq, shape.hidden
    # The output layer (last stage): logits GEMM, the loss over b·s·V/t values.
    head_gemm = _gemm_s(cluster, peak, b * s, shape.vocab // t, h, e)
    logits = b * s * shape.vocab / t
    loss_f, loss_b = (_memory_s(cluster, logits * n) for n in software.loss_bytes)
    stage_f = dense_blocks * layer.forward + moe_blocks * moe.forward + head_gemm + loss_f
    stage_b = (
        dense_blocks * layer.backward(layout.recompute)
        + moe_blocks * moe.backward(layout.recompute)
        + 2 * head_gemm
        + loss_b
    )
    stage_w = dense_blocks * layer.weight_grad + moe_blocks * moe.weight_grad + head_gemm
    p2p = _p2p_s(cluster, layout, b * s * h * e)
    # Each micro-batch's weight gradients are added into the step's (read both, write one).
    params, routed = rank_parameters_by_kind(model, layout)
    stage_b += _memory_s(cluster, (params + routed) * software.grad_accumulation_bytes)
    compute = m * (stage_f + stage_b)
    if p > 1:
        if layout.schedule == "zb-h1":
            ratio = theory_bubble("zb-h1", p, m, 1, stage_f, stage_b - stage_w, stage_w)
        else:
            ratio = theory_bubble(layout.schedule, p, m, v, stage_f, stage_b, 0.0)
        bubble = ratio * m * (stage_f + stage_b) + (p - 1) / v * p2p
    else:
        bubble = 0.0
    # Overlapped, the steady state's transfers hide behind the next chunk; the warm-up's
    # (the bubble's term above) stay on the critical path.
    overlapped = software.p2p_overlap and layout.schedule == "interleaved"
    pp_exposed = 0.0 if overlapped else m * p2p
    pp_hidden = m * p2p - pp_exposed
    # The tied embedding's gradient, summed between the first and the last stage: where the
    # family's rules put a tensor on both (``first+last``) and this shape ties it.
    tied = shape.tied and any(rule.stage == "first+last" for rule in family.tensors)
    if p > 1 and tied:
        far = _spans_nodes(cluster, (p - 1) * t * layout.cp * d, 2)
        pp_exposed += collective_s(
            cluster,
            "inter_node" if far else "intra_node",
            "all_reduce",
            padded_vocab(shape.vocab, t) * h / t * software.grad_bytes,
            2,
        )
    dp_time = _gradient_sync_s(cluster, software, layout, params, routed)
    hidden_dp = _hidden_dp_s(software, p, dp_time, stage_f, stage_b)
    dp_exposed = dp_time - hidden_dp
    optimizer = _optimizer_s(cluster, software, layout, params, routed)
    # The tp and ep collectives of every forward: once more in the backward, and in a full
    # recomputation's forward.
    passes = 2 + (layout.recompute == "full")
    forwards = passes - 1
    tp_total = m * layers_per_rank * (layer.tp_f * forwards + layer.tp_b)
    tp_hidden = m * layers_per_rank * (layer.tp_hidden_f * forwards + layer.tp_hidden_b)
    ep_total = m * moe_blocks * moe.ep_f * passes
    # The gather forward, its reduce-scatter backward, and the gather again where recomputed.
    cp_total = m * layers_per_rank * layer.cp_f * (2 + (layout.recompute != "none"))
    step_time = compute + bubble + pp_exposed + dp_exposed + optimizer
    gpus = layout.gpus
    done = whole.step_flops(global_batch, layout.recompute)
    useful = whole.step_flops(global_batch, "none")
    parts = memory_parts(whole, layout, cluster, software, global_batch)
    usable = cluster.gpu.memory_gb * cluster.usable_memory_fraction
    time_parts = {"compute": compute - tp_total - ep_total - cp_total, "tp": tp_total}
    if model.experts is not None:
        time_parts["ep"] = ep_total
    if layout.cp > 1:
        time_parts["cp"] = cp_total
    return Estimate(
        layout=layout,
        step_time_s=step_time,
        tflops_per_gpu=done / step_time / gpus / 1e12,
        mfu=useful / step_time / gpus / (peak * 1e12),
        tokens_per_s=global_batch * whole.shape.seq / step_time,
        bubble=bubble / step_time,
        memory_parts_gb=parts,
        fits=sum(parts.values()) <= usable,
        time_parts_s={
            **time_parts,
            "bubble": bubble,
            "pp": pp_exposed,
            "dp": dp_exposed,
            "optimizer": optimizer,
        },
        hidden_comm_s={"dp": hidden_dp, "tp": tp_hidden, "pp": pp_hidden},
        all_to_all_pricing=pricing,
    )
