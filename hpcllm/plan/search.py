"""Every valid layout of a model on N GPUs, estimated, ranked, and why each loser lost.

A model with MoE blocks adds one dimension, the expert-parallel size ep: every divisor of d
that divides the experts (Megatron-Core carves the ep ranks out of d). A dense model is
planned at ep = 1 only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hpcllm import families
from hpcllm.config import BatchPlan, load_config
from hpcllm.plan.costs import Estimate, Layout, Model, Software, all_to_all_bytes, estimate
from hpcllm.plan.hardware import Cluster
from hpcllm.user_error import UserError

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
VIRTUAL_STAGES = (2, 3, 4, 5, 6, 7, 8)


@dataclass(frozen=True)
class Fixed:
    """Layout choices the user fixed; None leaves a choice to the search."""

    tp: int | None = None
    pp: int | None = None
    vpp: int | None = None
    micro_batch: int | None = None
    schedule: str | None = None
    recompute: str | None = None
    sequence_parallel: bool | None = None
    ep: int | None = None
    cp: int | None = None


# Sequences this long or longer are searched at cp > 1 too (Megatron-Core's guidance puts
# context parallelism at 8K tokens and up); shorter ones only at a cp the user fixes.
LONG_SEQUENCE = 8192


@dataclass
class Plan:
    """The ranked layouts that fit, and the rest with the reason each lost."""

    model: Model
    gpus: int
    global_batch: int
    cluster: Cluster
    software: Software
    ranked: list[Estimate]
    losers: list[tuple[Estimate, str]] = field(default_factory=list)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def check_request(model: Model, gpus: int, global_batch: int, fixed: Fixed) -> None:
    """Refuse, in one line, a request no layout can meet."""
    shape = model.shape
    for name, value in (
        ("--gpus", gpus),
        ("--global-batch", global_batch),
        ("--layers", shape.layers),
        ("--hidden", shape.hidden),
        ("--heads", shape.heads),
        ("--seq", shape.seq),
        ("--vocab", shape.vocab),
    ):
        if value < 1:
            raise UserError(f"{name} must be positive, got {value}")
    if shape.hidden % shape.heads and not shape.head_dim:
        raise UserError(f"--hidden {shape.hidden} is not divisible by --heads {shape.heads}")
    if fixed.tp and shape.heads % fixed.tp:
        raise UserError(f"--heads {shape.heads} is not divisible by --tp {fixed.tp}")
    grid = (fixed.tp or 1) * (fixed.pp or 1)
    if gpus % grid:
        raise UserError(
            f"--gpus {gpus} is not divisible by tp x pp = {grid}; choose t and p whose product "
            f"divides {gpus}"
        )
    _check_context(model, gpus, grid, fixed)
    _check_experts(model, gpus, grid, fixed)
    if fixed.pp and fixed.pp * (fixed.vpp or 1) > shape.layers:
        raise UserError(
            f"--pp {fixed.pp} x --vpp {fixed.vpp or 1} stages exceed the model's {shape.layers} "
            "layers"
        )
    if fixed.vpp and fixed.vpp > 1 and fixed.schedule not in (None, "interleaved"):
        raise UserError(f"--vpp {fixed.vpp} needs --schedule interleaved")
    pipelined = fixed.schedule not in (None, "1f1b") or (fixed.vpp or 1) > 1
    if pipelined and fixed.pp == 1:
        what = f"--vpp {fixed.vpp}" if (fixed.vpp or 1) > 1 else f"--schedule {fixed.schedule}"
        raise UserError(f"{what} needs a pipeline (--pp > 1)")


def _check_context(model: Model, gpus: int, grid: int, fixed: Fixed) -> None:
    """Refuse, in one line, a fixed cp the sequence, the GPUs or the experts cannot take."""
    cp = fixed.cp
    if not cp or cp == 1:
        return
    if model.shape.seq % (2 * cp):
        raise UserError(f"--cp {cp} cuts --seq {model.shape.seq} into 2 x cp chunks; it does not")
    if gpus % (grid * cp):
        raise UserError(f"--gpus {gpus} is not divisible by tp x pp x cp = {grid * cp}")
    if model.experts is not None:
        raise UserError(
            f"--cp {cp}: hpcllm trains mixtures of experts at cp = 1 only (their balancing loss "
            "and capacity count one rank's tokens)"
        )


def _context_sizes(model: Model, rest: int, t: int, fixed: Fixed) -> list[int]:
    """Return the cp sizes to plan with ``rest`` GPUs left after t: the fixed one where it
    divides them (and cuts the sequence into 2·cp·t parts), every divisor that does for a long
    sequence (:data:`LONG_SEQUENCE`), else 1; 1 only for a mixture of experts."""
    seq = model.shape.seq
    if fixed.cp is not None:
        cp = fixed.cp
        return [cp] if rest % cp == 0 and (cp == 1 or seq % (2 * cp * t) == 0) else []
    if seq < LONG_SEQUENCE or model.experts is not None:  # MoE blocks train at cp = 1 only
        return [1]
    return [1] + [c for c in _divisors(rest) if c > 1 and seq % (2 * c * t) == 0]


def _check_experts(model: Model, gpus: int, grid: int, fixed: Fixed) -> None:
    """Refuse, in one line, a fixed ep or t the model's experts cannot take."""
    experts, ep = model.experts, fixed.ep
    if experts is None:
        if ep and ep > 1:
            raise UserError(
                f"--ep {ep} splits the experts of MoE blocks, but this model is dense (give "
                "--set model.moe_experts=E for a mixture of experts)"
            )
        return
    if ep and experts.count % ep:
        raise UserError(f"--ep {ep} does not divide the model's {experts.count} experts")
    if ep and gpus % (grid * ep):
        raise UserError(
            f"--gpus {gpus} is not divisible by tp x pp x ep = {grid * ep} (the ep ranks are "
            "carved out of d)"
        )
    for name, width in (("moe_ffn_size", experts.ffn), ("moe_shared_ffn_size", experts.shared_ffn)):
        if fixed.tp and width % fixed.tp:
            raise UserError(f"--tp {fixed.tp} does not divide the experts' width {width} ({name})")


def _splits_experts(model: Model, t: int) -> bool:
    """Return whether t splits the widths of the model's experts (a dense model: always)."""
    experts = model.experts
    return experts is None or (experts.ffn % t == 0 and experts.shared_ffn % t == 0)


def _expert_sizes(model: Model, d: int, fixed: Fixed) -> list[int]:
    """Return the ep sizes to plan at d: 1 for a dense model; else the fixed one where it
    divides d, or every divisor of d that divides the experts."""
    if model.experts is None:
        return [1]
    if fixed.ep is not None:
        return [fixed.ep] if d % fixed.ep == 0 else []
    return [k for k in _divisors(d) if model.experts.count % k == 0]


def _schedules(
    p: int, m: int, layers: int, fixed: Fixed, software: Software
) -> Iterator[tuple[str, int]]:
    if p == 1:
        yield "1f1b", 1
        return
    for schedule in software.schedules:
        if fixed.schedule not in (None, schedule):
            continue
        if schedule == "interleaved":
            if p < software.interleave_min_pp:
                continue
            if fixed.vpp is not None:
                choices: tuple[int, ...] = (fixed.vpp,)
            elif software.even_stages:  # v divides the layers of a stage
                choices = tuple(v for v in _divisors(layers // p) if v > 1)
            else:
                choices = VIRTUAL_STAGES
            for v in choices:
                # Megatron's interleaved schedule takes micro-batches in groups of p.
                even = not software.even_stages or (layers // p) % v == 0
                if v > 1 and m % p == 0 and p * v <= layers and even:
                    yield schedule, v
        elif fixed.vpp in (None, 1) and (schedule != "zb-h1" or m >= p):
            yield schedule, 1


def _grids(
    model: Model, gpus: int, fixed: Fixed, software: Software
) -> Iterator[tuple[int, int, int, int, int]]:
    """Yield every grid (t, p, d, ep, cp) of ``gpus`` the search considers."""
    heads, layers = model.shape.heads, model.shape.layers
    for t in _divisors(gpus) if fixed.tp is None else [fixed.tp]:
        if heads % t or not _splits_experts(model, t):
            continue
        for cp in _context_sizes(model, gpus // t, t, fixed):
            for p in _divisors(gpus // (t * cp)) if fixed.pp is None else [fixed.pp]:
                if p > layers or gpus % (t * cp * p):
                    continue
                if software.even_stages and layers % p:
                    continue
                # One stage runs 1f1b (plain accumulation): a fixed pipeline choice needs p > 1.
                if p == 1 and (fixed.schedule not in (None, "1f1b") or (fixed.vpp or 1) > 1):
                    continue
                d = gpus // (t * cp * p)
                for ep in _expert_sizes(model, d, fixed):
                    if cp == 1 or ep == 1:  # ep is not carved out of d x cp
                        yield t, p, d, ep, cp


def layouts(
    model: Model,
    gpus: int,
    global_batch: int,
    fixed: Fixed,
    software: Software | None = None,
) -> Iterator[Layout]:
    """Yield every layout the search considers (the fixed choices held) that the software
    runs."""
    software = software or Software()
    for t, p, d, ep, cp in _grids(model, gpus, fixed, software):
        for b in MICRO_BATCHES if fixed.micro_batch is None else (fixed.micro_batch,):
            if not BatchPlan.divides(global_batch, b, d):
                continue  # micro-batches of b on d replicas do not make the global batch
            m = BatchPlan.of(global_batch, b, d).accumulation
            sp = fixed.sequence_parallel
            if sp is None:  # it saves memory at no cost in time, where the code has it
                sp = t > 1 and software.can_sequence_parallel
            recomputes = software.recomputes if fixed.recompute is None else (fixed.recompute,)
            for schedule, v in _schedules(p, m, model.shape.layers, fixed, software):
                for recompute in recomputes:
                    yield Layout(t, p, d, v, b, schedule, recompute, sp and t > 1, ep=ep, cp=cp)


def _why(loser: Estimate, best: Estimate, cluster: Cluster) -> str:
    """Return the one reason ``loser`` is slower than ``best``, or does not run at all."""
    lay = loser.layout
    if not loser.fits:
        usable = cluster.gpu.memory_gb * cluster.usable_memory_fraction
        return f"does not fit: {loser.memory_gb:.1f} GB of {usable:.1f} GB usable"
    if lay.tp > cluster.gpus_per_node:
        return f"tp {lay.tp} spans nodes ({cluster.gpus_per_node} GPUs per node)"
    names = {
        "compute": "compute (micro-batch size, recomputation)",
        "tp": "tensor-parallel all-reduces",
        "ep": "expert all-to-alls",
        "cp": "context-parallel key/value gathers",
        "bubble": "pipeline bubble",
        "pp": "pipeline transfers",
        "dp": "data-parallel all-reduce",
        "optimizer": "optimizer step",
    }
    parts = [k for k in names if k in loser.time_parts_s]  # "ep": MoE models only; "cp": cp > 1
    excess = {k: loser.time_parts_s[k] - best.time_parts_s.get(k, 0.0) for k in parts}
    part = max(excess, key=lambda k: excess[k])
    slower = loser.step_time_s / best.step_time_s - 1
    return f"{slower:+.0%} step time, most from {names[part]} (+{excess[part]:.3g} s)"


def search(
    model: Model,
    gpus: int,
    global_batch: int,
    cluster: Cluster,
    software: Software,
    fixed: Fixed = Fixed(),
) -> Plan:
    """Return every layout's estimate: those that fit ranked by step time, then the rest."""
    check_request(model, gpus, global_batch, fixed)
    if fixed.schedule and fixed.schedule not in software.schedules:
        raise UserError(
            f"--schedule {fixed.schedule}: this software runs {', '.join(software.schedules)}"
        )
    _check_software_layout(model, fixed, software)
    found = [
        estimate(model, layout, cluster, software, global_batch)
        for layout in layouts(model, gpus, global_batch, fixed, software)
    ]
    if not found:
        raise UserError(
            f"no layout of {gpus} GPUs divides the global batch {global_batch} and the model's "
            f"{model.shape.heads} heads and {model.shape.layers} layers with the choices given"
        )
    in_node = [e for e in found if e.fits and e.layout.tp <= cluster.gpus_per_node] or [
        e for e in found if e.fits
    ]
    ranked = sorted(in_node, key=lambda e: e.step_time_s)
    if ranked:
        best = ranked[0]
        others = (e for e in found if e is not best)
        rest = sorted(others, key=lambda e: (not e.fits, e.step_time_s))
    else:  # nothing fits: the losers, smallest first, are the closest to fitting
        rest = sorted(found, key=lambda e: e.memory_gb)
        best = rest[0]
    return Plan(
        model,
        gpus,
        global_batch,
        cluster,
        software,
        ranked,
        [(e, _why(e, best, cluster)) for e in rest],
    )


def _check_software_layout(model: Model, fixed: Fixed, software: Software) -> None:
    """Refuse, in one line, a fixed choice the software does not run."""
    if fixed.recompute is not None and fixed.recompute not in software.recomputes:
        raise UserError(
            f"--recompute {fixed.recompute}: this software recomputes "
            f"{' or '.join(software.recomputes)} only"
        )
    if fixed.sequence_parallel and not software.can_sequence_parallel:
        raise UserError("--sequence-parallel: this software has no sequence parallelism")
    p, v, layers = fixed.pp, fixed.vpp, model.shape.layers
    interleaved = fixed.schedule == "interleaved" or (v or 1) > 1
    if software.even_stages and p and layers % p:
        raise UserError(f"--pp {p}: this software needs the {layers} layers divisible by p")
    if interleaved and p and p < software.interleave_min_pp:
        raise UserError(
            f"--pp {p}: this software runs the interleaved schedule at p >= "
            f"{software.interleave_min_pp} only"
        )
    if interleaved and software.even_stages and p and v and (layers // p) % v:
        raise UserError(
            f"--vpp {v}: this software needs v to divide the {layers // p} layers of a stage"
        )


def layout_record(e: Estimate) -> dict[str, Any]:
    """Return one layout as the JSON output holds it; of an MoE model, with its ep and how
    its all-to-all was priced (its time is ``time_parts_s["ep"]``, the routed experts' memory
    ``memory_parts_gb["experts"]``)."""
    lay = e.layout
    moe = {} if e.all_to_all_pricing is None else {"ep": lay.ep}
    if lay.cp > 1:
        moe["cp"] = lay.cp
    priced = {} if e.all_to_all_pricing is None else {"all_to_all_pricing": e.all_to_all_pricing}
    return {
        "tp": lay.tp,
        "pp": lay.pp,
        "dp": lay.dp,
        **moe,
        "vpp": lay.vpp,
        "micro_batch": lay.micro_batch,
        "schedule": lay.schedule,
        "recompute": lay.recompute,
        "sequence_parallel": lay.sequence_parallel,
        "step_time_s": e.step_time_s,
        "tflops_per_gpu": e.tflops_per_gpu,
        "mfu": e.mfu,
        "tokens_per_s": e.tokens_per_s,
        "memory_gb": e.memory_gb,
        "memory_parts_gb": dict(e.memory_parts_gb),
        "bubble": e.bubble,
        "time_parts_s": dict(e.time_parts_s),
        "hidden_comm_s": dict(e.hidden_comm_s),
        **priced,
        "fits": e.fits,
    }


def to_json(plan: Plan, top: int) -> dict[str, Any]:
    """Return the plan as one JSON-ready object, best layout first."""
    return {
        "model": {"arch": plan.model.arch, **asdict(plan.model.shape), **_experts_record(plan)},
        "gpus": plan.gpus,
        "global_batch": plan.global_batch,
        "cluster": plan.cluster.name,
        "gpu": plan.cluster.gpu.name,
        "software": asdict(plan.software),
        "layouts": [layout_record(e) for e in plan.ranked[:top]],
        "others": [{**layout_record(e), "lost_because": why} for e, why in plan.losers[: 4 * top]],
        "considered": len(plan.losers) + 1,
    }


def _own_sizes(shape: families.Shape) -> str:
    """Return the sizes a shape sets away from their defaults: fewer key/value heads than
    heads, heads other than hidden / heads wide, q/k/v biases and q/k norms, an MLP width
    other than 4·hidden, an untied output layer."""
    extra = ""
    if shape.kv_heads and shape.kv_heads != shape.heads:
        extra += f" ({shape.kv_heads} key/value)"
    if shape.head_dim and shape.attention_width != shape.hidden:
        extra += f" of {shape.head_dim}"
    variants = [name for name, on in (("q/k/v biases", shape.qkv_bias),
                                      ("q/k norms", shape.qk_norm)) if on]  # fmt: skip
    if variants:
        extra += f" with {' and '.join(variants)}"
    if shape.ffn and shape.ffn != 4 * shape.hidden:
        extra += f", MLP {shape.ffn}"
    return extra + ("" if shape.tied else ", untied output layer")


def _experts_text(model: Model) -> str:
    """Return the header's words for the model's experts ("" for a dense model)."""
    experts = model.experts
    if experts is None:
        return ""
    shared = f", shared expert {experts.shared_ffn}" if experts.shared_ffn else ""
    return (
        f", {experts.count} experts (top {experts.top_k}, MLP {experts.ffn}{shared}) in "
        f"{len(experts.blocks)} of {model.shape.layers} blocks"
    )


def _experts_record(plan: Plan) -> dict[str, Any]:
    """Return the JSON model's experts entry ({} for a dense model)."""
    experts = plan.model.experts
    return {} if experts is None else {"experts": asdict(experts)}


def _dp_hidden_behind(software: Software) -> str:
    """Return what the data-parallel reduction hides behind under this software."""
    if software.param_gather_overlap and software.distributed_optimizer:
        return "last backward (gradients) and the next first forward (weights)"
    return "backward"


def _overlap_lines(best: Estimate) -> list[str]:
    """Return the lines saying what tensor-parallel and pipeline time the software hid."""
    hidden = {k: best.hidden_comm_s.get(k, 0.0) for k in ("tp", "pp")}
    names = {"tp": "tensor-parallel collectives", "pp": "pipeline sends"}
    return [
        f"#1 {names[k]}: {best.time_parts_s[k]:.3f} s exposed, {v:.3f} s hidden under compute"
        for k, v in hidden.items()
        if v > 0
    ]


def _expert_lines(plan: Plan, best: Estimate) -> list[str]:
    """Return what the best layout does with the experts: their memory, their all-to-all."""
    experts = plan.model.experts
    if experts is None:
        return []
    lay = best.layout
    size = all_to_all_bytes(plan.model, lay, plan.software)
    return [
        f"#1 routed experts: {experts.count // lay.ep} of {experts.count} per GPU in each MoE "
        f"block, {best.memory_parts_gb['experts']:.3g} GB with their gradients and optimizer "
        "state",
        f"#1 expert all-to-all: {best.time_parts_s['ep']:.3f} s a step (dispatch and combine, "
        f"forward and backward, {size / 1e6:.3g} MB from each rank); {best.all_to_all_pricing}",
    ]


def render(plan: Plan, top: int) -> str:
    """Return the ranked table, the memory of the best, and why the next layouts lost; of an
    MoE model also ep, the all-to-all's time and the experts' memory."""
    c, shape = plan.cluster, plan.model.shape
    moe = plan.model.experts is not None
    shown = plan.ranked[:top] or [e for e, _ in plan.losers[:top]]
    # An MoE model's columns: ep after d, the all-to-all's time last; cp and its gathers' time
    # where a layout shown splits the sequence.
    ep_head, a2a_head = (f" {'ep':>3}", f" {'a2a s':>7}") if moe else ("", "")
    context = any(e.layout.cp > 1 for e in shown)
    if context:
        ep_head, a2a_head = f" {'cp':>3}{ep_head}", f"{a2a_head} {'cp s':>7}"
    lines = [
        f"{plan.model.arch}: {shape.layers} layers, hidden {shape.hidden}, "
        f"{shape.heads} heads{_own_sizes(shape)}{_experts_text(plan.model)}, seq {shape.seq}, "
        f"vocab {shape.vocab} ({plan.model.parameters() / 1e9:.2f} B parameters); global batch "
        f"{plan.global_batch} on {plan.gpus} x {c.gpu.name} ({c.gpus_per_node} per node, "
        f"{c.name}); {plan.software.precision}, attention {plan.software.attention}",
        "",
        f"{'#':>2} {'t':>3} {'p':>3} {'d':>5}{ep_head} {'v':>2} {'b':>3} {'schedule':<11} "
        f"{'recompute':<9} {'step s':>9} {'TFLOP/s':>8} {'MFU':>5} {'tokens/s':>10} "
        f"{'mem GB':>7} {'bubble':>6} {'tp s':>7} {'pp s':>7} {'dp s':>7}{a2a_head}",
    ]
    if not plan.ranked:
        lines.append("   no layout fits in memory; the closest:")
    for i, e in enumerate(shown, 1):
        lay, parts = e.layout, e.time_parts_s
        ep, a2a = (f" {lay.ep:>3}", f" {parts['ep']:>7.3f}") if moe else ("", "")
        if context:
            ep, a2a = f" {lay.cp:>3}{ep}", f"{a2a} {parts.get('cp', 0.0):>7.3f}"
        lines.append(
            f"{i:>2} {lay.tp:>3} {lay.pp:>3} {lay.dp:>5}{ep} {lay.vpp:>2} {lay.micro_batch:>3} "
            f"{lay.schedule:<11} {lay.recompute:<9} {e.step_time_s:>9.3f} "
            f"{e.tflops_per_gpu:>8.4g} {e.mfu:>5.1%} {e.tokens_per_s:>10.0f} "
            f"{e.memory_gb:>6.3g}{'' if e.fits else '!'} {e.bubble:>6.1%} {parts['tp']:>7.3f} "
            f"{parts['pp']:>7.3f} {parts['dp']:>7.3f}{a2a}"
        )
    if shown:
        best = shown[0]
        memory = ", ".join(f"{k} {v:.3g}" for k, v in best.memory_parts_gb.items())
        hidden = best.hidden_comm_s.get("dp", 0.0)
        lines += [
            "",
            f"#1 memory per GPU (GB): {memory}; of {c.gpu.memory_gb:.0f} GB, "
            f"{c.usable_memory_fraction:.0%} usable",
            f"#1 data-parallel all-reduce: {best.time_parts_s['dp']:.3f} s exposed, "
            f"{hidden:.3f} s hidden behind the {_dp_hidden_behind(plan.software)}",
            *_overlap_lines(best),
            *_expert_lines(plan, best),
            "TFLOP/s counts the FLOPs done, recomputation included (Narayanan et al.); MFU "
            "counts the model's FLOPs only",
        ]
    if plan.losers:
        lines += ["", f"why the others lost ({len(plan.losers)} layouts; the closest):"]
        for e, why in plan.losers[: max(top, 5)]:
            lay = e.layout
            ep = (f" ep={lay.ep}" if moe else "") + (f" cp={lay.cp}" if lay.cp > 1 else "")
            lines.append(
                f"  t={lay.tp} p={lay.pp} d={lay.dp}{ep} v={lay.vpp} b={lay.micro_batch} "
                f"{lay.schedule} {lay.recompute}: {why}"
            )
    return "\n".join(lines)


def write_config(plan: Plan, path: Path, preset: str | None, vocab_size: int | None = None) -> Path:
    """Write a train config for the best layout (runnable by ``hpcllm train``); return it.

    The model is written as ``--set`` would give it: the sizes every family shares and the
    family's own keys for the rest of its shape (``Family.keys_of_shape``), and an MoE
    model's experts (:meth:`Experts.keys`). ``preset`` is named only if the planned shape is
    that preset's; ``vocab_size`` is written only when given (otherwise the data's tokenizer
    decides, as in any run).
    """
    if not plan.ranked:
        raise UserError("no layout fits in memory: there is no config to write")
    lay = plan.ranked[0].layout
    model, shape = plan.model, plan.model.shape
    experts = model.experts.keys(shape) if model.experts else {}
    keys = {
        "model.arch": model.arch,
        "model.preset": preset if _is_preset(model, preset) else None,
        "model.n_layer": shape.layers,
        "model.n_head": shape.heads,
        "model.d_model": shape.hidden,
        "model.seq_len": shape.seq,
        **{f"model.{key}": value for key, value in model.family.keys_of_shape(shape).items()},
        **{f"model.{key}": value for key, value in experts.items()},
        "model.vocab_size": vocab_size,
        "model.recompute": lay.recompute,
        "parallel.tp": lay.tp,
        "parallel.pp": lay.pp,
        "parallel.dp": lay.dp,
        "parallel.ep": lay.ep,
        "parallel.cp": lay.cp,
        "parallel.vpp": lay.vpp,
        "parallel.schedule": lay.schedule,
        "parallel.sequence_parallel": lay.sequence_parallel,
        "parallel.scatter_gather": lay.scatter_gather,
        "train.micro_batch_size": lay.micro_batch,
        "train.global_batch_size": plan.global_batch,
        "train.precision": plan.software.precision,
    }
    # A JSON value is a YAML one: each reads back as itself. Checked now, not at launch.
    cfg = load_config(None, [f"{key}={json.dumps(value)}" for key, value in keys.items()])
    try:
        cfg.dump(Path(path))
    except OSError as err:
        raise UserError(f"cannot write {path}: {err.strerror or err}") from None
    return Path(path)


def _is_preset(model: Model, preset: str | None) -> bool:
    """Return whether ``preset`` is a preset of the model's family of the model's shape (its
    vocabulary aside, which the data may decide)."""
    if preset is None or families.preset_family(preset) != model.arch:
        return False
    named = load_config(None, [f"model.arch={model.arch}", f"model.preset={preset}"]).model
    return families.shape(named, model.shape.vocab) == model.shape


def draw(plan: Plan, path: Path, top: int) -> Path:
    """Draw where the step time of the top layouts goes, as stacked bars; return the PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = plan.ranked[:top]
    if not shown:
        raise UserError("no layout fits in memory: nothing to draw")
    parts = list(shown[0].time_parts_s)
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(shown) + 1.5))
    moe = plan.model.experts is not None
    labels = [
        f"t{e.layout.tp} p{e.layout.pp} d{e.layout.dp}{f' ep{e.layout.ep}' if moe else ''}"
        f"{f' cp{e.layout.cp}' if e.layout.cp > 1 else ''} "
        f"v{e.layout.vpp} b{e.layout.micro_batch} {e.layout.schedule} {e.layout.recompute}"
        for e in shown
    ]
    left = [0.0] * len(shown)
    for part in parts:
        widths = [e.time_parts_s[part] for e in shown]
        ax.barh(labels, widths, left=left, label=part)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step")
    ax.set_title(f"where the time goes: {plan.gpus} x {plan.cluster.gpu.name}")
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as err:
        raise UserError(f"cannot write {path}: {err.strerror or err}") from None
    finally:
        plt.close(fig)
    return Path(path)
