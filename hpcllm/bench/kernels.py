"""``hpcllm bench kernels``: each fused Triton op against eager torch and torch.compile.

Per op, at the training shapes of two presets, each sized as its family gives it
(:func:`hpcllm.families.shape`: hidden size, heads, MLP width): gpt2-124m (micro-batch 16,
sequence 1024: 16384 tokens, h = 768, MLP 3072, 12 heads, vocabulary 50304) and gpt2-1.3b
(micro-batch 4, sequence 2048: 8192 tokens, h = 2048, MLP 8192, 16 heads), it times forward
and forward + backward (median of CUDA-event timings) of the eager reference, the reference
under torch.compile and the Triton op (the ``hpcllm`` custom op the dispatch calls), gives the
Triton op's speed-up over torch.compile, turns the bytes the op has to move into GB/s and
compares that with the device's measured copy bandwidth. Then it times whole training steps of
the first preset's model (bf16 autocast, fused AdamW) with the
kernels off, on, auto (each op the faster of Triton and compiled torch, timed on first use),
and the model under torch.compile without and with the kernels: tokens/s, TFLOP/s, MFU, and
which ops ran a Triton kernel (:func:`hpcllm.kernels.implementations_used`).

The dtypes are those of a bf16-autocast step: matmul outputs bf16, the residual stream,
parameters and LayerNorm fp32. Dropout is timed at p = 0.1 and checked at p = 0 (its masks
come from different generators, so only the deterministic op can be compared element-wise).

``--cpu-smoke`` runs all of it at tiny sizes on the CPU under Triton's interpreter (and
torch.compile with its ``eager`` backend), to show that the script works; its times mean
nothing. The script imports neither MPI nor Horovod.

Run: ``python -m hpcllm.bench.kernels [--json PATH]``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hpcllm import families, kernels
from hpcllm.config import Config, load_config, padded_vocab
from hpcllm.errors import UserError
from hpcllm.kernels import reference
from hpcllm.kernels.choice import DIFFERENTIABLE, Timer, wall_clock_ms
from hpcllm.observe import CaseProgress


@dataclass(frozen=True)
class Sizes:
    """The shapes one benchmark run uses: a model's, as its family gives them, at a
    micro-batch of ``batch`` sequences."""

    name: str
    batch: int
    vocab: int  # the tokenizer's; the logits are padded to a multiple of 128
    model: dict[str, Any]  # model.* keys: the end-to-end model, whose shape the ops run at

    def config(self) -> Config:
        """Return the config of a bf16 run of the model at this micro-batch."""
        overrides = [f"model.{k}={'null' if v is None else v}" for k, v in self.model.items()]
        return load_config(
            None, [*overrides, "train.precision=bf16", f"train.micro_batch_size={self.batch}"]
        )

    def shape(self) -> families.Shape:
        """Return the model's sizes (the MLP's width, heads, ...) as its family gives them."""
        return families.shape(self.config().model, self.vocab)


# Op shapes; the training steps run at the first.
GPU_SIZES = [
    Sizes("gpt2-124m", batch=16, vocab=50257, model={"preset": "gpt2-124m"}),
    Sizes("gpt2-1.3b", batch=4, vocab=50257, model={"preset": "gpt2-1.3b"}),
]
SMOKE_SIZES = Sizes(
    "tiny",
    batch=2,
    vocab=300,
    model={"preset": None, "n_layer": 2, "n_head": 4, "d_model": 32, "seq_len": 16},
)


@dataclass
class OpCase:
    """One op: how to call an implementation on its inputs, and the bytes it must move."""

    name: str
    call: Callable[[Callable[..., torch.Tensor], bool], torch.Tensor]  # (fn, checking)
    grad_inputs: list[torch.Tensor]
    fwd_bytes: int
    bwd_bytes: int


# The ops _op_cases returns, in its order; known before their inputs are made, to count cases.
# Every differentiable op the dispatch has.
OPS = DIFFERENTIABLE


def _op_cases(sizes: Sizes, device: torch.device) -> list[OpCase]:
    """Return the ops of OPS with inputs in the dtypes a bf16-autocast step gives them, at
    the shape of ``sizes``' model: the residual stream and norms at its hidden size, both
    MLP activations (GeLU's, SwiGLU's) at its MLP width, the rotation at its heads."""
    gen = torch.Generator(device=device).manual_seed(0)
    shape = sizes.shape()
    rows, h, heads = sizes.batch * shape.seq, shape.hidden, shape.heads
    ffn, v = shape.ffn or 4 * h, padded_vocab(sizes.vocab, 1)

    def rand(*dims: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(dims, generator=gen, device=device, dtype=torch.float32) * scale
        return t.to(dtype).requires_grad_()

    act, bias_h = rand(rows, h, dtype=torch.bfloat16), rand(h, scale=0.1)
    residual = rand(rows, h)
    fc, bias_ffn = rand(rows, ffn, dtype=torch.bfloat16), rand(ffn, scale=0.1)
    ln_w, ln_b = rand(h), rand(h)
    logits = rand(rows, v, dtype=torch.bfloat16, scale=2.0)
    labels = torch.randint(0, sizes.vocab, (rows,), generator=gen, device=device)
    gate, up = rand(rows, ffn, dtype=torch.bfloat16), rand(rows, ffn, dtype=torch.bfloat16)
    q = rand(sizes.batch, shape.seq, heads, h // heads, dtype=torch.bfloat16)
    # The op rotates by position × inv_freq whatever the frequencies are: drawn, like the
    # other inputs, in [0, 1), the range of a model's.
    inv_freq = torch.rand(h // heads // 2, generator=gen, device=device)
    return [
        OpCase(
            "bias_gelu",
            lambda fn, _: fn(fc, bias_ffn),
            [fc, bias_ffn],
            fwd_bytes=2 * 2 * rows * ffn,
            bwd_bytes=3 * 2 * rows * ffn,
        ),
        OpCase(
            "bias_dropout_add",
            lambda fn, checking: fn(act, bias_h, residual, 0.0 if checking else 0.1, True),
            [act, bias_h, residual],
            # x bf16 and residual fp32 in, fp32 out; backward reads dy (fp32), writes dx.
            fwd_bytes=(2 + 4 + 4) * rows * h,
            bwd_bytes=(4 + 2) * rows * h,
        ),
        OpCase(
            "layer_norm",
            lambda fn, _: fn(residual, ln_w, ln_b, 1e-5),
            [residual, ln_w, ln_b],
            fwd_bytes=2 * 4 * rows * h,
            bwd_bytes=3 * 4 * rows * h,
        ),
        OpCase(
            "cross_entropy",
            lambda fn, _: fn(logits, labels, sizes.vocab),
            [logits],
            fwd_bytes=2 * rows * v,
            bwd_bytes=2 * 2 * rows * v,
        ),
        OpCase(
            "rms_norm",
            lambda fn, _: fn(residual, ln_w, 1e-5),
            [residual, ln_w],
            fwd_bytes=2 * 4 * rows * h,
            bwd_bytes=3 * 4 * rows * h,
        ),
        OpCase(
            "swiglu",
            lambda fn, _: fn(gate, up),
            [gate, up],
            fwd_bytes=3 * 2 * rows * ffn,  # read gate and up, write y
            bwd_bytes=5 * 2 * rows * ffn,  # read dy, gate, up; write dgate, dup
        ),
        OpCase(
            "rotary",
            lambda fn, _: fn(q, inv_freq, 0),
            [q],
            fwd_bytes=2 * 2 * rows * h,
            bwd_bytes=2 * 2 * rows * h,
        ),
    ]


class Clock:
    """Median wall time of a callable: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device, warmup: int, iters: int) -> None:
        self.device, self.warmup, self.iters = device, warmup, iters

    def median_ms(self, fn: Callable[[], Any]) -> float:
        """Return the median milliseconds of ``fn`` over ``iters`` runs after ``warmup``."""
        for _ in range(self.warmup):
            fn()
        times = []
        if self.device.type == "cuda":
            # Each run starts with a cold L2 (50 MB on an H100): overwrite a larger buffer
            # between runs, outside the timed interval. No sync inside the loop, so the
            # intervals are GPU time unless the host falls behind.
            flush = torch.empty(256 << 20, dtype=torch.uint8, device=self.device)
            events = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(self.iters)
            ]
            for start, end in events:
                flush.zero_()
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize(self.device)
            times = [start.elapsed_time(end) for start, end in events]
        else:
            for _ in range(self.iters):
                began = time.perf_counter()
                fn()
                times.append((time.perf_counter() - began) * 1e3)
        return statistics.median(times)


def copy_bandwidth_gbps(device: torch.device, clock: Clock, nbytes: int) -> float:
    """Return the device's measured copy bandwidth: bytes read + written per second, in GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = clock.median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def _max_error(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0
    return (a.float() - b.float()).abs().max().item()


def bench_op(
    case: OpCase,
    impls: dict[str, Callable[..., torch.Tensor]],
    clock: Clock,
    copy_gbps: float,
    size: str,
) -> list[dict[str, Any]]:
    """Return a forward row and a forward + backward row of timings for one op."""

    def fwd(fn: Callable[..., torch.Tensor]) -> Callable[[], Any]:
        return lambda: case.call(fn, False)

    def fwd_bwd(fn: Callable[..., torch.Tensor]) -> Callable[[], Any]:
        def run() -> Any:
            out = case.call(fn, False)
            return torch.autograd.grad(out, case.grad_inputs, torch.ones_like(out))

        return run

    ref_out = case.call(impls["eager"], True)
    fused_out = case.call(impls["triton"], True)
    ref_grads = torch.autograd.grad(ref_out, case.grad_inputs, torch.ones_like(ref_out))
    fused_grads = torch.autograd.grad(fused_out, case.grad_inputs, torch.ones_like(fused_out))
    errors = {
        "fwd": _max_error(fused_out, ref_out),
        "fwd+bwd": max(_max_error(a, b) for a, b in zip(fused_grads, ref_grads, strict=True)),
    }
    rows = []
    for label, make, nbytes in (
        ("fwd", fwd, case.fwd_bytes),
        ("fwd+bwd", fwd_bwd, case.fwd_bytes + case.bwd_bytes),
    ):
        ms = {name: clock.median_ms(make(fn)) for name, fn in impls.items()}
        gbps = nbytes / ms["triton"] / 1e6
        rows.append(
            {
                "size": size,
                "op": case.name,
                "pass": label,
                "mbytes": nbytes / 1e6,
                "eager_ms": ms["eager"],
                "compile_ms": ms["compile"],
                "triton_ms": ms["triton"],
                "triton_gbps": gbps,
                "pct_copy_bw": 100 * gbps / copy_gbps,
                "x_vs_eager": ms["eager"] / ms["triton"],
                "x_vs_compile": ms["compile"] / ms["triton"],
                "max_error": errors[label],
            }
        )
    return rows


def bench_ops(
    all_sizes: list[Sizes],
    device: torch.device,
    clock: Clock,
    copy_gbps: float,
    compile_backend: str,
    progress: CaseProgress,
) -> list[dict[str, Any]]:
    """Return the rows of :func:`bench_op` for every op of OPS at each of ``all_sizes``.

    ``progress`` reports each op at each size as a case.
    """
    was = kernels.enabled(), kernels.choosing(), kernels.compiled_reference()
    kernels.set_enabled(True)  # the dispatch's fused path: the hpcllm custom ops
    ops = []
    try:
        for sizes in all_sizes:
            for case in _op_cases(sizes, device):
                progress.start(f"{sizes.name} {case.name}")
                eager = getattr(reference, case.name)
                impls = {
                    "eager": eager,
                    "compile": torch.compile(eager, backend=compile_backend),
                    "triton": getattr(kernels, case.name),
                }
                ops += bench_op(case, impls, clock, copy_gbps, sizes.name)
                del case, impls
                progress.done(f"Triton {ops[-1]['x_vs_compile']:.2f}x torch.compile")
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        kernels.set_enabled(was[0], choose=was[1], compiled_reference=was[2])
    return ops


# (name, model.fused_kernels, whether the model runs under torch.compile); under compile, auto
# leaves the traced ops to inductor and times only those outside the graph (none here)
TRAINING_VARIANTS = [
    ("kernels off", "off", False),
    ("kernels on", "on", False),
    ("kernels auto", "auto", False),
    ("torch.compile", "off", True),
    ("torch.compile + kernels", "on", True),
    ("torch.compile + auto", "auto", True),
]


def bench_training(
    sizes: Sizes,
    device: torch.device,
    clock: Clock,
    compile_backend: str,
    timer: Timer,
    progress: CaseProgress,
) -> list[dict[str, Any]]:
    """Return tokens/s, TFLOP/s, MFU and the ops that ran Triton, per training-step variant.

    ``progress`` reports each variant as a case.
    """
    from hpcllm.flops import model_step_flops
    from hpcllm.model import build
    from hpcllm.observe import peak_tflops
    from hpcllm.train.optim import autocast, build_optimizer

    cfg = sizes.config()
    seq = cfg.model.seq_len
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, sizes.vocab, (sizes.batch, seq), generator=gen).to(device)
    labels = torch.randint(0, sizes.vocab, (sizes.batch, seq), generator=gen)
    labels = labels.to(device)
    peak = peak_tflops(device, "bf16", None)
    was = kernels.enabled(), kernels.choosing(), kernels.compiled_reference()
    results = []
    for variant, setting, compiled in TRAINING_VARIANTS:
        progress.start(f"{sizes.name} training step, {variant}")
        kernels.set_enabled(
            setting != "off",
            choose=setting == "auto",
            timer=timer,
            compiled_reference=setting == "auto",
        )
        kernels.reset_implementations_used()
        model = build(cfg.model, sizes.vocab, seed=0).to(device).train()
        optimizer = build_optimizer(model, cfg.train, device)
        run = torch.compile(model, backend=compile_backend) if compiled else model
        losses: list[torch.Tensor] = []

        def step(model: Any = run, optimizer: Any = optimizer, losses: list = losses) -> None:
            with autocast("bf16", device):
                loss = model(ids, labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())

        ms = clock.median_ms(step)
        flops = model_step_flops(cfg.model, sizes.batch, model.padded_vocab)
        tflops = flops / ms / 1e9
        results.append(
            {
                "variant": variant,
                "step_ms": ms,
                "tokens_per_s": sizes.batch * seq / ms * 1e3,
                "tflops": tflops,
                "mfu": None if peak is None else tflops / peak,
                "first_loss": losses[0].item(),
                "triton_ops": sorted(
                    op for op, impl in kernels.implementations_used().items() if impl == "triton"
                ),
            }
        )
        del model, optimizer, run, step, losses
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        progress.done(f"{ms:.4g} ms/step")
    kernels.set_enabled(was[0], choose=was[1], compiled_reference=was[2])
    return results


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def render(result: dict[str, Any]) -> str:
    """Return the results as markdown tables."""
    lines = [
        f"Device: {result['device']}; torch {result['torch']}, Triton "
        f"{result['triton']}; copy bandwidth {result['copy_gbps']:.0f} GB/s.",
        "",
        "| shapes | op | pass | MB moved | eager ms | compile ms | Triton ms | Triton GB/s "
        "| % of copy BW | x vs eager | x vs compile | max error |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["ops"]:
        lines.append(
            f"| {r['size']} | {r['op']} | {r['pass']} | {r['mbytes']:.1f} | {_fmt(r['eager_ms'])} "
            f"| {_fmt(r['compile_ms'])} | {_fmt(r['triton_ms'])} "
            f"| {r['triton_gbps']:.0f} | {r['pct_copy_bw']:.0f} "
            f"| {r['x_vs_eager']:.2f} | {r['x_vs_compile']:.2f} "
            f"| {r['max_error']:.2g} |"
        )
    if result["training"]:
        lines += [
            "",
            "| training step | ms | tokens/s | TFLOP/s | MFU | first loss | ops on Triton |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        for r in result["training"]:
            mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
            lines.append(
                f"| {r['variant']} | {_fmt(r['step_ms'], 4)} "
                f"| {r['tokens_per_s']:.0f} | {_fmt(r['tflops'])} | {mfu} "
                f"| {r['first_loss']:.4f} | {', '.join(r['triton_ops']) or 'none'} |"
            )
    return "\n".join(lines)


def run(smoke: bool, iters: int, steps: int, training: bool = True) -> dict[str, Any]:
    """Return the benchmark's results (see the module docstring)."""
    if smoke and not kernels.interpreting():
        # Must precede the first import of the kernels, which fixes how they run.
        os.environ["TRITON_INTERPRET"] = "1"
    if not smoke and not torch.cuda.is_available():
        raise UserError("bench kernels needs a CUDA GPU (--cpu-smoke checks the script on the CPU)")
    if not kernels.triton_available():
        raise UserError("bench kernels needs Triton (pip install triton)")
    import triton

    device = torch.device("cpu") if smoke else torch.device("cuda")
    all_sizes = [SMOKE_SIZES] if smoke else GPU_SIZES
    backend = "eager" if smoke else "inductor"
    clock = Clock(device, warmup=1 if smoke else 10, iters=iters)
    copy_gbps = copy_bandwidth_gbps(device, clock, (1 << 26) if smoke else (1 << 30))
    sizes = all_sizes[0]
    step_clock = Clock(device, warmup=1 if smoke else 5, iters=steps)
    # auto's timing of each op on first use; once each in smoke mode, where times mean nothing
    choice_timer = functools.partial(wall_clock_ms, warmup=0, iters=1) if smoke else wall_clock_ms
    total = len(all_sizes) * len(OPS) + (len(TRAINING_VARIANTS) if training else 0)
    with CaseProgress(total, "hpcllm bench kernels") as progress:
        ops = bench_ops(all_sizes, device, clock, copy_gbps, backend, progress)
        training_rows = (
            bench_training(sizes, device, step_clock, backend, choice_timer, progress)
            if training
            else []
        )
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "smoke": smoke,
        "sizes": [{**asdict(s), "shape": asdict(s.shape())} for s in all_sizes],
        "copy_gbps": copy_gbps,
        "ops": ops,
        "training": training_rows,
    }


def build_parser() -> argparse.ArgumentParser:
    """Return the benchmark's command line (``hpcllm bench kernels``)."""
    parser = argparse.ArgumentParser(
        prog="hpcllm bench kernels",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--iters", type=int, default=None, help="timed runs per op and pass [default: 50, smoke 2]"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed training steps per variant [default: 20, smoke 2]",
    )
    parser.add_argument(
        "--no-training", action="store_true", help="time the ops only, not the training steps"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny sizes on the CPU under Triton's interpreter (checks the "
        "script; times mean nothing)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from command-line arguments; print the tables."""
    parser = build_parser()
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    result = run(
        smoke,
        args.iters or (2 if smoke else 50),
        args.steps or (2 if smoke else 20),
        training=not args.no_training,
    )
    print(render(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    from hpcllm.errors import run_reporting_errors

    sys.exit(run_reporting_errors(lambda: main(sys.argv[1:])))
