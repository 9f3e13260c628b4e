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
hpcllm overlaps it with the last backward, Megatron-LM in 2021 did not), and the optimizer's
pass over its state at HBM bandwidth.

Also the backward's bias-gradient sums, the loss's passes over the logits, the tied
embedding's gradient summed between the first and the last stage, and the optimizer's passes,
each in the way the software makes them (:class:`Software`).

Left out: kernel launch overheads, the embedding's gather, imbalance from the embedding stage,
NCCL's protocol choice, congestion between jobs, and stragglers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from hpcllm import families
from hpcllm.config import BatchPlan, padded_vocab
from hpcllm.parallel.pipeline.simulate import theory_bubble
from hpcllm.plan.hardware import Cluster, bus_factor, gemm_efficiency, latency_steps
from hpcllm.user_error import UserError

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
RECOMPUTE = ("none", "selective", "full")
SOFTWARE = ("hpcllm", "megatron-2021")


@dataclass(frozen=True)
class Model:
    """A model to plan: its family (``model.arch``), whose spec prices it (FLOPs, parameters,
    GEMMs, traffic, activations: :mod:`hpcllm.families`), and its sizes."""

    arch: str
    shape: families.Shape

    @classmethod
    def of(cls, arch: str, *sizes: int, **named: Any) -> Model:
        """Return family ``arch``'s model of these sizes (``families.Shape``'s fields, in its
        order or by name)."""
        return cls(arch, families.Shape(*sizes, **named))

    @property
    def family(self) -> families.Family:
        """Return the family's spec."""
        return families.get(self.arch)

    def parameters(self) -> int:
        """Return the parameter count (the family's)."""
        return self.family.parameters(self.shape)


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


@dataclass(frozen=True)
class Software:
    """How the training code runs a step (what it computes is the same).

    ``hpcllm()`` is this project; ``megatron_2021()`` the Megatron-LM of the SC21 paper.
    """

    precision: str = "bf16"
    attention: str = "flash"  # flash | unfused
    weights: str = "fp32"  # fp32 | mixed
    grad_bytes: int = 4  # bytes per gradient element in the data-parallel all-reduce
    dp_overlap: bool = True  # the all-reduce overlaps the last backward
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
        the data-parallel all-reduce after the backward; the 1F1B and interleaved schedules
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
            False,
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
    def named(
        cls, name: str, precision: str | None = None, distributed_optimizer: bool = False
    ) -> Software:
        """Return the software ``name`` (``hpcllm`` or ``megatron-2021``) with the precision and
        distributed optimizer asked for; a UserError where that software had neither."""
        if name not in SOFTWARE:
            raise UserError(f"unknown software {name!r}; one of {', '.join(SOFTWARE)}")
        software = cls.megatron_2021() if name == "megatron-2021" else cls.hpcllm()
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

    @property
    def memory_gb(self) -> float:
        """Return the memory per GPU, all parts."""
        return sum(self.memory_parts_gb.values())


def rank_parameters(model: Model, layout: Layout) -> float:
    """Return the parameters the first pipeline rank holds: its layers (each split over t as
    the family says), the embeddings, and the final layers when it is also the last."""
    t, family, shape = layout.tp, model.family, model.shape
    layers = layout.vpp * math.ceil(shape.layers / (layout.pp * layout.vpp))
    split, whole = family.layer_parameters(shape)
    final = family.last_parameters(shape, t) if layout.pp == 1 else 0
    return layers * (split / t + whole) + family.first_parameters(shape, t) + final


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
    ``members / gpus_per_node``). A send/recv crosses one adapter either way. ``latency``:
    the constants' latency per step counted (a table's smallest size holds its own).
    """
    if ranks <= 1:
        return 0.0
    factor = bus_factor(collective, ranks)
    shared = link == "inter_node" and collective != "send_recv"
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
    weight_grad: float  # the share of the backward that computes weight (and bias) gradients
    bias_grads: float = 0.0  # the backward's bias-gradient reductions

    @property
    def forward(self) -> float:
        return self.gemm_f + self.attention_f + self.elementwise_f + self.tp_f

    def backward(self, recompute: str) -> float:
        redo = {"none": 0.0, "selective": self.attention_f, "full": self.forward}[recompute]
        own = 2 * self.gemm_f + self.attention_b + 2 * self.elementwise_f + self.bias_grads
        return own + self.tp_f + redo


def _layer(model: Model, layout: Layout, cluster: Cluster, software: Software) -> _Layer:
    family, shape = model.family, model.shape
    b, s, h, t = layout.micro_batch, shape.seq, shape.hidden, layout.tp
    heads = shape.heads // t
    head_dim = h // shape.heads
    peak = cluster.gpu.peak(software.precision)
    e = _bytes_per_value(software.precision)
    gemms = family.layer_gemms(b * s, shape, t)
    gemm = sum(_gemm_s(cluster, peak, m, n, k, e) for m, n, k in gemms)
    if software.attention == "flash":
        # Causal: half of the 4·b·s²·h/t score and context FLOPs are computed.
        flops = 2.0 * b * s * s * h / t
        attention_f = flops / (peak * 1e12 * cluster.gpu.flash_efficiency)
        attention_b = 2.5 * attention_f
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
        # The context's heads are permuted back into place: b·s·h/t values copied.
        permute = _memory_s(cluster, 2 * b * s * h / t * e)
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
    tp_f = sum(collective_s(cluster, link, op, b * s * h * e, t) for op in pair)
    # zb-h1's weight pass: the weight GEMMs and the bias gradients.
    return _Layer(gemm, attention_f, attention_b, elementwise, tp_f, gemm + bias_grads, bias_grads)


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


def memory_parts(
    model: Model, layout: Layout, cluster: Cluster, software: Software, global_batch: int
) -> dict[str, float]:
    """Return the busiest rank's memory in GB by part (weights, gradients, optimizer, ...)."""
    t, p, v = layout.tp, layout.pp, layout.vpp
    m = BatchPlan.of(global_batch, layout.micro_batch, layout.dp, "--global-batch").accumulation
    shape = model.shape
    layers_per_rank = v * math.ceil(shape.layers / (p * v))
    params = rank_parameters(model, layout)
    if software.weights == "mixed":
        weight_b, grad_b, optimizer_b = 2, 4, 12
    else:
        weight_b, grad_b, optimizer_b = 4, 4, 8
    if software.distributed_optimizer:
        optimizer_b /= layout.dp
    per_layer = _activation_bytes_per_layer(model, layout, software)
    e = _bytes_per_value(software.precision)
    s, b, h = shape.seq, layout.micro_batch, shape.hidden
    if layout.recompute == "full":
        inputs = s * b * h * e / (t if layout.sequence_parallel else 1)
        activations = inputs * layers_per_rank * _in_flight(layout, m) + per_layer
    else:
        # _in_flight counts the rank's whole stage (all v chunks) per micro-batch held.
        activations = per_layer * layers_per_rank * _in_flight(layout, m)
    logits = 2 * s * b * shape.vocab / t * 4  # fp32 logits and their gradient, one micro-batch
    return {
        "weights": params * weight_b / 1e9,
        "gradients": params * grad_b / 1e9,
        "optimizer": params * optimizer_b / 1e9,
        "activations": activations / 1e9,
        "logits": logits / 1e9,
    }


def estimate(
    model: Model, layout: Layout, cluster: Cluster, software: Software, global_batch: int
) -> Estimate:
    """Return the time and memory of one training step of ``layout``."""
    t, p, d, v, b = layout.tp, layout.pp, layout.dp, layout.vpp, layout.micro_batch
    m = BatchPlan.of(global_batch, b, d, "--global-batch").accumulation
    peak = cluster.gpu.peak(software.precision)
    e = _bytes_per_value(software.precision)
    family, shape = model.family, model.shape
    layer = _layer(model, layout, cluster, software)
    layers_per_rank = v * math.ceil(shape.layers / (p * v))
    s, h = shape.seq, shape.hidden
    # The output layer (last stage): logits GEMM, the loss over b·s·V/t values.
    head_gemm = _gemm_s(cluster, peak, b * s, shape.vocab // t, h, e)
    logits = b * s * shape.vocab / t
    loss_f, loss_b = (_memory_s(cluster, logits * n) for n in software.loss_bytes)
    stage_f = layers_per_rank * layer.forward + head_gemm + loss_f
    stage_b = layers_per_rank * layer.backward(layout.recompute) + 2 * head_gemm + loss_b
    stage_w = layers_per_rank * layer.weight_grad + head_gemm
    # Pipeline point-to-point: an activation forward and its gradient back per chunk boundary.
    p2p = 0.0
    if p > 1:
        nbytes = b * s * h * e
        link = "inter_node" if _spans_nodes(cluster, t * d, 2) else "intra_node"
        split = t > 1 and (layout.scatter_gather or layout.sequence_parallel)
        one = collective_s(cluster, link, "send_recv", nbytes / t if split else nbytes, 2)
        if split and not layout.sequence_parallel:  # the all-gather inside the node
            one += collective_s(cluster, "intra_node", "all_gather", nbytes, t, latency=False)
        p2p = 2 * v * one
    # Each micro-batch's weight gradients are added into the step's (read both, write one).
    params = rank_parameters(model, layout)
    stage_b += _memory_s(cluster, params * software.grad_accumulation_bytes)
    compute = m * (stage_f + stage_b)
    if p > 1:
        if layout.schedule == "zb-h1":
            ratio = theory_bubble("zb-h1", p, m, 1, stage_f, stage_b - stage_w, stage_w)
        else:
            ratio = theory_bubble(layout.schedule, p, m, v, stage_f, stage_b, 0.0)
        bubble = ratio * m * (stage_f + stage_b) + (p - 1) / v * p2p
    else:
        bubble = 0.0
    pp_exposed = m * p2p
    # The tied embedding's gradient, summed between the first and the last stage: where the
    # family's rules put a tensor on both (``first+last``) and this shape ties it.
    tied = shape.tied and any(rule.stage == "first+last" for rule in family.tensors)
    if p > 1 and tied:
        far = _spans_nodes(cluster, (p - 1) * t * d, 2)
        pp_exposed += collective_s(
            cluster,
            "inter_node" if far else "intra_node",
            "all_reduce",
            padded_vocab(shape.vocab, t) * h / t * software.grad_bytes,
            2,
        )
    # Data parallelism: a ring over the d replicas of each shard, t ranks apart.
    dp_time = 0.0
    if d > 1:
        dp_time = _dp_allreduce_s(cluster, params * software.grad_bytes, t, d)
    hidden_dp = min(dp_time, stage_b) if software.dp_overlap else 0.0
    dp_exposed = dp_time - hidden_dp
    optimizer = _memory_s(
        cluster, params * software.optimizer_bytes / (d if software.distributed_optimizer else 1)
    )
    tp_total = m * layers_per_rank * layer.tp_f * (2 + (layout.recompute == "full"))
    step_time = compute + bubble + pp_exposed + dp_exposed + optimizer
    gpus = t * p * d
    done = family.step_flops(global_batch, shape, layout.recompute)
    useful = family.step_flops(global_batch, shape, "none")
    parts = memory_parts(model, layout, cluster, software, global_batch)
    usable = cluster.gpu.memory_gb * cluster.usable_memory_fraction
    return Estimate(
        layout=layout,
        step_time_s=step_time,
        tflops_per_gpu=done / step_time / gpus / 1e12,
        mfu=useful / step_time / gpus / (peak * 1e12),
        tokens_per_s=global_batch * s / step_time,
        bubble=bubble / step_time,
        memory_parts_gb=parts,
        fits=sum(parts.values()) <= usable,
        time_parts_s={
            "compute": compute - tp_total,
            "tp": tp_total,
            "bubble": bubble,
            "pp": pp_exposed,
            "dp": dp_exposed,
            "optimizer": optimizer,
        },
        hidden_comm_s={"dp": hidden_dp},
    )
