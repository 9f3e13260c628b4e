"""What the planner knows of a machine: GPU kinds from their specifications, clusters from YAML.

Every number here comes from :mod:`hpcllm.plan.sources`, which names where each comes from.
Peaks are the dense (no sparsity) tensor-core figures of NVIDIA's data sheets; ``fp32`` is
TF32, which hpcllm's fp32 runs use on tensor cores. What a kernel achieves is a fraction of
those peaks:

- ``gemm_ceiling``: the share of peak the best-shaped BF16 GEMM sustains (Bekman's mamf-finder
  sweeps). Smaller GEMMs lose to tile and wave quantization (:func:`gemm_efficiency`, by the
  table ``hpcllm bench device`` measured).
- ``flash_efficiency``: causal flash attention's share of peak, forward and backward together,
  at sequence 2,048 and head dimension 128 (``bench device``'s shape); other shapes scale by
  :func:`attention_efficiency`.
- ``memory_efficiency``: the share of HBM bandwidth a streaming kernel reaches.
- ``sfu_tops``: the special-function units' rate (a softmax's exp), which bounds attention
  at small head dimensions.

A cluster file names a GPU kind (or describes one with a ``gpu_spec`` mapping, as the CPU file
does) and the network. Bandwidths are what collectives achieve (nccl-tests' "bus bandwidth"),
per GPU and per direction: inside a node over NVLink/NVSwitch, between nodes over each GPU's
own network adapter (one per GPU on DGX systems).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hpcllm.plan.sources import SHAPE_FACTOR, value
from hpcllm.user_error import UserError

# The shape at which ``flash_efficiency`` is given (``hpcllm bench device`` measures there).
FLASH_SEQ, FLASH_HEAD_DIM = 2048, 128


@dataclass(frozen=True)
class GPU:
    """One GPU kind: peak TFLOP/s by precision, memory, bandwidth, and achieved fractions."""

    name: str
    peak_bf16: float  # TFLOP/s, dense; fp16 is the same on every kind listed
    peak_fp32: float  # TFLOP/s, TF32 tensor cores
    memory_gb: float
    hbm_gbps: float  # GB/s
    gemm_ceiling: float
    flash_efficiency: float
    memory_efficiency: float
    # (smallest dimension, fraction of gemm_ceiling), increasing, linear in log2 between the
    # points; measured by ``hpcllm bench device`` (the built-in table, or a cluster file's).
    shape_factor: tuple[tuple[int, float], ...] = SHAPE_FACTOR
    sfu_tops: float | None = None  # T exp/s; None: attention not scaled by its shape

    def peak(self, precision: str) -> float:
        """Return the peak TFLOP/s for ``bf16``, ``fp16`` or ``fp32``."""
        return self.peak_fp32 if precision == "fp32" else self.peak_bf16


def _kind(name: str, generation: str, sfu: str) -> GPU:
    """Return GPU kind ``name`` from its figures (:data:`hpcllm.plan.sources.FIGURES`): its
    own data sheet's, its generation's GEMM and attention fractions, the special-function
    rate of kind ``sfu``."""
    return GPU(
        name,
        value(f"{name}.peak_bf16"),
        value(f"{name}.peak_fp32"),
        value(f"{name}.memory_gb"),
        value(f"{name}.hbm_gbps"),
        value(f"{generation}.gemm_ceiling"),
        value(f"{generation}.flash_efficiency"),
        value("memory_efficiency"),
        sfu_tops=value(f"{sfu}.sfu_tops"),
    )


GPUS: dict[str, GPU] = {
    gpu.name: gpu
    for gpu in (
        _kind("a100-40gb", "a100", "a100"),
        _kind("a100-80gb", "a100", "a100"),
        _kind("h100-sxm", "h100", "h100-sxm"),
        _kind("h100-pcie", "h100", "h100-pcie"),
        _kind("h200", "h100", "h100-sxm"),
    )
}


def gemm_efficiency(gpu: GPU, dims: Sequence[int]) -> float:
    """Return the fraction of peak a GEMM of these dimensions (M, N, K) reaches."""
    table = gpu.shape_factor
    small = max(1, min(dims))
    if small >= table[-1][0]:
        return gpu.gemm_ceiling * table[-1][1]
    if small <= table[0][0]:
        return gpu.gemm_ceiling * table[0][1] * small / table[0][0]
    for (d0, f0), (d1, f1) in zip(table, table[1:], strict=False):
        if small <= d1:
            share = (math.log2(small) - math.log2(d0)) / (math.log2(d1) - math.log2(d0))
            return gpu.gemm_ceiling * (f0 + share * (f1 - f0))
    return gpu.gemm_ceiling * table[-1][1]


def attention_efficiency(gpu: GPU, seq: int, head_dim: int) -> float:
    """Return the fraction of peak causal flash attention reaches, forward and backward, at
    this sequence length and head dimension: ``flash_efficiency`` (given at 2,048 and 128)
    scaled by two shares that the shape moves.

    - The causal tiles: a kernel walks blocks of ``flash.block`` queries and keys and computes
      the n(n + 1)/2 blocks on and below the diagonal of the n = s/block; the n²/2 below it are
      the causal work counted, n/(n + 1) of it.
    - The exps: each score takes 14·d matmul FLOPs (2·2·d forward, 2.5 times that backward) and
      two exps (forward and the backward's recomputation) on the special-function units; the
      matmul share of that time grows with the head dimension d.

    A kind without ``sfu_tops`` (a CPU, a device described by its ``gpu_spec`` alone) has no
    known flash kernel: its ``flash_efficiency`` holds at every shape.
    """
    if gpu.sfu_tops is None:
        return gpu.flash_efficiency
    block = value("flash.block")

    def tiles(s: int) -> float:
        n = max(1.0, s / block)
        return n / (n + 1)

    def matmuls(d: int) -> float:
        assert gpu.sfu_tops is not None
        flops = 2 * 2 * d * (1 + value("flash.backward_ratio"))
        mm = flops / (gpu.peak_bf16 * 1e12)
        return mm / (mm + 2 / (gpu.sfu_tops * 1e12))

    shape = tiles(seq) / tiles(FLASH_SEQ) * matmuls(head_dim) / matmuls(FLASH_HEAD_DIM)
    return gpu.flash_efficiency * shape


@dataclass(frozen=True)
class Cluster:
    """GPUs per node and the network between them."""

    name: str
    gpu: GPU
    gpus_per_node: int
    intra_node_gbps: float  # per GPU and direction, what collectives achieve
    inter_node_gbps: float  # per GPU and direction, over its own network adapter
    intra_node_latency_us: float
    inter_node_latency_us: float
    # the rest: CUDA context, workspaces, fragmentation (sources: usable_memory_fraction)
    usable_memory_fraction: float = value("usable_memory_fraction")
    # Measured collective tables (``hpcllm bench report``): {link kind: {collective: {message
    # bytes: bus GB/s}}}, link kinds in LINK_KINDS, collectives in COLLECTIVES.
    comm_tables: dict[str, dict[str, dict[int, float]]] = field(
        default_factory=dict, compare=False, hash=False
    )

    def link(self, kind: str) -> tuple[float, float]:
        """Return the constant (GB/s per GPU, latency µs) of a link kind (LINK_KINDS)."""
        if kind == "inter_node":
            return self.inter_node_gbps, self.inter_node_latency_us
        return self.intra_node_gbps, self.intra_node_latency_us

    def bus_time_s(self, kind: str, collective: str, nbytes: float) -> float | None:
        """Return ``nbytes`` over the bus bandwidth the measured table of ``collective`` on
        ``kind`` links gives at that size (None: no table): linear in the size between two
        measured sizes (a latency plus a bandwidth between them), the smallest size's time
        below it (latency-bound), the largest size's bandwidth above it."""
        table = self.comm_tables.get(kind, {}).get(collective)
        if not table:
            return None
        sizes = sorted(table)
        if nbytes <= sizes[0]:
            return sizes[0] / (table[sizes[0]] * 1e9)
        if nbytes >= sizes[-1]:
            return nbytes / (table[sizes[-1]] * 1e9)
        upper = bisect.bisect_left(sizes, nbytes)
        s0, s1 = sizes[upper - 1], sizes[upper]
        t0, t1 = s0 / (table[s0] * 1e9), s1 / (table[s1] * 1e9)
        return t0 + (t1 - t0) * (nbytes - s0) / (s1 - s0)


LINK_KINDS = ("intra_node", "inter_node")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def bus_factor(collective: str, ranks: int) -> float:
    """Return nccl-tests' busbw / algbw of ``collective`` on ``ranks`` GPUs: 2(n-1)/n for
    all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for send/recv."""
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; one of {', '.join(COLLECTIVES)}")
    if collective == "send_recv":
        return 1.0
    share = (ranks - 1) / ranks
    return 2 * share if collective == "all_reduce" else share


def latency_steps(collective: str, ranks: int) -> int:
    """Return the latency-bound steps of a ring ``collective`` on ``ranks`` GPUs."""
    if collective == "send_recv":
        return 1
    return 2 * (ranks - 1) if collective == "all_reduce" else ranks - 1


_REQUIRED = (
    "gpus_per_node",
    "intra_node_gbps",
    "inter_node_gbps",
    "intra_node_latency_us",
    "inter_node_latency_us",
)


def _number(where: str, key: str, value: Any, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(f"{where}: {key} must be a number, got {value!r}")
    if value <= 0 if positive else value < 0:
        raise UserError(f"{where}: {key} must be {'above' if positive else 'at least'} 0")
    return float(value)


def _shape_factor(where: str, raw: Any) -> tuple[tuple[int, float], ...]:
    if not isinstance(raw, dict) or len(raw) < 2:
        raise UserError(
            f"{where}: gpu_spec.shape_factor must map two or more GEMM dimensions to the "
            "fraction of gemm_ceiling they reach, e.g. {64: 0.3, 2048: 1.0}"
        )
    table = []
    for dim, share in raw.items():
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise UserError(f"{where}: gpu_spec.shape_factor: {dim!r} is not a dimension")
        value = _number(where, f"gpu_spec.shape_factor[{dim}]", share)
        if value > 1.5:
            raise UserError(f"{where}: gpu_spec.shape_factor[{dim}] = {value} is not a fraction")
        table.append((dim, value))
    return tuple(sorted(table))


def _gpu(where: str, raw: dict[str, Any]) -> GPU:
    kind = raw.get("gpu")
    base = GPUS.get(kind) if isinstance(kind, str) else None
    if "gpu_spec" in raw:
        spec = raw["gpu_spec"]
        if not isinstance(spec, dict):
            raise UserError(f"{where}: gpu_spec must be a mapping of the GPU fields")
        optional = ("shape_factor", "sfu_tops")
        names = [f.name for f in fields(GPU) if f.name not in ("name", *optional)]
        unknown = sorted(set(spec) - set(names) - set(optional))
        if unknown:
            raise UserError(f"{where}: gpu_spec has unknown field {unknown[0]}")
        # A known kind takes the fields given (what ``hpcllm bench device`` measured) and
        # keeps its own for the rest; any other kind must give them all.
        missing = [n for n in names if n not in spec]
        if missing and base is None:
            raise UserError(f"{where}: gpu_spec lacks {', '.join(missing)}")
        values: dict[str, Any] = {
            n: _number(where, n, spec[n]) if n in spec else getattr(base, n) for n in names
        }
        if "shape_factor" in spec:
            values["shape_factor"] = _shape_factor(where, spec["shape_factor"])
        elif base is not None:
            values["shape_factor"] = base.shape_factor
        if "sfu_tops" in spec:
            values["sfu_tops"] = _number(where, "sfu_tops", spec["sfu_tops"])
        elif base is not None:
            values["sfu_tops"] = base.sfu_tops
        return GPU(str(kind if kind is not None else "custom"), **values)
    if base is None:
        raise UserError(f"{where}: unknown gpu {kind!r}; kinds: {', '.join(GPUS)} (or a gpu_spec)")
    return base


def cluster_from_dict(raw: Any, where: str = "cluster") -> Cluster:
    """Return the cluster a mapping describes; one-line :class:`UserError` if it cannot."""
    if not isinstance(raw, dict):
        raise UserError(f"{where}: a cluster file is a YAML mapping")
    missing = [key for key in ("gpu", *_REQUIRED) if key not in raw]
    if missing:
        raise UserError(
            f"{where}: missing field {missing[0]} (fields: gpu, {', '.join(_REQUIRED)})"
        )
    known = {"name", "gpu", "gpu_spec", "usable_memory_fraction", "comm_tables", *_REQUIRED}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise UserError(f"{where}: unknown field {unknown[0]}")
    per_node = raw["gpus_per_node"]
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        raise UserError(f"{where}: gpus_per_node must be a positive integer, got {per_node!r}")
    usable = _number(
        where,
        "usable_memory_fraction",
        raw.get("usable_memory_fraction", value("usable_memory_fraction")),
    )
    if usable > 1:
        raise UserError(f"{where}: usable_memory_fraction must be at most 1")
    return Cluster(
        name=str(raw.get("name", where)),
        gpu=_gpu(where, raw),
        gpus_per_node=per_node,
        intra_node_gbps=_number(where, "intra_node_gbps", raw["intra_node_gbps"]),
        inter_node_gbps=_number(where, "inter_node_gbps", raw["inter_node_gbps"]),
        intra_node_latency_us=_number(
            where, "intra_node_latency_us", raw["intra_node_latency_us"], positive=False
        ),
        inter_node_latency_us=_number(
            where, "inter_node_latency_us", raw["inter_node_latency_us"], positive=False
        ),
        usable_memory_fraction=usable,
        comm_tables=_comm_tables(where, raw.get("comm_tables", {})),
    )


def _comm_tables(where: str, raw: Any) -> dict[str, dict[str, dict[int, float]]]:
    """Return ``comm_tables`` checked: link kind -> collective -> {bytes: bus GB/s}."""
    if not isinstance(raw, dict):
        raise UserError(f"{where}: comm_tables must map link kinds ({', '.join(LINK_KINDS)})")
    tables: dict[str, dict[str, dict[int, float]]] = {}
    for link, per_collective in raw.items():
        if link not in LINK_KINDS:
            raise UserError(
                f"{where}: comm_tables: unknown link kind {link!r}; kinds: {', '.join(LINK_KINDS)}"
            )
        if not isinstance(per_collective, dict) or not per_collective:
            raise UserError(f"{where}: comm_tables.{link} must map collectives to tables")
        for name, table in per_collective.items():
            at = f"comm_tables.{link}.{name}"
            if name not in COLLECTIVES:
                raise UserError(
                    f"{where}: {at}: unknown collective; collectives: {', '.join(COLLECTIVES)}"
                )
            if not isinstance(table, dict) or not table:
                raise UserError(f"{where}: {at} must map message bytes to bus GB/s")
            checked = {}
            for size, gbps in table.items():
                if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                    raise UserError(f"{where}: {at}: {size!r} is not a message size in bytes")
                checked[size] = _number(where, f"{at}[{size}]", gbps)
            tables.setdefault(link, {})[name] = dict(sorted(checked.items()))
    return tables


def load_cluster(path: Path, overrides: Sequence[str] = ()) -> Cluster:
    """Return the cluster of a YAML file, with ``key=value`` overrides (``gpu_spec.x=…`` too)."""
    from hpcllm.config import load_yaml

    path = Path(path)
    try:
        raw = load_yaml(path.read_text())
    except OSError as err:
        raise UserError(f"cannot read the cluster file {path}: {err.strerror or err}") from None
    except Exception as err:  # noqa: BLE001 - any parse error is one line
        raise UserError(f"{path}: not YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: a cluster file is a YAML mapping")
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise UserError(f"--cluster-set takes key=value, got {item!r}")
        try:
            value = load_yaml(text) if text else text
        except Exception as err:  # noqa: BLE001 - any parse error is one line
            first = str(err).splitlines()[0]
            raise UserError(f"--cluster-set {item}: not a YAML value ({first})") from None
        if key.startswith("gpu_spec."):
            raw.setdefault("gpu_spec", {})[key.removeprefix("gpu_spec.")] = value
        else:
            raw[key] = value
    return cluster_from_dict(raw, str(path))
