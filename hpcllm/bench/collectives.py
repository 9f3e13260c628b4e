"""The collectives, size by size: all-reduce, all-gather, reduce-scatter, all-to-all, send/recv.

Runs inside each rank of an mpirun job of two or more ranks, on the grid's device
(:func:`hpcllm.topology.init`), and times each collective at each message size through each
transport present, in this order: torch.distributed with the grid's backend (nccl on CUDA,
gloo on the CPU), MPI through mpi4py on numpy buffers (host memory, also on a GPU node: a
reference) and Horovod (where ``horovod.torch`` imports; last, since its background thread
keeps polling once started, with hpcllm's settings of a training run). A collective a
transport lacks (Horovod has no send/recv; an op the backend refuses) is listed as skipped,
with the reason, and has no rows.

The figures are nccl-tests' (NVIDIA/nccl-tests, doc/PERFORMANCE.md,
https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
``algbw = bytes / time`` and ``busbw = algbw x factor``, the factor turning algbw into what
the busiest link carries, so that busbw compares with the hardware's bandwidth whatever the
collective and rank count n: 2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter
and all-to-all, 1 for send/recv (:func:`bus_factor`). ``bytes`` is the per-rank buffer size
as nccl-tests defines it for each collective:

- all-reduce: the buffer each rank reduces (in place: input and output);
- all-gather: each rank's output, the n gathered parts (each rank sends bytes / n);
- reduce-scatter: each rank's input, the n parts reduced (each rank keeps bytes / n);
- all-to-all: each rank's send buffer (bytes / n to each rank; as much received);
- send/recv: the message each rank sends; a ring exchange, as nccl-tests' sendrecv: every
  rank r sends to r + 1 and receives from r - 1 (mod n) at the same time.

Sizes are rounded down to whole float32 elements, and to a multiple of n elements where the
buffer is split into n parts; a row gives the size after rounding.

The time of one size is the median over its iterations, each started after an MPI barrier
and stopped after the collective returned (and CUDA synchronized); the slowest rank's median
is the row's. Iterations shrink as sizes grow, ``min(iters, max(3, budget / bytes))``, so
that 1 GiB does not take minutes, each after ``min(warmup, iterations)`` untimed runs.

Before timing, each collective of each transport runs once at the smallest size on
rank-valued buffers and its result is compared with what it must be (an all-reduce of buffers
holding each rank's number sums to n(n-1)/2; an all-to-all delivers part s of rank r as its
part r of rank s, ...): a wrong call is skipped as a wrong result and gives no bandwidth.

Run: ``mpirun -np N hpcllm bench collectives [--sizes 8K,64K,1M | --min-bytes 8K
--max-bytes 1G --factor 2] [--iters 20] [--warmup 5] [--transports torch,mpi,horovod]
[--collectives all_reduce,...] [--json PATH]``; rank 0 prints the table and writes the JSON.
``--collectives all_reduce --sizes BYTES`` is what ``hpcllm bench allreduce`` measured (it is
gone); ``bench dp`` runs all_reduce, reduce_scatter and all_gather at its gradient's size.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpcllm.errors import UserError
from hpcllm.observe import CaseProgress
from hpcllm.plan.hardware import bus_factor

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
TRANSPORTS = ("torch", "mpi", "horovod")  # the order they run: Horovod's thread polls once started
DEFAULT_MIN_BYTES = 8 << 10
DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_FACTOR = 2
DEFAULT_ITERS = 20
DEFAULT_WARMUP = 5
DEFAULT_BUDGET_BYTES = 1 << 30
MIN_ITERS = 3
_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_WHAT = "hpcllm bench collectives"


def parse_size(text: str) -> int:
    """Return the bytes ``text`` names: a whole number, optionally with K, M or G (x 1024^k)."""
    match = _SIZE.match(text)
    if match is None or int(match[1]) <= 0:
        raise ValueError(f"{text!r} is not a size in bytes such as 8192, 8K, 64M or 1G")
    return int(match[1]) * _UNITS[match[2].lower()]


def parse_sizes(text: str) -> list[int]:
    """Return the sizes of a comma-separated list (``8K,64K,1M``), ascending, each once."""
    sizes = {parse_size(part) for part in text.split(",") if part.strip()}
    if not sizes:
        raise ValueError(f"{text!r} names no size; give them as 8K,64K,1M")
    return sorted(sizes)


def size_range(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """Return min_bytes, min_bytes x factor, ... up to max_bytes (nccl-tests' -b, -e, -f)."""
    if min_bytes <= 0 or max_bytes < min_bytes or factor < 2:
        raise ValueError(
            f"sizes from {min_bytes} to {max_bytes} bytes by x{factor}: need 0 < min <= max "
            "and a factor of 2 or more"
        )
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


def iterations(nbytes: int, iters: int, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> int:
    """Return the timed iterations of one size: ``budget_bytes / nbytes``, from 3 to ``iters``."""
    return min(iters, max(MIN_ITERS, budget_bytes // max(nbytes, 1)))


# -- what each collective must give ------------------------------------------------------


def _lengths(collective: str, n: int, nbytes: int) -> tuple[int, int]:
    """Return (input, output) float32 elements per rank for a buffer of ``nbytes``."""
    count = max(nbytes // 4, 1)
    if collective in ("all_reduce", "send_recv"):
        return count, count
    count = max(count // n, 1) * n  # n equal parts
    if collective == "all_gather":
        return count // n, count
    if collective == "reduce_scatter":
        return count, count // n
    return count, count  # all_to_all


def _moved_bytes(collective: str, n: int, nbytes: int) -> int:
    """Return the bytes a row reports: the buffer nccl-tests sizes, after rounding."""
    inp, out = _lengths(collective, n, nbytes)
    return 4 * (out if collective == "all_gather" else inp)


def _inputs(collective: str, rank: int, n: int, length: int) -> np.ndarray:
    """Return rank ``rank``'s input for the check: values that show where each part went."""
    parts = np.arange(n, dtype=np.float32)
    if collective == "reduce_scatter":  # part k holds rank + k n
        return np.repeat(rank + n * parts, length // n)
    if collective == "all_to_all":  # part k, for rank k, holds rank n + k
        return np.repeat(rank * n + parts, length // n)
    return np.full(length, rank, dtype=np.float32)


def _expected(collective: str, rank: int, n: int, length: int) -> np.ndarray:
    """Return what rank ``rank`` must hold after the collective on :func:`_inputs`."""
    parts = np.arange(n, dtype=np.float32)
    if collective == "all_reduce":
        return np.full(length, n * (n - 1) / 2, dtype=np.float32)
    if collective == "all_gather":
        return np.repeat(parts, length // n)
    if collective == "reduce_scatter":
        return np.full(length, n * (n - 1) / 2 + rank * n * n, dtype=np.float32)
    if collective == "all_to_all":  # part s came from rank s
        return np.repeat(parts * n + rank, length // n)
    return np.full(length, (rank - 1) % n, dtype=np.float32)  # from the previous rank


# -- the transports ----------------------------------------------------------------------

_Op = tuple[Callable[[], Any], Callable[[], Any]]  # run it; its output (array or tensor)


def _torch_op(grid: Any, collective: str, inp: np.ndarray, out_len: int) -> _Op:
    """Return the collective through torch.distributed on the grid's device."""
    import torch.distributed as dist

    x = torch.from_numpy(inp).to(grid.device)
    if collective == "all_reduce":
        return (lambda: dist.all_reduce(x)), lambda: x
    y = torch.empty(out_len, device=grid.device)
    if collective == "all_gather":
        return (lambda: dist.all_gather_single(y, x)), lambda: y
    if collective == "reduce_scatter":
        return (lambda: dist.reduce_scatter_single(y, x)), lambda: y
    if collective == "all_to_all":
        return (lambda: dist.all_to_all_single(y, x)), lambda: y
    n, r = grid.world_size, grid.rank

    def ring() -> None:
        ops = [dist.P2POp(dist.isend, x, (r + 1) % n), dist.P2POp(dist.irecv, y, (r - 1) % n)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return ring, lambda: y


def _mpi_op(grid: Any, collective: str, inp: np.ndarray, out_len: int) -> _Op:
    """Return the collective through mpi4py on numpy buffers in host memory."""
    from mpi4py import MPI

    comm = grid.groups.world_comm
    x = np.ascontiguousarray(inp)
    if collective == "all_reduce":
        return (lambda: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)), lambda: x
    y = np.empty(out_len, dtype=np.float32)
    if collective == "all_gather":
        return (lambda: comm.Allgather(x, y)), lambda: y
    if collective == "reduce_scatter":
        return (lambda: comm.Reduce_scatter_block(x, y, op=MPI.SUM)), lambda: y
    if collective == "all_to_all":
        return (lambda: comm.Alltoall(x, y)), lambda: y
    n, r = grid.world_size, grid.rank
    return (lambda: comm.Sendrecv(x, dest=(r + 1) % n, recvbuf=y, source=(r - 1) % n)), lambda: y


@dataclass
class _Horovod:
    """Horovod, started on the first collective that needs it, as the engines start it."""

    grid: Any
    module: Any = None
    settings: str = ""  # what it ran with: "MPI, cycle 5 ms (hpcllm default), ..."

    def get(self) -> Any:
        """Return ``horovod.torch``, started on the grid's dp communicator (the world here)."""
        if self.module is None:
            from hpcllm.config import ParallelConfig
            from hpcllm.parallel.data.horovod import (
                describe_horovod,
                horovod_transport,
                start_horovod,
            )

            self.module, settings = start_horovod(self.grid, ParallelConfig())
            transport = horovod_transport(self.grid, self.module)
            self.settings = f"{transport}, {describe_horovod(settings)}"
        return self.module

    def op(self, collective: str, inp: np.ndarray, out_len: int) -> _Op:
        """Return the collective through Horovod on the grid's device."""
        hvd = self.get()
        x = torch.from_numpy(inp).to(self.grid.device)
        name = f"bench.{collective}.{x.numel()}"
        out = [x]
        calls = {
            "all_reduce": lambda: hvd.allreduce_(x, op=hvd.Sum, name=name),
            "all_gather": lambda: out.__setitem__(0, hvd.allgather(x, name=name)),
            "reduce_scatter": lambda: out.__setitem__(
                0, hvd.reducescatter(x, op=hvd.Sum, name=name)
            ),
            "all_to_all": lambda: out.__setitem__(0, hvd.alltoall(x, name=name)),
        }
        return calls[collective], lambda: out[0]


def _lacks(transport: str, collective: str) -> str | None:
    """Return why ``transport`` has no ``collective`` at all, None if it has it."""
    if transport == "horovod" and collective == "send_recv":
        return "Horovod has no point-to-point send/recv"
    return None


def _one_line(err: BaseException | str) -> str:
    """Return the first line of an error, at most 200 characters."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text if len(text) <= 200 else text[:197] + "..."


# -- measuring ---------------------------------------------------------------------------


@dataclass
class _Bench:
    """What every case needs: the grid, the world communicator, and Horovod when started."""

    grid: Any
    comm: Any
    horovod: _Horovod

    def op(self, transport: str, collective: str, nbytes: int, check: bool) -> _Op:
        """Return ``collective`` through ``transport`` on a buffer of ``nbytes``; for the
        check, on rank-valued inputs, else on zeros (an all-reduce in place stays finite)."""
        n, r = self.grid.world_size, self.grid.rank
        in_len, out_len = _lengths(collective, n, nbytes)
        inp = _inputs(collective, r, n, in_len) if check else np.zeros(in_len, dtype=np.float32)
        if transport == "torch":
            return _torch_op(self.grid, collective, inp, out_len)
        if transport == "mpi":
            return _mpi_op(self.grid, collective, inp, out_len)
        return self.horovod.op(collective, inp, out_len)

    def start(self, transport: str) -> str | None:
        """Start ``transport`` if it needs starting; return why it cannot run here, else None."""
        reason = None
        if transport == "horovod":
            try:
                self.horovod.get()
            except UserError as err:  # horovod.torch does not import: the same on every rank
                reason = f"Horovod is not available: {_one_line(err)}"
        return next((why for why in self.comm.allgather(reason) if why), None)

    def sync(self) -> None:
        """Wait for the device's queued work (the collectives' kernels on a GPU)."""
        if self.grid.device.type == "cuda":
            torch.cuda.synchronize(self.grid.device)

    def check(self, transport: str, collective: str, nbytes: int) -> str | None:
        """Run the collective once on rank-valued inputs; return why it fails on any rank
        (an error, or a wrong result), None if it gave every rank what it must."""
        reason = None
        try:
            run, output = self.op(transport, collective, nbytes, check=True)
            run()
            self.sync()
            out = output()
            got = np.asarray(out.cpu() if isinstance(out, torch.Tensor) else out).ravel()
            n, r = self.grid.world_size, self.grid.rank
            want = _expected(collective, r, n, _lengths(collective, n, nbytes)[1])
            if got.shape != want.shape or not np.array_equal(got, want):
                wrong = int(np.argmax(got != want)) if got.shape == want.shape else 0
                reason = (
                    f"wrong result at {nbytes} bytes on rank {r}: element {wrong} is "
                    f"{got[wrong] if got.size else 'missing'}, not {want[wrong]} "
                    f"({got.size} elements, {want.size} expected)"
                )
        except Exception as err:  # a backend that refuses the op refuses it on every rank
            reason = f"{type(err).__name__}: {_one_line(err)}"
        # Every rank skips what any rank could not run, so none waits in it alone.
        return next((why for why in self.comm.allgather(reason) if why), None)

    def seconds(self, run: Callable[[], Any], iters: int, warmup: int) -> float:
        """Return this rank's median seconds of ``run``, each after a barrier."""
        for _ in range(warmup):
            run()
        self.sync()
        times = []
        for _ in range(iters):
            self.comm.Barrier()
            start = time.perf_counter()
            run()
            self.sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)


def run_collectives(
    sizes: Sequence[int],
    iters: int,
    warmup: int,
    transports: Sequence[str] | None = None,
    *,
    collectives: Sequence[str] | None = None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    progress: bool = True,
) -> dict[str, Any] | None:
    """Time each collective at every size through each transport; rank 0 gets the result.

    ``transports`` (None: all of :data:`TRANSPORTS`) names those to run; one that is not
    present here is listed as skipped. ``collectives`` (None: all of :data:`COLLECTIVES`)
    names those to time. ``progress`` False keeps rank 0 from reporting each
    case on stderr. Returns the JSON's dict on rank 0, None on the others: world_size, nodes
    (distinct hosts), ranks_per_node (the most on one), device,
    backend, transports (those that ran), skipped ({collective, transport, reason}), rows
    ({collective, transport, bytes, iters, time_us, algbw_gbps, busbw_gbps}), and horovod (what
    carried it and its settings) where Horovod ran.
    """
    from hpcllm import topology

    asked = list(TRANSPORTS if transports is None else dict.fromkeys(transports))
    unknown = [t for t in asked if t not in TRANSPORTS]
    wanted = [t for t in TRANSPORTS if t in asked]  # in TRANSPORTS' order: Horovod last
    if unknown or not wanted or not sizes or min(sizes) <= 0 or iters < 1 or warmup < 0:
        raise UserError(
            f"{_WHAT}: need transports among {', '.join(TRANSPORTS)} (got "
            f"{', '.join(asked) or 'none'}), sizes above 0 bytes, --iters 1 or more and "
            "--warmup 0 or more"
        )
    named = list(COLLECTIVES if collectives is None else dict.fromkeys(collectives))
    timed = [c for c in COLLECTIVES if c in named]
    if len(timed) != len(named) or not timed:
        raise UserError(
            f"{_WHAT}: need collectives among {', '.join(COLLECTIVES)} (got "
            f"{', '.join(named) or 'none'})"
        )
    grid = topology.init()
    comm = _world_of_two_or_more(grid)
    bench = _Bench(grid, comm, _Horovod(grid))
    n = grid.world_size
    sizes = sorted(set(sizes))
    skipped: list[dict[str, str]] = []
    present: list[str] = []
    measured: list[tuple[str, str, int, int]] = []  # collective, transport, bytes, iters
    local: list[float] = []  # this rank's median seconds of each
    cases = len(wanted) * len(timed)
    with CaseProgress(cases, _WHAT, show=progress and grid.rank == 0) as shown:
        for transport in wanted:
            absent = bench.start(transport)
            if absent is None:
                present.append(transport)
            for collective in timed:
                shown.start(f"{collective} {transport}")
                reason = (
                    absent
                    or _lacks(transport, collective)
                    or bench.check(transport, collective, sizes[0])
                )
                if reason:
                    skipped.append(
                        {"collective": collective, "transport": transport, "reason": reason}
                    )
                    shown.done(f"skipped: {reason}")
                    continue
                for nbytes in sizes:
                    k = iterations(nbytes, iters, budget_bytes)
                    run, _ = bench.op(transport, collective, nbytes, check=False)
                    local.append(bench.seconds(run, k, min(warmup, k)))
                    measured.append((collective, transport, _moved_bytes(collective, n, nbytes), k))
                    del run  # its buffers, before the next size's
                shown.done(f"{len(sizes)} sizes")
    gathered = comm.gather(local, root=0)
    hosts = comm.gather(socket.gethostname(), root=0)
    if grid.rank != 0:
        return None
    per_host = collections.Counter(hosts)
    return {
        "world_size": n,
        # Where the ranks ran: one node (inside it: intra_node tables) or several (between
        # nodes: inter_node tables, which hpcllm bench report --merge adds to a cluster file).
        "nodes": len(per_host),
        "ranks_per_node": max(per_host.values()),
        "device": torch.cuda.get_device_name(grid.device) if grid.device.type == "cuda" else "cpu",
        "backend": grid.backend,
        "transports": present,
        "skipped": skipped,
        "rows": _rows(measured, gathered, n),
        # What Horovod's times include: at small sizes its cycle time, not the transfer.
        **({"horovod": bench.horovod.settings} if bench.horovod.settings else {}),
    }


def _rows(
    measured: list[tuple[str, str, int, int]], gathered: list[list[float]], n: int
) -> list[dict[str, Any]]:
    """Return one row per measured case, its time the slowest rank's median, ordered by
    collective, transport and size."""
    rows = []
    for i, (collective, transport, nbytes, k) in enumerate(measured):
        seconds = max(ranks[i] for ranks in gathered)
        algbw = nbytes / seconds / 1e9
        rows.append(
            {
                "collective": collective,
                "transport": transport,
                "bytes": nbytes,
                "iters": k,
                "time_us": seconds * 1e6,
                "algbw_gbps": algbw,
                "busbw_gbps": algbw * bus_factor(collective, n),
            }
        )
    order = {c: i for i, c in enumerate(COLLECTIVES)}
    transport_order = {t: i for i, t in enumerate(TRANSPORTS)}
    rows.sort(key=lambda r: (order[r["collective"]], transport_order[r["transport"]], r["bytes"]))
    return rows


def _world_of_two_or_more(grid: Any) -> Any:
    """Return the grid's world communicator; raise UserError outside mpirun or on one rank."""
    comm = grid.groups.world_comm
    if comm is None:
        raise UserError(f"{_WHAT} runs under mpirun with 2 or more ranks")
    if grid.world_size < 2:
        raise UserError(
            f"{_WHAT} needs 2 or more ranks: on one rank a collective moves nothing"
            + (
                " (this node has one GPU; run it across nodes, or on a node with more GPUs)"
                if grid.device.type == "cuda" and torch.cuda.device_count() < 2
                else ""
            )
        )
    return comm


def _human(nbytes: int) -> str:
    """Return ``nbytes`` as nccl-tests-style units: 8K, 64M, 1G (x 1024), else bytes."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def render(result: dict[str, Any]) -> str:
    """Return the result as a table: one row per collective, transport and size."""
    n = result["world_size"]
    lines = [
        f"collectives on {n} ranks ({result['device']}, torch backend {result['backend']}); "
        "time: slowest rank's median; busbw = algbw x factor (nccl-tests):",
        f"  {'collective':<15} {'transport':<9} {'bytes':>6} {'iters':>5} {'time us':>11} "
        f"{'algbw GB/s':>10} {'busbw GB/s':>10}",
    ]
    for row in result["rows"]:
        lines.append(
            f"  {row['collective']:<15} {row['transport']:<9} {_human(row['bytes']):>6} "
            f"{row['iters']:>5} {row['time_us']:>11.1f} {row['algbw_gbps']:>10.3f} "
            f"{row['busbw_gbps']:>10.3f}"
        )
    factors = ", ".join(f"{c} {bus_factor(c, n):.3g}" for c in COLLECTIVES)
    lines.append(f"  busbw factors at n = {n}: {factors}")
    if result["device"] != "cpu" and "mpi" in result["transports"]:
        lines.append("  mpi: host memory (a reference); torch and Horovod: the GPUs' memory")
    if result.get("horovod"):
        lines.append(f"  horovod: {result['horovod']} (a small message waits up to a cycle)")
    for skip in result["skipped"]:
        lines.append(f"  skipped {skip['collective']} {skip['transport']}: {skip['reason']}")
    return "\n".join(lines)


def _sizes_arg(text: str) -> list[int]:
    try:
        return parse_sizes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def build_parser() -> argparse.ArgumentParser:
    """Return the benchmark's command line (``python -m hpcllm.bench.collectives``)."""
    parser = argparse.ArgumentParser(
        prog="hpcllm bench collectives",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--sizes",
        type=_sizes_arg,
        default=None,
        help="the sizes in bytes, comma-separated, with K/M/G (x 1024): 8K,64K,1M "
        "[default: --min-bytes to --max-bytes]",
    )
    parser.add_argument("--min-bytes", type=_size_arg, default=None, help="[default: 8K]")
    parser.add_argument("--max-bytes", type=_size_arg, default=None, help="[default: 1G]")
    parser.add_argument(
        "--factor", type=int, default=None, help="each size is the last x this [default: 2]"
    )
    parser.add_argument(
        "--iters",
        type=int,
        default=DEFAULT_ITERS,
        help=f"timed iterations at most per size, fewer as sizes grow [default: {DEFAULT_ITERS}]",
    )
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="[default: 5]")
    parser.add_argument(
        "--budget",
        type=_size_arg,
        default=DEFAULT_BUDGET_BYTES,
        help="bytes per size that set its iterations: budget / size, from 3 to --iters "
        "[default: 1G]",
    )
    parser.add_argument(
        "--transports",
        default=",".join(TRANSPORTS),
        help=f"comma-separated, among {','.join(TRANSPORTS)} [default: all]",
    )
    parser.add_argument(
        "--collectives",
        default=",".join(COLLECTIVES),
        help=f"comma-separated, among {','.join(COLLECTIVES)} [default: all]",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    parser.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from command-line arguments; rank 0 prints the table, writes JSON."""
    parser = build_parser()
    args = parser.parse_args(argv)
    ranged = (args.min_bytes, args.max_bytes, args.factor)
    if args.sizes is not None and any(v is not None for v in ranged):
        parser.error("give --sizes or --min-bytes/--max-bytes/--factor, not both")
    sizes = args.sizes
    if sizes is None:
        try:
            sizes = size_range(
                args.min_bytes or DEFAULT_MIN_BYTES,
                args.max_bytes or DEFAULT_MAX_BYTES,
                args.factor or DEFAULT_FACTOR,
            )
        except ValueError as err:
            parser.error(str(err))
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    collectives = [c.strip() for c in args.collectives.split(",") if c.strip()]
    result = run_collectives(
        sizes,
        args.iters,
        args.warmup,
        transports,
        collectives=collectives,
        budget_bytes=args.budget,
        progress=not args.no_progress,
    )
    if result is not None:
        if args.json is not None:
            from hpcllm.files import atomic_write

            args.json.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(args.json, json.dumps(result, indent=2) + "\n")
        print(render(result))
    return 0


if __name__ == "__main__":
    from hpcllm.errors import end, run_reporting_errors

    end(run_reporting_errors(lambda: main(sys.argv[1:])))
