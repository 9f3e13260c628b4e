"""``hpcllm bench device``: what ``hpcllm plan`` assumes of a GPU, measured on this one.

The planner prices a step from a GPU's peak and four achieved fractions
(:mod:`hpcllm.plan.hardware`): the share of peak the best GEMM sustains (``gemm_ceiling``),
how that share falls with a GEMM's smallest dimension (``shape_factor``), the share of peak
causal flash attention reaches (``flash_efficiency``) and the share of HBM bandwidth a copy
reaches (``memory_efficiency``). Built in, they come from published sweeps and this project's
own runs of this benchmark on two H200s (:mod:`hpcllm.plan.sources` names each); it measures
them here and writes them as a ``gpu_spec`` mapping that a cluster
file takes as it is, so the planner prices this GPU from its own numbers.

- GEMMs: for each dimension d, the three shapes with d as M, N or K and the other two at
  ``--size`` (default 8192), and the square ``--size`` GEMM; TFLOP/s = 2·M·N·K / time
  (median of CUDA-event timings). ``gemm_ceiling`` = the best of the square GEMM and each
  d's median / peak; ``shape_factor[d]`` = d's median / that best (and the square GEMM's
  share at d = ``--size``).
- Attention: ``scaled_dot_product_attention`` causal, forward and backward, at batch 4,
  16 heads of 128, sequence 2048; the planner counts 2·b·s²·h FLOPs forward and 2.5 times
  that backward (the causal half), so ``flash_efficiency`` = 7·b·s²·h / time / peak, the
  figure at the shape the planner scales others from (for the kinds it knows, whose
  special-function rate ``sfu_tops`` it has; a fragment for another device gives none, and
  its efficiency then holds at every shape).
- HBM: ``dst.copy_(src)`` of 1 GiB; bandwidth = 2 × bytes / time; ``memory_efficiency`` =
  bandwidth / the data sheet's.

It measures in bf16 (or fp16: the same tensor-core peak), the precision whose fractions the
planner applies. The peaks, memory and HBM bandwidth are the data sheet's for the kinds the
planner knows (matched by the device name, or ``--kind``), and the fragment gives only what
was measured; for another device give ``--peak-tflops`` (16-bit) and ``--hbm-gbps``, or the
best GEMM and the copy measured here stand in for them (fractions of 1), its TF32 peak is
taken as half the 16-bit one (as on every kind listed) unless ``--peak-fp32-tflops`` says
otherwise, and its memory is the device's. ``--cpu-smoke`` runs it all tiny on the CPU, to
show the script works; its numbers describe nothing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from hpcllm.errors import UserError
from hpcllm.files import atomic_write
from hpcllm.plan.hardware import GPUS

DIMS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
SMOKE_DIMS = (16, 32, 64)


def kind_of(name: str) -> str | None:
    """Return the planner's GPU kind for a CUDA device name, or None if it knows none.

    Variants with other peaks or memory (GH200, H100 NVL, A100 80GB PCIe) are none of the
    kinds: give ``--kind`` or the figures.
    """
    upper = name.upper().replace(" ", "")
    if "GH200" in upper or "NVL" in upper:
        return None
    if "H200" in upper:
        return "h200"
    if "H100" in upper:
        return "h100-pcie" if "PCIE" in upper else "h100-sxm"
    if "A100" in upper:
        if "80GB" in upper:
            return None if "PCIE" in upper else "a100-80gb"
        return "a100-40gb"
    return None


def _timer(device: torch.device, iters: int, warmup: int) -> Callable[[Callable[[], Any]], float]:
    def median_seconds(fn: Callable[[], Any]) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                began = time.perf_counter()
                fn()
                times.append(time.perf_counter() - began)
        return statistics.median(times)

    return median_seconds


def measure(
    device: torch.device,
    dtype: torch.dtype,
    size: int,
    dims: Sequence[int],
    iters: int,
    warmup: int,
    attention: tuple[int, int, int, int],
    copy_bytes: int,
) -> dict[str, Any]:
    """Return the measured TFLOP/s of every GEMM, attention's and the copy's figures."""
    timed = _timer(device, iters, warmup)
    gemms: dict[str, float] = {}

    def gemm(m: int, n: int, k: int) -> float:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        seconds = timed(lambda: torch.mm(a, b))
        tflops = 2.0 * m * n * k / seconds / 1e12
        gemms[f"{m}x{n}x{k}"] = tflops
        return tflops

    square = gemm(size, size, size)
    by_dim = {}
    for d in dims:
        if d >= size:
            continue
        by_dim[d] = statistics.median(
            [gemm(d, size, size), gemm(size, d, size), gemm(size, size, d)]
        )
    best = max([square, *by_dim.values()])
    batch, heads, seq, head_dim = attention
    q, k, v = (
        torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype)

    def attend() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)  # no accumulation into .grad

    attention_s = timed(attend)
    hidden = heads * head_dim
    attention_tflops = 7.0 * batch * seq * seq * hidden / attention_s / 1e12
    src = torch.empty(copy_bytes // 4, device=device, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src))
    return {
        "size": size,
        "square_tflops": square,
        "gemm_tflops": gemms,
        "best_gemm_tflops": best,
        "by_dim_tflops": by_dim,
        "attention_tflops": attention_tflops,
        "copy_gbps": 2.0 * copy_bytes / copy_s / 1e9,
    }


def _sig(x: float) -> float:
    """Return ``x`` to four significant figures (a CPU's TFLOP/s are small)."""
    return float(f"{x:.4g}")


def gpu_spec(
    measured: dict[str, Any],
    kind: str | None,
    memory_gb: float,
    peak_tflops: float | None = None,
    hbm_gbps: float | None = None,
    peak_fp32_tflops: float | None = None,
) -> dict[str, Any]:
    """Return the ``gpu_spec`` mapping a cluster file takes, from 16-bit measurements.

    For a kind the planner knows, only the measured fractions (its data sheet keeps the
    peaks, memory and bandwidth); for another device every field.
    """
    known = GPUS.get(kind) if kind else None
    best = measured["best_gemm_tflops"]
    peak = peak_tflops or (known.peak_bf16 if known else None)
    ceiling = best / peak if peak else 1.0
    peak = peak or best
    hbm = hbm_gbps or (known.hbm_gbps if known else None)
    spec: dict[str, Any] = {}
    if known is None or peak_tflops or peak_fp32_tflops or hbm_gbps:
        fp32 = peak_fp32_tflops or (known.peak_fp32 if known else peak / 2)
        spec |= {"peak_bf16": _sig(peak), "peak_fp32": _sig(fp32)}
        spec["hbm_gbps"] = _sig(hbm or measured["copy_gbps"])
    if known is None:
        spec["memory_gb"] = _sig(memory_gb)
    spec |= {
        "gemm_ceiling": _sig(ceiling),
        "flash_efficiency": _sig(measured["attention_tflops"] / peak),
        "memory_efficiency": _sig(measured["copy_gbps"] / hbm if hbm else 1.0),
        "shape_factor": {d: _sig(t / best) for d, t in measured["by_dim_tflops"].items()},
    }
    spec["shape_factor"][measured["size"]] = _sig(measured["square_tflops"] / best)
    return spec


def render_yaml(spec: dict[str, Any], kind: str | None, header: Sequence[str]) -> str:
    """Return a cluster-file fragment: the GPU kind and its measured ``gpu_spec``."""
    lines = [f"# {line}" for line in header]
    lines.append(f"gpu: {kind or 'measured'}")
    lines.append("gpu_spec:")
    for key, value in spec.items():
        if key == "shape_factor":
            lines.append("  shape_factor:")
            lines.extend(f"    {d}: {share}" for d, share in value.items())
        else:
            lines.append(f"  {key}: {value}")
    return "\n".join(lines) + "\n"


def render_table(measured: dict[str, Any], spec: dict[str, Any], peak: float) -> str:
    """Return the measured figures as text: GEMMs by dimension, attention, copy."""
    size = measured["size"]
    rows = [
        "| smallest GEMM dimension | TFLOP/s (median of M, N, K) | share of the best |",
        "|---:|---:|---:|",
    ]
    for d, tflops in [*measured["by_dim_tflops"].items(), (size, measured["square_tflops"])]:
        rows.append(f"| {d} | {tflops:.4g} | {spec['shape_factor'][d]:.3f} |")
    rows += [
        "",
        f"best GEMM: {measured['best_gemm_tflops']:.4g} TFLOP/s "
        f"(gemm_ceiling {spec['gemm_ceiling']:.3f} of the {peak:.4g} TFLOP/s 16-bit peak)",
        f"causal attention, forward + backward: {measured['attention_tflops']:.4g} TFLOP/s "
        f"(flash_efficiency {spec['flash_efficiency']:.3f})",
        f"copy: {measured['copy_gbps']:.4g} GB/s (memory_efficiency "
        f"{spec['memory_efficiency']:.3f})",
    ]
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    """Return the benchmark's command line (``hpcllm bench device``)."""
    parser = argparse.ArgumentParser(
        prog="hpcllm bench device",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--dtype", choices=("bf16", "fp16"), default="bf16", help="16-bit kind [default: bf16]"
    )
    parser.add_argument("--size", type=int, default=None, help="[default: 8192, smoke 128]")
    parser.add_argument("--iters", type=int, default=None, help="[default: 20, smoke 2]")
    parser.add_argument("--kind", choices=sorted(GPUS), default=None, help="[default: by name]")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense 16-bit peak")
    parser.add_argument("--peak-fp32-tflops", type=float, default=None, help="TF32 peak")
    parser.add_argument("--hbm-gbps", type=float, default=None)
    parser.add_argument(
        "--out", type=Path, default=None, help="write the cluster-file fragment here"
    )
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny sizes on the CPU (numbers mean nothing)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Measure this device, print the table, write the ``gpu_spec`` fragment."""
    parser = build_parser()
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    for name in ("size", "iters", "peak_tflops", "peak_fp32_tflops", "hbm_gbps"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {value}")
    dims = SMOKE_DIMS if smoke else DIMS
    if args.size is not None and args.size <= dims[0]:
        raise UserError(f"--size {args.size} leaves no GEMM dimension below it: use {dims[1]}+")
    if args.out is not None:
        folder = args.out.resolve().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise UserError(f"cannot write {args.out}: {folder} is not a writable folder")
    if not smoke and not torch.cuda.is_available():
        raise UserError("hpcllm bench device measures a GPU and this node has none (--cpu-smoke)")
    device = torch.device("cpu" if smoke else "cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if smoke:
        name, memory_gb = "cpu", 1.0
    else:
        props = torch.cuda.get_device_properties(device)
        name, memory_gb = props.name, props.total_memory / 1e9
    kind = args.kind or (None if smoke else kind_of(name))
    measured = measure(
        device,
        dtype,
        args.size or (128 if smoke else 8192),
        dims,
        args.iters or (2 if smoke else 20),
        1 if smoke else 5,
        (1, 2, 64, 32) if smoke else (4, 16, 2048, 128),
        (4 << 20) if smoke else (1 << 30),
    )
    spec = gpu_spec(
        measured, kind, memory_gb, args.peak_tflops, args.hbm_gbps, args.peak_fp32_tflops
    )
    peak = args.peak_tflops or (GPUS[kind].peak_bf16 if kind else measured["best_gemm_tflops"])
    versions = f"torch {torch.__version__}"
    if not smoke:
        versions += f", CUDA {torch.version.cuda}"
        try:
            import triton

            versions += f", Triton {triton.__version__}"
        except ImportError:
            pass
    command = " ".join(["hpcllm bench device", *(argv if argv is not None else sys.argv[1:])])
    header = [
        f"measured by `{command}` on {name} ({kind or 'no kind the planner knows'}), {versions}, "
        f"{datetime.date.today().isoformat()}",
        "paste into a cluster file (jobs/clusters/*.yaml) in place of its gpu line",
    ]
    print(render_table(measured, spec, peak))
    text = render_yaml(spec, kind, header)
    if args.out:
        try:
            atomic_write(args.out, text)
        except OSError as err:
            raise UserError(f"cannot write {args.out}: {err.strerror or err}") from None
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
