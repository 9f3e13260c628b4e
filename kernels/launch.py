"""What the ops' launchers share: output buffers, the tiling of a matrix, persistent grids.

A launcher (in its op's module) takes tensors of any leading shape and works on the
(rows, last dimension) matrix. Outputs keep the input's dtype; weight and bias gradients are
reduced in fp32 and cast to the parameter's dtype. Launch shapes, chosen for Hopper (an H100
has 132 SMs, up to 64 resident warps each):

- Pointwise kernels: tiles of :data:`TILE` elements, as wide as 1024 columns (a power of two
  that divides the row where one does: 768 → 256, 3072 → 1024), so a warp reads long
  contiguous runs; :data:`POINTWISE_WARPS` warps each (:func:`tiles`, and :func:`tile` on the
  device).
- Backward kernels that reduce over rows (bias, norm weights) are persistent: about
  ``_RESIDENT_WARPS`` warps' worth of programs per SM, each walking the rows with a stride,
  so the fp32 partial-sum buffer has a few rows per SM (gpt2-124m's 4h = 3072: 352 partial
  rows, 4 MB, next to 100 MB of activations) and one small torch sum finishes it
  (:func:`persistent_programs`).
- Under the interpreter a persistent grid has :data:`INTERPRETER_PROGRAMS` programs (per
  column tile), so the tests' programs walk several rows each.

Nothing here imports Triton: the grid arithmetic is Python's, and :func:`tile` is jitted with
the kernels that call it (:mod:`hpcllm.kernels.jit`).
"""

# ruff: noqa: ANN001, ANN201 - Triton reads a kernel's annotations (tl.constexpr); no others.

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from hpcllm.kernels.jit import kernel, tl

# Programs per column tile of a persistent grid under Triton's interpreter.
INTERPRETER_PROGRAMS = 3
# Elements per pointwise tile, and the warps of a pointwise program.
TILE = 4096
POINTWISE_WARPS = 4
# The widest column block.
_MAX_BLOCK_C = 1024
# The widest row a program keeps in registers (the norms'); wider rows run the reference.
MAX_ROW = 16384
# Warps a persistent backward keeps resident per SM (half of Hopper's 64): enough loads in
# flight to cover memory latency while each program still walks many rows.
_RESIDENT_WARPS = 32

_poison = False


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Fill every buffer a kernel is to write with NaN first, so an element it skips shows."""
    global _poison
    previous, _poison = _poison, True
    try:
        yield
    finally:
        _poison = previous


def new(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Return a buffer for a kernel to write (NaN-filled inside :func:`poisoned_outputs`)."""
    if _poison:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """Return ``x`` as a contiguous (rows, last dimension) matrix."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def row_fits(x: torch.Tensor, *_: object) -> bool:
    """Return whether a kernel that keeps a row in registers takes ``x``: some rows, none
    wider than :data:`MAX_ROW` (an op's ``supported``)."""
    return x.numel() > 0 and x.shape[-1] <= MAX_ROW


def next_power_of_2(n: int) -> int:
    """Return the smallest power of two ≥ ``n`` (n ≥ 1), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Return ⌈a / b⌉, as ``triton.cdiv``."""
    return (a + b - 1) // b


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Return the CUDA device's SM count (132 on an H100 SXM)."""
    return _cuda_sms(torch.cuda.current_device() if device.index is None else device.index)


def _col_block(n_cols: int) -> int:
    """Return the column block: the widest power of two up to 1024 that divides the row."""
    block = _MAX_BLOCK_C
    while block >= 128 and n_cols % block:
        block //= 2
    return block if block >= 128 else min(_MAX_BLOCK_C, next_power_of_2(n_cols))


def tiles(n_rows: int, n_cols: int) -> tuple[int, int, int, int]:
    """Return (BLOCK_R, BLOCK_C, row tiles, column tiles) of a pointwise kernel's tiling."""
    block_c = _col_block(n_cols)
    block_r = max(1, TILE // block_c)
    return block_r, block_c, cdiv(n_rows, block_r), cdiv(n_cols, block_c)


def persistent_programs(device: torch.device, warps: int, work: int, columns: int = 1) -> int:
    """Return how many programs per column tile a persistent kernel launches (≤ ``work``)."""
    if device.type != "cuda":
        return max(1, min(work, INTERPRETER_PROGRAMS))
    resident = sm_count(device) * max(1, _RESIDENT_WARPS // warps)
    return max(1, min(work, cdiv(resident, columns)))


def row_warps(block: int) -> int:
    """Return the warps of a program that holds a row of ``block`` columns."""
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def bias_grad(
    part: torch.Tensor | None, bias: torch.Tensor | None, like: torch.Tensor
) -> torch.Tensor:
    """Return the bias gradient summed from a persistent kernel's partial rows, or an empty
    tensor where there is no bias (a custom op cannot return None)."""
    if bias is None or part is None:
        return like.new_empty(0)
    return part.sum(dim=0).to(bias.dtype)


@kernel
def tile(pid_r, pid_c, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Return (column indices, flat offsets, mask) of tile (pid_r, pid_c) of a row-major matrix.

    ``tl.cast``, not ``.to``: a loop variable is a Python int in the interpreter.
    """
    rows = tl.cast(pid_r, tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    offs = rows[:, None] * n_cols + cols[None, :]
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return cols, offs, mask
