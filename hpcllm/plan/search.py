"""Every valid layout of a model on N GPUs, estimated, ranked, and why each loser lost."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hpcllm.config import BatchPlan
from hpcllm.plan.costs import Estimate, Layout, Model, Software, estimate
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
    for name, value in (
        ("--gpus", gpus),
        ("--global-batch", global_batch),
        ("--layers", model.layers),
        ("--hidden", model.hidden),
        ("--heads", model.heads),
        ("--seq", model.seq),
        ("--vocab", model.vocab),
    ):
        if value < 1:
            raise UserError(f"{name} must be positive, got {value}")
    if model.hidden % model.heads:
        raise UserError(f"--hidden {model.hidden} is not divisible by --heads {model.heads}")
    if fixed.tp and model.heads % fixed.tp:
        raise UserError(f"--heads {model.heads} is not divisible by --tp {fixed.tp}")
    grid = (fixed.tp or 1) * (fixed.pp or 1)
    if gpus % grid:
        raise UserError(
            f"--gpus {gpus} is not divisible by tp x pp = {grid}; choose t and p whose product "
            f"divides {gpus}"
        )
    if fixed.pp and fixed.pp * (fixed.vpp or 1) > model.layers:
        raise UserError(
            f"--pp {fixed.pp} x --vpp {fixed.vpp or 1} stages exceed the model's {model.layers} "
            "layers"
        )
    if fixed.vpp and fixed.vpp > 1 and fixed.schedule not in (None, "interleaved"):
        raise UserError(f"--vpp {fixed.vpp} needs --schedule interleaved")
    pipelined = fixed.schedule not in (None, "1f1b") or (fixed.vpp or 1) > 1
    if pipelined and fixed.pp == 1:
        what = f"--vpp {fixed.vpp}" if (fixed.vpp or 1) > 1 else f"--schedule {fixed.schedule}"
        raise UserError(f"{what} needs a pipeline (--pp > 1)")


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
    for t in _divisors(gpus) if fixed.tp is None else [fixed.tp]:
        if model.heads % t:
            continue
        for p in _divisors(gpus // t) if fixed.pp is None else [fixed.pp]:
            if p > model.layers or gpus % (t * p):
                continue
            if software.even_stages and model.layers % p:
                continue
            # One stage runs 1f1b (plain accumulation): a fixed pipeline choice needs p > 1.
            if p == 1 and (fixed.schedule not in (None, "1f1b") or (fixed.vpp or 1) > 1):
                continue
            d = gpus // (t * p)
            for b in MICRO_BATCHES if fixed.micro_batch is None else (fixed.micro_batch,):
                if not BatchPlan.divides(global_batch, b, d):
                    continue  # micro-batches of b on d replicas do not make the global batch
                m = BatchPlan.of(global_batch, b, d).accumulation
                sp = fixed.sequence_parallel
                if sp is None:  # it saves memory at no cost in time, where the code has it
                    sp = t > 1 and software.can_sequence_parallel
                recomputes = software.recomputes if fixed.recompute is None else (fixed.recompute,)
                for schedule, v in _schedules(p, m, model.layers, fixed, software):
                    for recompute in recomputes:
                        yield Layout(t, p, d, v, b, schedule, recompute, sp and t > 1)


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
        "bubble": "pipeline bubble",
        "pp": "pipeline transfers",
        "dp": "data-parallel all-reduce",
        "optimizer": "optimizer step",
    }
    excess = {k: loser.time_parts_s[k] - best.time_parts_s.get(k, 0.0) for k in names}
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
            f"{model.heads} heads and {model.layers} layers with the choices given"
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
    p, v = fixed.pp, fixed.vpp
    interleaved = fixed.schedule == "interleaved" or (v or 1) > 1
    if software.even_stages and p and model.layers % p:
        raise UserError(f"--pp {p}: this software needs the {model.layers} layers divisible by p")
    if interleaved and p and p < software.interleave_min_pp:
        raise UserError(
            f"--pp {p}: this software runs the interleaved schedule at p >= "
            f"{software.interleave_min_pp} only"
        )
    if interleaved and software.even_stages and p and v and (model.layers // p) % v:
        raise UserError(
            f"--vpp {v}: this software needs v to divide the {model.layers // p} layers of a stage"
        )


def layout_record(e: Estimate) -> dict[str, Any]:
    """Return one layout as the JSON output holds it."""
    lay = e.layout
    return {
        "tp": lay.tp,
        "pp": lay.pp,
        "dp": lay.dp,
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
        "fits": e.fits,
    }


def to_json(plan: Plan, top: int) -> dict[str, Any]:
    """Return the plan as one JSON-ready object, best layout first."""
    return {
        "model": asdict(plan.model),
        "gpus": plan.gpus,
        "global_batch": plan.global_batch,
        "cluster": plan.cluster.name,
        "gpu": plan.cluster.gpu.name,
        "software": asdict(plan.software),
        "layouts": [layout_record(e) for e in plan.ranked[:top]],
        "others": [{**layout_record(e), "lost_because": why} for e, why in plan.losers[: 4 * top]],
        "considered": len(plan.losers) + 1,
    }


def _family_sizes(model: Model) -> str:
    """Return the sizes beyond GPT-2's a model has: its key/value heads, its MLP width."""
    extra = ""
    if model.kv_heads and model.kv_heads != model.heads:
        extra += f" ({model.kv_heads} key/value)"
    if model.ffn and model.ffn != 4 * model.hidden:
        extra += f", MLP {model.ffn}"
    return extra + ("" if model.tied else ", untied output layer")


def render(plan: Plan, top: int) -> str:
    """Return the ranked table, the memory of the best, and why the next layouts lost."""
    c = plan.cluster
    lines = [
        f"{plan.model.arch}: {plan.model.layers} layers, hidden {plan.model.hidden}, "
        f"{plan.model.heads} heads{_family_sizes(plan.model)}, "
        f"seq {plan.model.seq}, vocab {plan.model.vocab} "
        f"({plan.model.parameters() / 1e9:.2f} B parameters); global batch "
        f"{plan.global_batch} on {plan.gpus} x {c.gpu.name} ({c.gpus_per_node} per node, "
        f"{c.name}); {plan.software.precision}, attention {plan.software.attention}",
        "",
        f"{'#':>2} {'t':>3} {'p':>3} {'d':>5} {'v':>2} {'b':>3} {'schedule':<11} "
        f"{'recompute':<9} {'step s':>9} {'TFLOP/s':>8} {'MFU':>5} {'tokens/s':>10} "
        f"{'mem GB':>7} {'bubble':>6} {'tp s':>7} {'pp s':>7} {'dp s':>7}",
    ]
    if not plan.ranked:
        lines.append("   no layout fits in memory; the closest:")
    shown = plan.ranked[:top] or [e for e, _ in plan.losers[:top]]
    for i, e in enumerate(shown, 1):
        lay, parts = e.layout, e.time_parts_s
        lines.append(
            f"{i:>2} {lay.tp:>3} {lay.pp:>3} {lay.dp:>5} {lay.vpp:>2} {lay.micro_batch:>3} "
            f"{lay.schedule:<11} {lay.recompute:<9} {e.step_time_s:>9.3f} "
            f"{e.tflops_per_gpu:>8.4g} {e.mfu:>5.1%} {e.tokens_per_s:>10.0f} "
            f"{e.memory_gb:>6.3g}{'' if e.fits else '!'} {e.bubble:>6.1%} {parts['tp']:>7.3f} "
            f"{parts['pp']:>7.3f} {parts['dp']:>7.3f}"
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
            f"{hidden:.3f} s hidden behind the backward",
            "TFLOP/s counts the FLOPs done, recomputation included (Narayanan et al.); MFU "
            "counts the model's FLOPs only",
        ]
    if plan.losers:
        lines += ["", f"why the others lost ({len(plan.losers)} layouts; the closest):"]
        for e, why in plan.losers[: max(top, 5)]:
            lay = e.layout
            lines.append(
                f"  t={lay.tp} p={lay.pp} d={lay.dp} v={lay.vpp} b={lay.micro_batch} "
                f"{lay.schedule} {lay.recompute}: {why}"
            )
    return "\n".join(lines)


def write_config(plan: Plan, path: Path, preset: str | None, vocab_size: int | None = None) -> Path:
    """Write a train config for the best layout (runnable by ``hpcllm train``); return it.

    ``preset`` is named only if the planned model is that preset's; ``vocab_size`` is
    written only when given (otherwise the data's tokenizer decides, as in any run).
    """
    from hpcllm.config import PRESETS, Config, config_from_dict

    if not plan.ranked:
        raise UserError("no layout fits in memory: there is no config to write")
    lay = plan.ranked[0].layout
    m = plan.model
    cfg = Config()
    cfg.model.arch = m.arch
    sizes = {"n_layer": m.layers, "n_head": m.heads, "d_model": m.hidden, "seq_len": m.seq}
    named = PRESETS.get(preset or "", {})
    cfg.model.preset = preset if {k: named.get(k) for k in sizes} == sizes else None
    if cfg.model.preset is None:
        for key, value in sizes.items():
            setattr(cfg.model, key, value)
        if m.arch != "gpt2":  # the family's own sizes (a preset would carry them)
            cfg.model.n_kv_heads, cfg.model.ffn_size = m.kv_heads, m.ffn
            cfg.model.tie_embeddings = m.tied
    cfg.model.seq_len = m.seq
    cfg.model.vocab_size = vocab_size
    cfg.model.recompute = lay.recompute
    parallel = cfg.parallel
    parallel.tp, parallel.pp, parallel.dp, parallel.vpp, parallel.schedule = (
        lay.tp,
        lay.pp,
        lay.dp,
        lay.vpp,
        lay.schedule,
    )
    parallel.sequence_parallel = lay.sequence_parallel
    parallel.scatter_gather = lay.scatter_gather
    cfg.train.micro_batch_size = lay.micro_batch
    cfg.train.global_batch_size = plan.global_batch
    cfg.train.precision = plan.software.precision
    config_from_dict(cfg.to_dict())  # what train will read back: checked now, not at launch
    try:
        cfg.dump(Path(path))
    except OSError as err:
        raise UserError(f"cannot write {path}: {err.strerror or err}") from None
    return Path(path)


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
    labels = [
        f"t{e.layout.tp} p{e.layout.pp} d{e.layout.dp} v{e.layout.vpp} b{e.layout.micro_batch} "
        f"{e.layout.schedule} {e.layout.recompute}"
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
