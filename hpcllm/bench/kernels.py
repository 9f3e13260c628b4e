"""``hpcllm bench kernels``: each fused Triton op against eager torch and torch.compile.

Per op, at the training shapes of two presets, each sized as its family gives it
(:func:`hpcllm.families.shape`: hidden size, heads, MLP width): gpt2-124m (micro-batch 16,
sequence 1024: 16384 tokens, h = 768, MLP 3072, 12 heads, vocabulary 50304) and gpt2-1.3b
(micro-batch 4, sequence 2048: 8192 tokens, h = 2048, MLP 8192, 16 heads), it times forward
and forward + backward (median of CUDA-event timings) of the eager reference, the reference
under torch.compile and the Triton op (the ``hpcllm`` custom op the dispatch calls), gives the
Triton op's speed-up over torch.compile, turns the bytes the op has to move into GB/s and
compares that with the device's measured copy bandwidth, and says which of the Triton op and the
eager reference ``model.fused_kernels: auto`` runs at that shape outside compiled graphs (its
chooser, timing with the same clock: :mod:`hpcllm.kernels.timing`). Then it times whole
training steps of the first preset's model (bf16 autocast, fused AdamW) with the
kernels off, on, auto (each op the faster of Triton and eager torch, timed on first use),
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
import gc
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hpcllm import families, kernels
from hpcllm.config import Config, load_config, padded_vocab
from hpcllm.errors import UserError
from hpcllm.kernels import reference
from hpcllm.kernels.registry import BenchCase, BenchShape
from hpcllm.kernels.timing import WARMUP, Clock
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


# One op as the bench times it: what its module's bench case gives (hpcllm.kernels.registry).
OpCase = BenchCase

# The ops _op_cases returns, in its order; known before their inputs are made, to count cases.
# Every op of the dispatch with a bench case (its module's).
OPS = tuple(op.name for op in kernels.OPS if op.bench is not None)


def _op_cases(sizes: Sizes, device: torch.device) -> list[OpCase]:
    """Return each op's bench case (of OPS), its inputs in the dtypes a bf16-autocast step
    gives them, at the shape of ``sizes``' model: the residual stream and norms at its
    hidden size, both MLP activations (GeLU's, SwiGLU's) at its MLP width, the rotation at
    its heads."""
    shape = sizes.shape()
    at = BenchShape(
        batch=sizes.batch,
        seq=shape.seq,
        hidden=shape.hidden,
        heads=shape.heads,
        ffn=shape.ffn or 4 * shape.hidden,
        vocab=sizes.vocab,
        padded_vocab=padded_vocab(sizes.vocab, 1),
        device=device,
        generator=torch.Generator(device=device).manual_seed(0),
        head_dim=shape.head_size,
    )
    return [op.bench(at) for op in kernels.OPS if op.bench is not None]


def copy_bandwidth_gbps(device: torch.device, clock: Clock, nbytes: int) -> float:
    """Return the device's measured copy bandwidth: bytes read + written per second, in GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = clock.median_ms(lambda: dst.copy_(src), device)
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
    """Return a forward row and a forward + backward row of timings for one op, each with
    what auto picks for it (:func:`auto_choice`)."""
    device = case.grad_inputs[0].device

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
    auto, auto_ms = auto_choice(case, clock)
    rows = []
    for label, make, nbytes in (
        ("fwd", fwd, case.fwd_bytes),
        ("fwd+bwd", fwd_bwd, case.fwd_bytes + case.bwd_bytes),
    ):
        ms = {name: clock.median_ms(make(fn), device) for name, fn in impls.items()}
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
                "auto": auto,
                "auto_fwd_bwd_ms": auto_ms,
            }
        )
    return rows


def auto_choice(case: OpCase, clock: Clock) -> tuple[str, dict[str, float]]:
    """Return what ``model.fused_kernels: auto`` runs for ``case``'s op at its shape, "triton"
    or "torch" (the eager reference), and the forward + backward milliseconds
    of each that it compared: the dispatch's first call of the op with auto on, its chooser
    timing with ``clock``."""
    was = kernels.enabled(), kernels.choosing(), kernels.compiled_reference()
    kernels.set_enabled(True, choose=True, clock=clock)
    try:
        case.call(getattr(kernels, case.name), False)
        ((key, pick),) = kernels.choices().items()
        triton_ms, torch_ms = kernels.choice_timings()[key]
    finally:
        kernels.set_enabled(was[0], choose=was[1], compiled_reference=was[2])
    return pick, {"triton": triton_ms, "torch": torch_ms}


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
    op_clock: Clock,
    progress: CaseProgress,
) -> list[dict[str, Any]]:
    """Return tokens/s, TFLOP/s, MFU and the ops that ran Triton, per training-step variant.

    ``clock`` times the steps, ``op_clock`` auto's choices; ``progress`` reports each variant
    as a case.
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
            clock=op_clock,
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

        ms = clock.median_ms(step, device)
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


# auto's choice as the op table names its columns
AUTO_PICKS = {"triton": "Triton", "torch": "eager"}


def render(result: dict[str, Any]) -> str:
    """Return the results as markdown tables."""
    lines = [
        f"Device: {result['device']}; torch {result['torch']}, Triton "
        f"{result['triton']}; copy bandwidth {result['copy_gbps']:.0f} GB/s.",
        "",
        "| shapes | op | pass | MB moved | eager ms | compile ms | Triton ms | Triton GB/s "
        "| % of copy BW | x vs eager | x vs compile | auto | max error |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in result["ops"]:
        lines.append(
            f"| {r['size']} | {r['op']} | {r['pass']} | {r['mbytes']:.1f} | {_fmt(r['eager_ms'])} "
            f"| {_fmt(r['compile_ms'])} | {_fmt(r['triton_ms'])} "
            f"| {r['triton_gbps']:.0f} | {r['pct_copy_bw']:.0f} "
            f"| {r['x_vs_eager']:.2f} | {r['x_vs_compile']:.2f} "
            f"| {AUTO_PICKS[r['auto']]} | {r['max_error']:.2g} |"
        )
    lines += [
        "",
        "auto: what model.fused_kernels: auto runs at the op's shape outside compiled graphs, "
        "the Triton op or the eager reference, as its chooser timed them (forward + backward, with "
        "this table's clock; its times are the JSON's auto_fwd_bwd_ms).",
    ]
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
    # One clock for the ops' rows and auto's choices, in the table and in the training steps.
    clock = Clock(warmup=1 if smoke else WARMUP, iters=iters)
    copy_gbps = copy_bandwidth_gbps(device, clock, (1 << 26) if smoke else (1 << 30))
    sizes = all_sizes[0]
    step_clock = Clock(warmup=clock.warmup, iters=steps)
    total = len(all_sizes) * len(OPS) + (len(TRAINING_VARIANTS) if training else 0)
    with CaseProgress(total, "hpcllm bench kernels") as progress:
        ops = bench_ops(all_sizes, device, clock, copy_gbps, backend, progress)
        training_rows = (
            bench_training(sizes, device, step_clock, backend, clock, progress) if training else []
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
