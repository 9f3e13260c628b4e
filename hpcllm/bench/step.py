"""``hpcllm bench step``: hpcllm's training step against the same model in plain PyTorch.

Per shape, one process holds hpcllm's :class:`~hpcllm.train.trainer.Trainer` (the config as
given) and the plain PyTorch model its family registers as its baseline
(:attr:`hpcllm.families.Family.reference`; GPT-2's is nanoGPT's model), trained by nanoGPT's
loop (AdamW fused on CUDA, autocast, clipping, no project code). A family that registers none
is not measured. The shapes are GPT-2 models; ``model`` (``--model PRESET``) puts any family's
preset at a shape's micro-batch and sequence length (with cpu-smoke: its family at the smoke
size, with the family's :attr:`~hpcllm.families.Family.bench_keys`). It times in alternating
blocks of steps, so that a drifting machine hits every side alike:

- plain eager, and plain under ``torch.compile`` (default mode; the same module and weights);
- hpcllm's ``train_step`` as configured, and with fused kernels off (the same trainer, the
  kernels switched off for its blocks: one model in memory, not two);

then runs the real loop (``Trainer.run``: reader, metrics, logging, the stop-signal
all-reduce) for some steps and times it from step to step, leaving out start-up and the end
of the run (final evaluation and checkpoint). Each side's figure is the median over its blocks
of the block's time per step, each block timed by the clock of auto's choices and ``bench
kernels`` (:class:`~hpcllm.kernels.timing.Clock`: CUDA events on a GPU, waiting for the device
once, at the block's end; perf_counter on the CPU), without its L2 flush, which a block of
training steps does not need and whose buffer would count in the sides' peak memory.

Both sides train on the same batches (the plain one reads them from the trainer's reader up
front, so it pays no data loading) and the same padded vocabulary, so they do the same FLOPs
(:func:`hpcllm.flops.step_flops`, the same count for every row). The command trains on
synthetic data (``data.synthetic``) unless ``data.path`` or ``data.blend`` is given. The gpt2
shapes give the model GPT-2's vocabulary (50257, padded to 50304) whatever the data's
tokenizer, whose ids must all be smaller; ``cpu-smoke`` gives it 512, which holds the
built-in corpus's 257.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hpcllm import families, kernels
from hpcllm.config import Config, load_config
from hpcllm.errors import UserError
from hpcllm.files import atomic_write
from hpcllm.flops import model_step_flops
from hpcllm.kernels.timing import Clock
from hpcllm.observe import CaseProgress, peak_tflops
from hpcllm.train.trainer import Trainer

# Config overrides of each shape; the user's --set come after them and win.
SHAPES: dict[str, list[str]] = {
    "gpt2-124m": [
        "model.preset=null",
        "model.n_layer=12",
        "model.n_head=12",
        "model.d_model=768",
        "model.seq_len=1024",
        "model.vocab_size=50257",
        "train.micro_batch_size=16",
    ],
    "gpt2-1.3b": [
        "model.preset=null",
        "model.n_layer=24",
        "model.n_head=16",
        "model.d_model=2048",
        "model.seq_len=2048",
        "model.vocab_size=50257",
        "train.micro_batch_size=4",
    ],
    # About the smallest shape whose ratios are stable on a 2-core CPU (~0.1 s per step); a
    # vocabulary that holds the built-in corpus's byte-level tokenizer (257 ids).
    "cpu-smoke": [
        "model.preset=null",
        "model.vocab_size=512",
        "model.n_layer=4",
        "model.n_head=4",
        "model.d_model=256",
        "model.seq_len=128",
        "train.micro_batch_size=4",
    ],
}

# What a shape sets when --model picks the model: the micro-batch and sequence length.
BATCH_KEYS = ("model.seq_len=", "train.micro_batch_size=")


def shape_overrides(shape: str, model: str | None) -> list[str]:
    """Return the config overrides of ``shape``; with ``model`` (any family's preset) the
    preset's model at the shape's micro-batch and sequence length, or, for cpu-smoke, the
    preset's family at the smoke size (with the keys the family adds to it)."""
    if model is None:
        return list(SHAPES[shape])
    family = families.preset_family(model)
    if family is None:
        raise UserError(f"--model {model} is no family's preset ({', '.join(families.presets())})")
    if shape == "cpu-smoke":
        return [f"model.arch={family}", *SHAPES[shape], *families.get(family).bench_keys]
    batch = [item for item in SHAPES[shape] if item.startswith(BATCH_KEYS)]
    vocab = (
        [] if families.get(family).presets[model].get("vocab_size") else ["model.vocab_size=50257"]
    )
    return [f"model.arch={family}", f"model.preset={model}", *vocab, *batch]


# Each side's key and the name of its row ({family}: the family whose plain model it is).
ROWS = {
    "plain_eager": "plain {family} eager",
    "plain_compile": "plain {family} + torch.compile",
    "hpcllm": "hpcllm step (as configured)",
    "hpcllm_kernels_off": "hpcllm step, kernels off",
    "hpcllm_loop": "hpcllm trainer loop",
}


def _side(key: str, family: str) -> str:
    """Return the name of side ``key``'s row when the model is of ``family``."""
    return ROWS[key].format(family=family) if key in ROWS else key


def _say(message: str) -> None:
    from tqdm import tqdm

    # Through tqdm, which lifts the progress bar (on a terminal) out of the line's way.
    tqdm.write(f"bench step: {message}", file=sys.stderr)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _triton_ops() -> list[str]:
    """Return the ops that ran a Triton kernel since the last reset."""
    return sorted(op for op, impl in kernels.implementations_used().items() if impl == "triton")


def plain_model(cfg: Config, vocab: int) -> torch.nn.Module:
    """Return the plain PyTorch model of ``cfg``'s family and sizes (the vocabulary padded);
    a UserError where the family registers none."""
    return families.reference_class(cfg.model.arch)(cfg.model, vocab, seed=cfg.train.seed)


def plain_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """Return nanoGPT's AdamW: decay on matrices only, fused on CUDA, foreach elsewhere."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    cuda = next(model.parameters()).is_cuda
    return torch.optim.AdamW(
        groups, lr=lr, betas=(0.9, 0.95), fused=cuda or None, foreach=None if cuda else True
    )


def _plain_step(
    cfg: Config, vocab: int, device: torch.device, batches: list[tuple[Any, Any]], compile: bool
) -> tuple[Callable[[], None], Callable[[], None] | None]:
    """Return one step of nanoGPT's training loop, eager and (if asked) compiled.

    Both run the same module and optimizer, so the weights keep training whichever runs.
    """
    train = cfg.train
    model = plain_model(cfg, vocab).to(device).train()
    optimizer = plain_optimizer(model, train.lr, train.weight_decay)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[train.precision]
    scaler = torch.amp.GradScaler(device.type, enabled=train.precision == "fp16")
    position = [0]

    def step(run: torch.nn.Module) -> None:
        ids, labels = batches[position[0] % len(batches)]
        position[0] += 1
        with torch.autocast(device.type, dtype=dtype, enabled=train.precision != "fp32"):
            loss = run(ids, labels)
        scaler.scale(loss).backward()
        if train.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    compiled = torch.compile(model) if compile else None
    return (
        lambda: step(model),
        None if compiled is None else (lambda: step(compiled)),
    )


def _time_blocks(
    sides: dict[str, Callable[[], None]],
    family: str,
    device: torch.device,
    steps: int,
    rounds: int,
    warmup: int,
    peak_mb: dict[str, float],
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Return each side's wall and process CPU seconds per step of every block, alternating;
    on a GPU, put each side's peak of allocated memory during its blocks (MiB) in ``peak_mb``.
    ``family``: the model's, which the progress lines name the plain sides by.

    Every other round runs the sides in reverse order, so none always follows the same one.
    CPU time (all of the process's threads) is what other work on a shared node disturbs
    least; on a GPU it is the host's share of the step. The memory held outside the step
    (both models, their optimizers) counts for every side alike.
    """
    for name, fn in sides.items():
        _say(f"  warming up {_side(name, family)} ({warmup} steps)")
        for _ in range(warmup):
            fn()
    _synchronize(device)
    clock = Clock(flush_l2=False)
    wall: dict[str, list[float]] = {name: [] for name in sides}
    cpu: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(rounds):
        _say(f"  round {r + 1}/{rounds}")
        for name in names if r % 2 == 0 else names[::-1]:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)

            def block(side: Callable[[], None] = sides[name]) -> None:
                for _ in range(steps):
                    side()

            cpu_started = time.process_time()
            (block_ms,) = clock.runs_ms(block, device, 1)
            wall[name].append(block_ms / 1e3 / steps)
            cpu[name].append((time.process_time() - cpu_started) / steps)
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device) / 2**20
                peak_mb[name] = max(peak_mb.get(name, 0.0), peak)
    return wall, cpu


def _time_loop(trainer: Trainer, steps: int) -> dict[str, Any]:
    """Return the trainer loop's seconds per step over ``steps`` steps, and what it reported.

    A gradient hook stamps the time at the same point of every step, so the interval from the
    second stamp to the last covers whole iterations of the loop (step, stop-signal all-reduce,
    metrics, logging) and leaves out start-up, the first iteration (the reader's prefetch
    starting) and the run's end.
    """
    stamps: list[tuple[float, float]] = []
    trainer.grad_hooks.append(
        lambda _step, _model, _optimizer: stamps.append((time.perf_counter(), time.process_time()))
    )
    trainer.cfg.train.steps = trainer.step + steps
    # The run's final checkpoint falls after the last stamp; saving it would only cost time
    # and disk (gigabytes for gpt2-1.3b).
    trainer.checkpointer.enabled = False
    # So would validation (the final one, and any the interval puts inside the loop), which
    # under compile: full first compiles the model's eval-mode graph (on an H100, llama3.2-1b's
    # bench step was cut off by its time limit at the end of its loop, likely there).
    validation, trainer.validator.readers = trainer.validator.readers, {}
    cuda = trainer.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(trainer.device)
    try:
        summary = trainer.run(progress=False)
    finally:
        trainer.validator.readers = validation
    trainer.grad_hooks.pop()
    wall, cpu = zip(*stamps[1:], strict=True)
    return {
        "step_s": (wall[-1] - wall[0]) / (len(wall) - 1),
        "cpu_s": (cpu[-1] - cpu[0]) / (len(cpu) - 1),
        "interval_ms": [(b - a) * 1e3 for a, b in zip(wall, wall[1:], strict=False)],
        "metrics_tokens_per_s": summary.get("tokens_per_s"),
        "peak_mb": torch.cuda.max_memory_allocated(trainer.device) / 2**20 if cuda else None,
    }


def _row(
    key: str,
    family: str,
    blocks: list[float],
    cpu_blocks: list[float],
    tokens: int,
    flops: float,
    peak: float | None,
    triton: list[str] | None,
) -> dict[str, Any]:
    step_s = statistics.median(blocks)
    tflops = flops / step_s / 1e12
    return {
        "key": key,
        "name": _side(key, family),
        "step_ms": step_s * 1e3,
        "block_ms": [b * 1e3 for b in blocks],
        "cpu_ms": statistics.median(cpu_blocks) * 1e3,
        "tokens_per_s": tokens / step_s,
        "tflops": tflops,
        "mfu": None if peak is None else tflops / peak,
        "triton_ops": triton,
    }


def _model_flops(cfg: Config, padded_vocab: int) -> float:
    """Return the FLOPs of one step of one micro-batch of ``cfg``'s model (both sides')."""
    return model_step_flops(cfg.model, cfg.train.micro_batch_size, padded_vocab)


def _shape_config(
    name: str,
    model: str | None,
    config: Path | None,
    overrides: list[str],
    precision: str,
    scratch: str,
) -> Config:
    """Return the trainer's config for one shape (and model), in ``scratch``."""
    return load_config(
        config,
        [
            *shape_overrides(name, model),
            *overrides,
            f"train.precision={precision}",
            "train.global_batch_size=null",  # one micro-batch per step, as the plain loop
            "train.eval_interval=0",
            "train.eval_iters=1",
            f"run.dir={scratch}",
            "run.resume=none",
            "run.tensorboard=false",
        ],
    )


def bench_shape(
    name: str,
    model: str | None,
    config: Path | None,
    overrides: list[str],
    precision: str,
    compile: bool,
    steps: int,
    rounds: int,
    warmup: int,
    loop_steps: int,
) -> dict[str, Any]:
    """Return one shape's rows (see the module docstring) and what they were measured on."""
    with tempfile.TemporaryDirectory(prefix="hpcllm-bench-step-") as scratch:
        cfg = _shape_config(name, model, config, overrides, precision, scratch)
        m = cfg.model
        # Before the trainer's start-up: a family with no plain model is told so at once.
        families.reference_class(m.arch)
        _say(f"{name}: building hpcllm's trainer")
        with Trainer(cfg) as trainer:
            if trainer.grid.world_size != 1:
                raise ValueError("bench step runs as one process")
            device, fused = trainer.device, kernels.enabled()
            threads = torch.get_num_threads()  # as the trainer set them, for both sides
            reader = iter(trainer.reader)
            # The plain loop's batches: the trainer's data, read up front.
            sample = [next(reader) for _ in range(8)]
            batches = [(b.input_ids.to(device), b.labels.to(device)) for b in sample]
            _say(f"{name}: building the plain model")
            plain_eager, plain_compiled = _plain_step(
                cfg, trainer.padded_vocab, device, batches, compile
            )

            def hpcllm_step(flag: bool) -> Callable[[], None]:
                def step() -> None:
                    # Off for its blocks without forgetting what auto chose for the others.
                    with contextlib.nullcontext() if flag else kernels.disabled():
                        trainer.train_step(reader, wait=False)

                return step

            sides: dict[str, Callable[[], None]] = {"plain_eager": plain_eager}
            if plain_compiled is not None:
                sides["plain_compile"] = plain_compiled
            sides["hpcllm"] = hpcllm_step(fused)
            if fused:
                sides["hpcllm_kernels_off"] = hpcllm_step(False)
            _say(f"{name}: timing {', '.join(_side(s, m.arch) for s in sides)}")
            kernels.reset_implementations_used()
            sides["hpcllm"]()
            triton = {"hpcllm": _triton_ops(), "hpcllm_kernels_off": []}
            auto = [
                {"op": key[0], "triton_ms": t, "torch_ms": c}
                for key, (t, c) in kernels.choice_timings().items()
            ]
            peak_mb: dict[str, float] = {}
            times, cpu_times = _time_blocks(sides, m.arch, device, steps, rounds, warmup, peak_mb)
            reader.close()
            _say(f"{name}: the trainer loop, {loop_steps} steps")
            kernels.reset_implementations_used()
            loop = _time_loop(trainer, loop_steps)
            triton["hpcllm_loop"] = _triton_ops()
            tokens = trainer.tokens_per_step
            vocab = {
                "model": trainer.vocab_size,
                "padded": trainer.padded_vocab,
                "data": trainer.manifest.vocab_size,
                "synthetic": trainer.manifest.synthetic,
            }
        flops = _model_flops(cfg, vocab["padded"])
        peak = peak_tflops(device, precision, cfg.train.peak_tflops)
        times["hpcllm_loop"], cpu_times["hpcllm_loop"] = [loop["step_s"]], [loop["cpu_s"]]
        if loop["peak_mb"] is not None:
            peak_mb["hpcllm_loop"] = loop["peak_mb"]
        if not fused:  # the configured step already ran with kernels off
            times["hpcllm_kernels_off"] = times["hpcllm"]
            cpu_times["hpcllm_kernels_off"] = cpu_times["hpcllm"]
        rows = [
            _row(key, m.arch, times[key], cpu_times[key], tokens, flops, peak, triton.get(key))
            for key in ROWS
            if key in times
        ]
        ms = {row["key"]: row["step_ms"] for row in rows}
        for row in rows:
            row["peak_mem_mb"] = peak_mb.get(row["key"])
        for row in rows:  # ratios of throughput: > 1 is faster than the plain model
            for base in ("plain_eager", "plain_compile"):
                row[f"vs_{base}"] = ms[base] / row["step_ms"] if base in ms else None
            row["vs_plain_eager_cpu_time"] = rows[0]["cpu_ms"] / row["cpu_ms"]
    return {
        "shape": name,
        "model": model,
        "arch": m.arch,
        "baseline": families.get(m.arch).reference,
        "n_layer": m.n_layer,
        "n_head": m.n_head,
        "d_model": m.d_model,
        "seq_len": m.seq_len,
        "micro_batch_size": cfg.train.micro_batch_size,
        "tokens_per_step": tokens,
        "torch_threads": threads,
        "vocab": vocab,
        "flops_per_step": flops,
        "peak_tflops": peak,
        "fused_kernels": fused,
        "kernels_off_same_as_configured": not fused,
        "auto_timings": auto,
        "loop_steps": loop_steps,
        "loop_interval_ms": loop["interval_ms"],
        "loop_metrics_tokens_per_s": loop["metrics_tokens_per_s"],
        "rows": rows,
    }


def run(
    shapes: list[str],
    config: Path | None = None,
    overrides: list[str] | None = None,
    precision: str | None = None,
    compile: bool | None = None,
    steps: int = 3,
    rounds: int = 6,
    warmup: int = 2,
    loop_steps: int = 20,
    model: str | None = None,
) -> dict[str, Any]:
    """Return the benchmark's results for each shape (see the module docstring); ``model``
    (any family's preset) picks the model the shapes then size by micro-batch and sequence
    length."""
    cuda = torch.cuda.is_available()
    precision = precision or ("bf16" if cuda else "fp32")
    compile = cuda if compile is None else compile
    result: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        # Other work on the node makes CPU figures noisy; this says how much there was.
        "load_average": os.getloadavg()[0],
        "cpu_cores": len(os.sched_getaffinity(0)),
        "precision": precision,
        "compile": compile,
        "steps_per_block": steps,
        "rounds": rounds,
        "warmup": warmup,
        "overrides": list(overrides or []),
        "model": model,
        "shapes": [],
    }
    with CaseProgress(len(shapes), "hpcllm bench step") as progress:
        for name in shapes:
            progress.start(name)
            shape = bench_shape(
                name,
                model,
                config,
                list(overrides or []),
                precision,
                compile,
                steps,
                rounds,
                warmup,
                loop_steps,
            )
            result["shapes"].append(shape)
            gc.collect()  # the shape's models, before the next one's are built
            if cuda:
                torch.cuda.empty_cache()
            ours = next(row for row in shape["rows"] if row["key"] == "hpcllm")
            progress.done(f"hpcllm step {ours['vs_plain_eager']:.2f}x plain eager")
    return result


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def render(result: dict[str, Any]) -> str:
    """Return the results as one table per shape."""
    lines = [
        f"torch {result['torch']} on {result['device']}, {result['precision']}; medians of "
        f"{result['rounds']} alternating blocks of {result['steps_per_block']} steps per side; "
        f"{result['cpu_cores']} cores, load average {result['load_average']:.1f} at the start"
    ]
    for s in result["shapes"]:
        v = s["vocab"]
        lines += [
            "",
            f"{s['shape']}{' (' + s['model'] + ')' if s.get('model') else ''}: "
            f"{s['arch']}, {s['n_layer']} layers, d {s['d_model']}, "
            f"{s['n_head']} heads, "
            f"seq {s['seq_len']} x mb {s['micro_batch_size']} = {s['tokens_per_step']} tokens "
            f"per step, {s['flops_per_step'] / 1e12:.3g} TFLOP per step (both sides), "
            f"{s['torch_threads']} torch threads",
            f"vocabulary: both models {v['model']} padded to {v['padded']}; token ids "
            + (
                f"synthetic (random over {v['data']})"
                if v.get("synthetic")
                else f"from the prepared data's tokenizer ({v['data']})"
            )
            + ", the same batches on both sides",
            f"baseline: the {s['arch']} family's plain PyTorch model, {s['baseline']}",
            "",
            "| side | ms/step | CPU ms/step | tokens/s | TFLOP/s | MFU | x plain eager "
            "| x plain compiled | peak MiB | Triton ops |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in s["rows"]:
            name = r["name"]
            if r["key"] == "hpcllm_loop":
                name += f" ({s['loop_steps']} steps)"
            if r["key"] == "hpcllm_kernels_off" and s["kernels_off_same_as_configured"]:
                name += " (= as configured)"
            ops = "-" if r["triton_ops"] is None else ", ".join(r["triton_ops"]) or "none"
            mfu = None if r["mfu"] is None else 100 * r["mfu"]
            lines.append(
                f"| {name} | {r['step_ms']:.1f} | {r['cpu_ms']:.1f} | {r['tokens_per_s']:.0f} "
                f"| {_fmt(r['tflops'], '.3g')} | {_fmt(mfu, '.1f')}{'%' if mfu else ''} "
                f"| {_fmt(r['vs_plain_eager'], '.3f')} | {_fmt(r['vs_plain_compile'], '.3f')} "
                f"| {_fmt(r.get('peak_mem_mb'), '.0f')} | {ops} |"
            )
        for a in s.get("auto_timings", []):
            pick = "Triton" if a["triton_ms"] <= a["torch_ms"] else "eager torch"
            lines.append(
                f"auto timed {a['op']} (forward + backward, outside compiled graphs): Triton "
                f"{a['triton_ms']:.3g} ms, eager torch {a['torch_ms']:.3g} ms: {pick}"
            )
        off = next(r for r in s["rows"] if r["key"] == "hpcllm_kernels_off")
        intervals = s["loop_interval_ms"]
        lines.append(
            f"trainer loop: the mean of {len(intervals)} steps (the row), median step "
            f"{statistics.median(intervals):.1f} ms, slowest {max(intervals):.1f} ms"
        )
        lines.append(
            f"hpcllm kernels off against plain {s['arch']} eager: {off['vs_plain_eager']:.3f} "
            f"by wall time, {off['vs_plain_eager_cpu_time']:.3f} by process CPU time "
            "(> 1: hpcllm faster)"
        )
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: Path) -> None:
    """Write the results to ``path`` as JSON, whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(result, indent=2) + "\n")
