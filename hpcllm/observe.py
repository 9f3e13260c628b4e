"""What a run reports: FLOPs and MFU, memory, NVTX ranges, metrics.jsonl and TensorBoard, and
which case of how many a benchmark is running.

FLOPs: :mod:`hpcllm.flops` (Megatron's count, recomputation included).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import numpy as np
import torch

from hpcllm.files import atomic_write

# Dense peak TFLOP/s per GPU, from the vendors' data sheets (SXM parts, no sparsity). fp32
# means TF32 tensor cores, which torch uses for fp32 matmuls when allowed.
# More specific names first: an "H100 PCIe" must not match the SXM row.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 378.0},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 418.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0},
    "V100": {"bf16": 125.0, "fp16": 125.0, "fp32": 15.7},
}


def peak_tflops(device: torch.device, precision: str, override: float | None) -> float | None:
    """Return the device's peak TFLOP/s for ``precision``: the override, the table, or None."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return peaks[precision]
    return None


def memory_mb(device: torch.device) -> float:
    """Return peak allocated CUDA memory, or this process's resident set on CPU, in MB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e6
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss / 1e6


def gpu_utilisation(device: torch.device) -> float | None:
    """Return the GPU's busy percentage from NVML (what nvidia-smi shows), None off CUDA."""
    if device.type != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        # By UUID: under CUDA_VISIBLE_DEVICES (Slurm sets it) torch's index is not NVML's.
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        handle = (
            pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
            if uuid is not None
            else pynvml.nvmlDeviceGetHandleByIndex(index)
        )
        return float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:  # NVML missing or not permitted: the metric is simply absent
        return None


@functools.cache
def _nvtx_package() -> Any:
    """Return the ``nvtx`` package, or None where it is not installed (asked once)."""
    try:
        import nvtx
    except ImportError:
        return None
    return nvtx


def nvtx_range(name: str) -> contextlib.AbstractContextManager[Any]:
    """Return a range for Nsight Systems (a cheap no-op when no profiler is attached), in the
    ``hpcllm`` domain; torch's own NVTX markers (no domain) where the ``nvtx`` package is
    missing (a GPU image it was not installed on), and nothing where neither is there."""
    nvtx = _nvtx_package()
    if nvtx is not None:
        return nvtx.annotate(name, domain="hpcllm")
    if torch.cuda.is_available():
        return torch.cuda.nvtx.range(name)
    return contextlib.nullcontext()


# The key of the marker line a resumed run appends to metrics.jsonl (its value: the step).
RESUMED = "resumed_from"


def _warn_stderr(message: str) -> None:
    print(f"hpcllm: warning: {message}", file=sys.stderr, flush=True)


class MetricsLog:
    """Appends one JSON object per logged step to metrics.jsonl, and mirrors it to TensorBoard.

    Both are append-only: a run never truncates or rewrites what an earlier run of its folder
    logged. A run that resumes from step N first appends a marker ``{"resumed_from": N, ...}``;
    the steps after N that an earlier process logged (it died after its last checkpoint) stay
    in the file, and :func:`read_metrics` lets the later lines win. TensorBoard gets a new
    events file whose ``purge_step`` (N + 1) makes the viewer hide the earlier file's steps
    after N, which the resumed run logs again.
    """

    def __init__(
        self,
        run_dir: Path,
        tensorboard: bool,
        start_step: int = 0,
        on_failure: str = "fail",
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.path = run_dir / "metrics.jsonl"
        # A write that fails (a full disk): "fail" ends the run in one line, "warn" says so
        # once and goes on without that output (run.save_failure).
        self.on_failure, self.warn = on_failure, warn or _warn_stderr
        self._file: Any = None
        self._tb: Any = None
        try:
            if not self.path.exists():
                # The file appears whole (empty) or not at all.
                atomic_write(self.path, "")
            torn = self.path.stat().st_size and not _ends_a_line(self.path)
            self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed in close()
            if torn:  # a process killed mid-line: end that line, so the next one stands alone
                self._file.write("\n")
        except OSError as err:
            self._failed(str(self.path), err)
        if start_step or (self._file is not None and self.path.stat().st_size):
            self._append({RESUMED: start_step, "time": time.time()})
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: the viewer drops what earlier events files logged from this step on.
            purge = {"purge_step": start_step + 1} if start_step else {}
            self._tb = SummaryWriter(str(run_dir / "tensorboard"), **purge)

    def write(self, record: dict[str, Any]) -> None:
        """Record one step's metrics."""
        self._append(record)
        if self._tb is not None:
            try:
                for key, value in record.items():
                    if isinstance(value, int | float) and key != "step":
                        self._tb.add_scalar(key, value, record["step"])
                # An MoE model's experts' shares of each block's tokens, as histograms.
                for block, shares in record.get("moe_expert_load", {}).items():
                    self._tb.add_histogram(
                        f"moe_expert_load/block{block}", np.asarray(shares), record["step"]
                    )
            except OSError as err:  # TensorBoard's writer thread raises it at the next call
                self._failed("the TensorBoard events", err)
                self._tb = None

    def _append(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            try:
                self._file.write(json.dumps(record) + "\n")
            except OSError as err:
                self._failed(str(self.path), err)
                self._file = None

    def _failed(self, what: str, err: OSError) -> None:
        message = f"writing {what} failed: {err.strerror or err}"
        if self.on_failure != "warn":
            from hpcllm.user_error import UserError

            raise UserError(f"{message}; free space there, or set run.save_failure=warn")
        self.warn(f"{message}; the run goes on without it (run.save_failure: warn)")

    def close(self) -> None:
        """Flush and close both outputs (a failure to, as a failed write)."""
        for output in (self._file, self._tb):
            if output is None:
                continue
            try:
                output.close()
            except OSError as err:
                self._failed(str(self.path) if output is self._file else "TensorBoard", err)
        self._file = self._tb = None


def _ends_a_line(path: Path) -> bool:
    with path.open("rb") as file:
        file.seek(-1, os.SEEK_END)
        return file.read(1) == b"\n"


def read_metrics(
    run_dir: Path, warn: Callable[[str], None] | None = None, history: bool = False
) -> list[dict[str, Any]]:
    """Return the records of a run's metrics.jsonl, leaving out lines that are not records.

    The file is append-only (:class:`MetricsLog`): a resumed run appends a marker and logs the
    steps after its checkpoint again. By default the later lines win: at each marker
    ``{"resumed_from": N}`` the records of steps after N logged before it are dropped, so the
    result is the run as it now stands, one record per step in order. ``history`` returns
    every record and marker as written instead.

    A run killed while writing leaves a torn last line; it (and any other line that is not a
    JSON object) is dropped with a warning through ``warn`` (stderr if None).
    """
    path = Path(run_dir) / "metrics.jsonl"
    records: list[dict[str, Any]] = []
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            record = None
        if isinstance(record, dict):
            if RESUMED in record and not history:
                resumed = record[RESUMED]
                records = [r for r in records if r.get("step", resumed) <= resumed]
            else:
                records.append(record)
            continue
        message = f"{path}, line {number}: not a metrics record (torn by a crash?), dropped"
        if warn is None:
            print(f"hpcllm: warning: {message}", file=sys.stderr, flush=True)
        else:
            warn(message)
    return records


def plot_loss(run_dir: Path) -> Path:
    """Draw the run's training and validation loss to loss.png; return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    if train:
        ax.plot(*zip(*train, strict=True), label="train")
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(Path(run_dir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(run_dir) / "loss.png"
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def interval_line(
    record: dict[str, Any], total_steps: int, loss_scale: float | None, now: float
) -> str:
    """Return one logged step's record as an aligned, greppable line of text.

    ``record`` is a metrics.jsonl record; its ``loss_mean`` (the mean over the interval) is
    shown as the loss where present. ``loss_scale`` is fp16's (None: left out); ``now`` is
    the wall-clock time (``time.time()``) the line is stamped with.
    """
    import time

    width = len(str(total_steps))
    loss = record.get("loss_mean", record["loss"])
    mfu = f"{record['mfu']:6.1%}" if record.get("mfu") is not None else "   n/a"
    fields = [
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)),
        f"step {record['step']:>{width}}/{total_steps}",
        f"samples {record['consumed_samples']:>9}",
        f"loss {loss:8.4f}",
        f"lr {record['lr']:.3e}",
        f"grad_norm {record['grad_norm']:8.3f}",
        *([f"loss_scale {loss_scale:g}"] if loss_scale is not None else []),
        f"ms/step {record['step_time_s'] * 1e3:9.1f}",
        f"tokens/s {record['tokens_per_s']:9.0f}",
        f"TFLOP/s {record['tflops_per_gpu']:8.3f}",
        f"MFU {mfu}",
        f"mem MB {record['memory_mb']:8.0f}",
        f"skipped {record['skipped_steps']}",
    ]
    if record.get("moe_balance_loss") is not None:  # an MoE model's step (docs/moe.md)
        fields += [
            f"moe balance {record['moe_balance_loss']:6.3f}",
            f"z {record['moe_z_loss']:7.3f}",
            f"max load {record['moe_max_load']:5.2f}",
            f"dropped {record['moe_dropped']:6.2%}",
        ]
    if record.get("moe_all_to_all_s") is not None:  # ep > 1: this rank's token exchanges
        fields.append(f"a2a ms {record['moe_all_to_all_s'] * 1e3:7.1f}")
    if record.get("val_loss") is not None:  # a validated step (a blend's: each source's too)
        sources = {k[len("val_loss/") :]: v for k, v in record.items() if k.startswith("val_loss/")}
        fields.append(
            f"val_loss {record['val_loss']:8.4f}"
            + "".join(f" {name} {loss:.4f}" for name, loss in sources.items())
        )
    return " | ".join(fields)


class CaseProgress:
    """Shows on stderr which case of how many a benchmark runs, and for how long.

    On a terminal, a tqdm bar ``what: case i/N label |bar| elapsed, this case s``, redrawn
    every second: a case may run for minutes without a step to advance the bar. Elsewhere (a
    batch log, a pipe), one line per finished case and no carriage returns::

        hpcllm bench dp: case 3/12 ddp d=2 fp32 ... done in 14.2 s, 5230 tokens/s

    ``show`` False prints nothing: under MPI only rank 0 reports. Use it as a context manager
    (it closes the bar) and call :meth:`start` then :meth:`done` around each case.
    """

    def __init__(
        self, total: int, what: str, *, show: bool = True, stream: TextIO | None = None
    ) -> None:
        self.total, self.what, self.show = total, what, show
        self.stream = sys.stderr if stream is None else stream
        self.finished = 0
        self._label = ""
        self._started: float | None = None  # None between cases
        self._bar: Any = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __enter__(self) -> CaseProgress:
        if self.show and self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total,
                desc=self.what,
                file=self.stream,
                bar_format="{desc} |{bar:12}| {elapsed} elapsed{postfix}",
                dynamic_ncols=True,
            )
            self._ticker = threading.Thread(target=self._tick, name="case-progress", daemon=True)
            self._ticker.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._bar is None:
            return
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if error is None:
            self._bar.set_description_str(
                f"{self.what}: {self.finished}/{self.total} cases done", refresh=False
            )
            self._bar.set_postfix_str("")
        self._bar.close()

    def start(self, label: str) -> None:
        """Begin the next case, named ``label`` (e.g. ``ddp d=2 fp32``)."""
        self._label = label
        self._started = time.perf_counter()
        if self._bar is not None:
            self._bar.set_description_str(
                f"{self.what}: case {self.finished + 1}/{self.total} {label}", refresh=False
            )
            self._bar.set_postfix_str("this case 0 s")

    def done(self, result: str = "") -> None:
        """End the case begun last; ``result`` (e.g. ``5230 tokens/s``) ends its line."""
        if self._started is None:
            raise RuntimeError("CaseProgress.done() without start()")
        self.finished += 1
        seconds = time.perf_counter() - self._started
        self._started = None
        outcome = f"done in {seconds:.1f} s" + (f", {result}" if result else "")
        if self._bar is not None:
            self._bar.set_postfix_str(f"case {outcome}", refresh=False)
            self._bar.update(1)
        elif self.show:
            print(
                f"{self.what}: case {self.finished}/{self.total} {self._label} ... {outcome}",
                file=self.stream,
                flush=True,
            )

    def _tick(self) -> None:
        # tqdm redraws only when the bar advances; the case's time should move meanwhile.
        while not self._stop.wait(1.0):
            started = self._started
            if started is not None:
                self._bar.set_postfix_str(f"this case {time.perf_counter() - started:.0f} s")
