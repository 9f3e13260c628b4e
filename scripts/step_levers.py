"""Levers of hpcllm's GPU step, each measured side by side with the plain model in one process.

``hpcllm bench step`` measures the step as configured; this script measures what a change of
configuration or code would give, so that each lever is kept or dropped by a measurement
(docs/benchmarks.md shows them). Per lever it builds hpcllm's trainer with the lever's
``--set`` keys (levers with the same keys share one trainer, and a lever that is a switch
inside the process runs in it), and times its steps in alternating blocks against the plain
model under ``torch.compile`` built once for the whole run, with the clock and the rules of
``bench step`` (:func:`hpcllm.bench.step._time_blocks`). Every lever's figure is a ratio to
the plain compiled step of its own blocks, so the machine's speed of the moment cancels. A
lever that fails (a compile mode that cannot trace, say) is reported with its error and the
others go on.

    python scripts/step_levers.py --shape gpt2-124m [--model PRESET] [--levers a,b,...]
        [--rounds 3] [--steps 3] [--profile configured,plain_compile] [--out DIR]

``--profile`` also profiles two steps of the named sides with torch.profiler: wall and GPU
busy time per step (the union of kernel intervals), kernel time by kind, the host's self CPU
time by op (where an eager step's launches go), and a Chrome trace
(``DIR/trace-SIDE.json.gz``) to read the gaps from.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from hpcllm import kernels
from hpcllm.bench.runs import synthetic_unless_data
from hpcllm.bench.step import SHAPES, _plain_step, _shape_config, _time_blocks
from hpcllm.flops import model_step_flops
from hpcllm.train.trainer import Trainer


@contextlib.contextmanager
def _bias_outside_gemm() -> Iterator[None]:
    # Before the change: inside compiled blocks the bias went to the (inductor) bias ops.
    kernels.BIAS_OUTSIDE_GEMM_WHEN_COMPILED = True
    try:
        yield
    finally:
        kernels.BIAS_OUTSIDE_GEMM_WHEN_COMPILED = False


# name -> (trainer --set keys, a switch around its steps, what it is)
LEVERS: dict[str, tuple[tuple[str, ...], Callable[[], Any] | None, str]] = {
    "configured": ((), None, "hpcllm as configured (compile: auto, fused_kernels: auto)"),
    "blocks": (("model.compile=blocks",), None, "compile: blocks (each block on its own)"),
    "bias-outside-gemm": (
        ("model.compile=blocks",),
        _bias_outside_gemm,
        "compile: blocks, the matmul biases handed to the bias-GeLU/-add ops (before)",
    ),
    "kernels-off": (
        ("model.compile=blocks",),
        kernels.disabled,
        "compile: blocks, fused_kernels off for its blocks",
    ),
    "full": (("model.compile=full",), None, "compile: full (each chunk's forward whole)"),
    "blocks-cudagraphs": (
        ("model.compile_mode=reduce-overhead",),
        None,
        "compile: blocks, compile_mode: reduce-overhead (CUDA graphs)",
    ),
    "full-cudagraphs": (
        ("model.compile=full", "model.compile_mode=reduce-overhead"),
        None,
        "compile: full, compile_mode: reduce-overhead (CUDA graphs)",
    ),
    "eager": (("model.compile=none",), None, "compile: none (fused_kernels auto, eager)"),
    "eager-kernels-off": (
        ("model.compile=none",),
        kernels.disabled,
        "compile: none, fused_kernels off for its blocks",
    ),
    "eager-kernels-on": (
        ("model.compile=none", "model.fused_kernels=on"),
        None,
        "compile: none, fused_kernels: on",
    ),
}


def _say(line: str) -> None:
    print(f"step levers: {line}", file=sys.stderr, flush=True)


def _kind(name: str) -> str:
    """Return a kernel's kind for the profile's table."""
    low = name.lower()
    for kind, marks in (
        ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")),
        ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
        ("optimizer", ("adam", "multi_tensor", "foreach")),
        ("loss", ("cross_entropy", "log_softmax", "nll")),
        ("triton/inductor", ("triton",)),
    ):
        if any(m in low for m in marks):
            return kind
    return "other"


def profile_side(name: str, step: Callable[[], None], steps: int, out: Path | None) -> dict:
    """Profile ``steps`` steps of a side; return wall, GPU busy and kernel time by kind."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    wait = torch.cuda.synchronize if cuda else (lambda: None)
    wait()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        began = time.perf_counter()
        for _ in range(steps):
            step()
        wait()
        wall = (time.perf_counter() - began) / steps
    spans, by_kind, by_name = [], {}, {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.time_range.elapsed_us() <= 0:
            continue
        spans.append((e.time_range.start, e.time_range.end))
        us = e.time_range.elapsed_us()
        by_kind[_kind(e.name)] = by_kind.get(_kind(e.name), 0.0) + us
        by_name[e.name] = by_name.get(e.name, 0.0) + us
    spans.sort()
    busy, end = 0.0, None
    for s, e in spans:
        if end is None or s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    first, last = (spans[0][0], max(e for _, e in spans)) if spans else (0, 0)
    # The host's side: where the CPU time of the step goes (an eager step's launches).
    host = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:20]
    result = {
        "side": name,
        "host_self_ms": [
            (a.key[:90], a.self_cpu_time_total / 1e3 / steps, a.count / steps) for a in host
        ],
        "wall_ms": wall * 1e3,
        "gpu_busy_ms": busy / 1e3 / steps,
        "gpu_span_ms": (last - first) / 1e3 / steps,
        "kernels_per_step": len(spans) / steps,
        "by_kind_ms": {k: v / 1e3 / steps for k, v in sorted(by_kind.items())},
        "top_kernels_ms": [
            (k[:90], v / 1e3 / steps)
            for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:25]
        ],
    }
    if out is not None:
        raw = out / f"trace-{name}.json"
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="gpt2-124m", choices=sorted(SHAPES))
    parser.add_argument("--model", default=None, help="a preset at the shape's batch")
    parser.add_argument("--levers", default=",".join(LEVERS), help="comma-separated")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed block")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile", default="", help="sides to profile, comma-separated")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    levers = [x for x in args.levers.split(",") if x]
    unknown = [x for x in levers if x not in LEVERS]
    if unknown:
        parser.error(f"unknown levers {unknown}; known: {', '.join(LEVERS)}")
    profiled = {x for x in args.profile.split(",") if x}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    precision = "bf16" if cuda else "fp32"
    # Several trainers and compile modes share Block.forward's cache in one process.
    torch._dynamo.config.cache_size_limit = 64
    groups: dict[tuple[str, ...], list[str]] = {}
    for name in levers:
        groups.setdefault(LEVERS[name][0], []).append(name)
    results: dict[str, Any] = {
        "shape": args.shape,
        "model": args.model,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "rounds": args.rounds,
        "steps": args.steps,
        "levers": {},
        "profiles": [],
    }
    plain: dict[str, Callable[[], None]] = {}
    flops = tokens = None
    for keys, names in groups.items():
        _say(f"trainer with {list(keys) or 'the configured keys'}: {', '.join(names)}")
        began = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory(prefix="hpcllm-levers-") as scratch:
                sets = synthetic_unless_data(None, [*args.overrides, *keys])
                cfg = _shape_config(args.shape, args.model, None, sets, precision, scratch)
                with Trainer(cfg) as trainer:
                    reader = iter(trainer.reader)
                    if not plain:
                        sample = [next(reader) for _ in range(8)]
                        batches = [(b.input_ids.to(device), b.labels.to(device)) for b in sample]
                        eager, compiled = _plain_step(
                            cfg, trainer.padded_vocab, device, batches, cuda
                        )
                        plain["plain_eager"] = eager
                        if compiled is not None:
                            plain["plain_compile"] = compiled
                        flops = model_step_flops(
                            cfg.model, cfg.train.micro_batch_size, trainer.padded_vocab
                        )
                        tokens = trainer.tokens_per_step

                    def side(
                        switch: Callable[[], Any] | None,
                        trainer: Trainer = trainer,
                        reader: Iterator[Any] = reader,
                    ) -> Callable[[], None]:
                        def step() -> None:
                            with switch() if switch else contextlib.nullcontext():
                                trainer.train_step(reader, wait=False)

                        return step

                    sides = {
                        "plain_compile" if cuda else "plain_eager": plain[
                            "plain_compile" if cuda else "plain_eager"
                        ]
                    }
                    if not results["levers"]:
                        sides["plain_eager"] = plain["plain_eager"]
                    for name in names:
                        sides[name] = side(LEVERS[name][1])
                    peak: dict[str, float] = {}
                    wall, cpu = _time_blocks(
                        sides, cfg.model.arch, device, args.steps, args.rounds, args.warmup, peak
                    )
                    base = statistics.median(wall["plain_compile" if cuda else "plain_eager"])
                    for name, blocks in wall.items():
                        ms = statistics.median(blocks)
                        if name in plain and name in results["levers"]:
                            continue  # the first group's plain rows stand for the run
                        results["levers"][name] = {
                            "what": LEVERS[name][2] if name in LEVERS else name,
                            "keys": list(keys) if name in LEVERS else [],
                            "step_ms": ms * 1e3,
                            "blocks_ms": [b * 1e3 for b in blocks],
                            "cpu_ms": statistics.median(cpu[name]) * 1e3,
                            "vs_plain_compile_same_blocks": base / ms,
                            "baseline_ms": base * 1e3,
                            "tflops": flops / ms / 1e12,
                            "tokens_per_s": tokens / ms,
                            "peak_mb": peak.get(name),
                            "setup_s": time.perf_counter() - began,
                        }
                    for name in [s for s in sides if s in profiled]:
                        _say(f"profiling {name}")
                        results["profiles"].append(profile_side(name, sides[name], 2, args.out))
                        profiled.discard(name)
                    reader.close()
        except Exception as err:  # one lever failing must not stop the others
            traceback.print_exc()
            for name in names:
                results["levers"][name] = {
                    "what": LEVERS[name][2],
                    "keys": list(keys),
                    "error": f"{type(err).__name__}: {err}"[:2000],
                }
        if args.out:
            (args.out / "levers.json").write_text(json.dumps(results, indent=2) + "\n")
    print(render(results))
    if args.out:
        (args.out / "levers.md").write_text(render(results) + "\n")
    return 0


def render(results: dict[str, Any]) -> str:
    """Return the levers as a table, and the profiles."""
    lines = [
        f"{results['shape']} {results['model'] or ''}: torch {results['torch']} on "
        f"{results['device']}; medians of {results['rounds']} alternating blocks of "
        f"{results['steps']} steps; x = the plain step's ms in the lever's own blocks over the "
        "lever's (the plain model compiled on a GPU, eager on the CPU)",
        "",
        "| side | ms/step | plain ms, same blocks | x plain | TFLOP/s | peak MiB | what |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in results["levers"].items():
        if "error" in r:
            lines.append(f"| {name} | - | - | - | - | - | failed: {r['error'][:160]} |")
            continue
        peak = "-" if r["peak_mb"] is None else f"{r['peak_mb']:.0f}"
        lines.append(
            f"| {name} | {r['step_ms']:.2f} | {r['baseline_ms']:.2f} "
            f"| {r['vs_plain_compile_same_blocks']:.3f} "
            f"| {r['tflops']:.0f} | {peak} | {r['what']} |"
        )
    for p in results["profiles"]:
        lines += [
            "",
            f"profile {p['side']}: wall {p['wall_ms']:.2f} ms/step, GPU busy "
            f"{p['gpu_busy_ms']:.2f}, first-to-last kernel {p['gpu_span_ms']:.2f}, "
            f"{p['kernels_per_step']:.0f} kernels/step",
            "  by kind (ms/step): " + ", ".join(f"{k} {v:.2f}" for k, v in p["by_kind_ms"].items()),
        ]
        lines += [f"  {ms:7.3f}  {name}" for name, ms in p["top_kernels_ms"]]
        lines.append("  host, self CPU ms/step (calls/step):")
        lines += [f"  {ms:7.3f}  ({n:g})  {name}" for name, ms, n in p.get("host_self_ms", [])]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
