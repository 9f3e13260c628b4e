"""Every figure the planner prices a step with, and where it comes from.

A figure is one of five kinds:

- ``data sheet``: NVIDIA's published specification of a GPU (peaks, memory, bandwidth, SMs,
  clocks);
- ``publication``: a paper, a book or a project's published benchmark, named with its figure or
  table;
- ``measurement``: this project's, with the report under ``docs/reports/`` that holds it and the
  command that measured it;
- ``code``: a count read from the named software's source (bytes a kernel moves, passes it
  makes), not a speed;
- ``choice``: a margin the user sets (the memory a plan may fill), which decides what fits and
  never a time.

No figure is fitted to a table the planner is validated on (docs/plan.md, "Validation"): Table 1
of the SC21 paper, Table 4 of the Llama 3 paper and the single-GPU steps of
docs/benchmarks.md. ``tests/test_plan_sources.py`` checks that every figure names a source of
one of these kinds, that every measurement's report exists, and that the planner's cost code
holds no fractional literal of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("data sheet", "publication", "measurement", "code", "choice")


@dataclass(frozen=True)
class Figure:
    """A number, its kind (:data:`KINDS`) and its source: for a measurement the report's path
    under the repository root first, then what measured it."""

    value: float
    kind: str
    source: str


_A100_SHEET = "NVIDIA A100 Tensor Core GPU data sheet (SXM4), dense tensor-core figures"
_H100_SHEET = "NVIDIA H100 Tensor Core GPU data sheet (SXM5 and PCIe), dense figures"
_H200_SHEET = "NVIDIA H200 Tensor Core GPU data sheet (SXM), dense figures"
_BEKMAN = (
    "Stas Bekman, Machine Learning Engineering (2024), 'Maximum Achievable Matmul FLOPS' "
    "table from mamf-finder sweeps"
)
_H200_DEVICE = (
    "docs/reports/2026-11-26-h200/1-as-found/device.yaml and "
    "docs/reports/2026-11-26-h200-bench-report/raw/device.yaml: `hpcllm bench device` on two "
    "H200s, the mean of the two"
)

FIGURES: dict[str, Figure] = {
    # Peaks (TFLOP/s, dense: bf16 = fp16; fp32 is TF32), memory (GB) and HBM bandwidth (GB/s).
    "a100-40gb.peak_bf16": Figure(312.0, "data sheet", _A100_SHEET),
    "a100-40gb.peak_fp32": Figure(156.0, "data sheet", _A100_SHEET),
    "a100-40gb.memory_gb": Figure(40.0, "data sheet", _A100_SHEET),
    "a100-40gb.hbm_gbps": Figure(1555.0, "data sheet", _A100_SHEET),
    "a100-80gb.peak_bf16": Figure(312.0, "data sheet", _A100_SHEET),
    "a100-80gb.peak_fp32": Figure(156.0, "data sheet", _A100_SHEET),
    "a100-80gb.memory_gb": Figure(80.0, "data sheet", _A100_SHEET),
    "a100-80gb.hbm_gbps": Figure(2039.0, "data sheet", _A100_SHEET),
    "h100-sxm.peak_bf16": Figure(989.4, "data sheet", _H100_SHEET),
    "h100-sxm.peak_fp32": Figure(494.7, "data sheet", _H100_SHEET),
    "h100-sxm.memory_gb": Figure(80.0, "data sheet", _H100_SHEET),
    "h100-sxm.hbm_gbps": Figure(3350.0, "data sheet", _H100_SHEET),
    "h100-pcie.peak_bf16": Figure(756.0, "data sheet", _H100_SHEET),
    "h100-pcie.peak_fp32": Figure(378.0, "data sheet", _H100_SHEET),
    "h100-pcie.memory_gb": Figure(80.0, "data sheet", _H100_SHEET),
    "h100-pcie.hbm_gbps": Figure(2000.0, "data sheet", _H100_SHEET),
    "h200.peak_bf16": Figure(989.4, "data sheet", _H200_SHEET),
    "h200.peak_fp32": Figure(494.7, "data sheet", _H200_SHEET),
    "h200.memory_gb": Figure(141.0, "data sheet", _H200_SHEET),
    "h200.hbm_gbps": Figure(4800.0, "data sheet", _H200_SHEET),
    # Special-function units (the exp of a softmax), T results/s: 16 per SM and clock (the
    # CUDA C++ Programming Guide's arithmetic-instruction throughput table, compute capability
    # 8.0 and 9.0) at the clock the data sheet's peak implies: peak / (SMs x 2,048 FLOP per SM
    # and clock on an A100, 4,096 on an H100). The H100 SXM's 3.87 is the 3.9 TFLOP/s of
    # special functions FlashAttention-3 quotes (Shah et al., 2024).
    "a100.sfu_tops": Figure(312.0 * 16 / 2048, "data sheet", _A100_SHEET + "; CUDA guide"),
    "h100-sxm.sfu_tops": Figure(989.4 * 16 / 4096, "data sheet", _H100_SHEET + "; CUDA guide"),
    "h100-pcie.sfu_tops": Figure(756.0 * 16 / 4096, "data sheet", _H100_SHEET + "; CUDA guide"),
    # What kernels reach of those peaks.
    "a100.gemm_ceiling": Figure(267.9 / 312.0, "publication", _BEKMAN + ": A100 SXM 267.9"),
    "h100.gemm_ceiling": Figure(792.1 / 989.4, "publication", _BEKMAN + ": H100 SXM 792.1"),
    "a100.flash_efficiency": Figure(
        0.55,
        "publication",
        "Dao, FlashAttention-2 (2023): forward + backward on an A100, causal, head dimension "
        "128, sequence 2k (its attention-speed figures)",
    ),
    "h100.flash_efficiency": Figure(
        (0.2485 + 0.34) / 2,
        "measurement",
        _H200_DEVICE + " (causal SDPA forward + backward, batch 4, 16 heads of 128, seq 2,048)",
    ),
    # The share of the data sheet's HBM bandwidth a copy reaches, measured on two H200s; the
    # A100 and the H100 take it too (neither has been measured by this project).
    "memory_efficiency": Figure(
        (0.8579 + 0.8791) / 2,
        "measurement",
        _H200_DEVICE + " (a 1 GiB copy: 4,118 and 4,220 of 4,800 GB/s)",
    ),
    # Attention kernels (FlashAttention-2, Dao 2023, sections 3.1-3.3): query and key blocks of
    # 128 rows; the backward makes five matmuls where the forward makes two.
    "flash.block": Figure(128, "publication", "Dao, FlashAttention-2 (2023), section 3.3"),
    "flash.backward_ratio": Figure(2.5, "publication", "Dao, FlashAttention-2 (2023), 3.1-3.2"),
    # The share of a GPU's memory a plan may fill: a margin the user chooses (a cluster file's
    # usable_memory_fraction), for the CUDA context, the cuBLAS and NCCL workspaces and the
    # caching allocator's fragmentation. It decides what fits, never a time.
    "usable_memory_fraction": Figure(0.9, "choice", "the default of a cluster file's setting"),
}


# Fraction of the GEMM ceiling by a GEMM's smallest dimension (its M, N or K), from the mean
# of the two H200 tables of ``hpcllm bench device`` (the other two dimensions 8,192): tile and
# wave quantization. The planner applies it to every GPU kind until a cluster file gives that
# kind's own (``gpu_spec.shape_factor``).
SHAPE_FACTOR_SOURCE = Figure(0.0, "measurement", _H200_DEVICE + " (GEMM TFLOP/s by dimension)")
SHAPE_FACTOR: tuple[tuple[int, float], ...] = (
    (16, (0.04188 + 0.05433) / 2),
    (32, (0.08889 + 0.1154) / 2),
    (64, (0.1708 + 0.225) / 2),
    (128, (0.3376 + 0.4482) / 2),
    (256, (0.5999 + 0.7484) / 2),
    (512, (0.7626 + 0.7936) / 2),
    (1024, (0.869 + 0.8828) / 2),
    (2048, (0.9591 + 0.949) / 2),
    (4096, (0.9713 + 0.9531) / 2),
    (8192, 1.0),
)


def value(name: str) -> float:
    """Return figure ``name``'s value."""
    return FIGURES[name].value
