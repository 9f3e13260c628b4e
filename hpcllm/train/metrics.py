"""The metrics component: what a run tells its user, and when.

Rank 0 prints the banner (:meth:`Metrics.banner`) and one line per logged step
(:func:`hpcllm.observe.interval_line`) and writes metrics.jsonl and TensorBoard
(:class:`hpcllm.observe.MetricsLog`); every rank returns the run's summary, and takes part in the
per-rank gathers (compute and wait times, the busiest rank's memory) that a logged step's
record carries, and writes its last pipeline timeline. A step is logged every
``train.log_interval`` steps and at the last (:class:`~hpcllm.train.state.Cadence`), and also
when it validates or stops.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.amp import GradScaler

from hpcllm import kernels, observe, watchdog
from hpcllm.config import Config, batch_plan, moe_layers
from hpcllm.files import atomic_write
from hpcllm.flops import model_step_flops
from hpcllm.parallel.pipeline.schedule import Interval
from hpcllm.parallel.roles import role
from hpcllm.topology import Grid
from hpcllm.train import memory
from hpcllm.train.parallelize import ParallelModel
from hpcllm.train.state import Cadence, TrainState
from hpcllm.train.step import StepOutcome


def count_parameters(chunks: torch.nn.Module, grid: Grid) -> int:
    """Return the whole model's parameter count (padded vocabulary), summed over the grid.

    Tensor-parallel slices count t times, whole parameters once, and pipeline stages add up,
    leaving out the last stage's copy of the tied embedding. A collective over the stages.
    """
    count = sum(
        # A slice held by several tp ranks (a key/value head's replicas) counts once.
        role(p).whole_numel(p.numel(), grid.tp)
        for p in chunks.parameters()
        if not role(p).stage_copy
    )
    if grid.pp > 1:
        total = torch.tensor([count], dtype=torch.int64, device=grid.device)
        dist.all_reduce(total, group=grid.groups.pp)
        count = int(total.item())
    return count


def count_experts(chunks: torch.nn.Module, grid: Grid, k: int, experts: int) -> tuple[int, int]:
    """Return (the whole model's routed-expert parameters a token does not use, (E − k)/E of
    them; the bytes of expert weights the busiest rank holds). Collectives over the grid."""
    mine = [p for name, p in chunks.named_parameters() if ".mlp.experts." in name]
    skipped = sum(role(p).whole_numel(p.numel(), grid.tp) for p in mine) * (experts - k) // experts
    held = sum(p.numel() * p.element_size() for p in mine)
    counts = torch.tensor([skipped, held], dtype=torch.int64, device=grid.device)
    if grid.pp > 1:
        dist.all_reduce(counts[:1], group=grid.groups.pp)
    if grid.world_size > 1:
        dist.all_reduce(counts[1:], op=dist.ReduceOp.MAX)
    return int(counts[0].item()), int(counts[1].item())


class Metrics:
    """Banner, interval lines, per-rank gathers, metrics.jsonl, TensorBoard, timeline, summary.

    :meth:`open` starts a run's output, :meth:`add` takes every step, :meth:`log` a logged
    one, :meth:`close` ends the output; :meth:`summary` is what the run reports at its end.
    """

    def __init__(
        self,
        cfg: Config,
        grid: Grid,
        model: ParallelModel,
        scaler: GradScaler,
        global_batch: int,
        padded_vocab: int,
    ) -> None:
        self.cfg, self.grid, self.model, self.scaler = cfg, grid, model, scaler
        self.cadence = Cadence(cfg.train.log_interval)
        self.is_root = grid.rank == 0
        self.global_batch, self.padded_vocab = global_batch, padded_vocab
        m = cfg.model
        self.tokens_per_step = global_batch * m.seq_len
        self.flops_per_step = model_step_flops(m, global_batch, padded_vocab, m.recompute)
        self.model_flops_per_step = model_step_flops(m, global_batch, padded_vocab)
        self.peak = observe.peak_tflops(grid.device, cfg.train.precision, cfg.train.peak_tflops)
        self._log: observe.MetricsLog | None = None
        self._bar: Any = None
        self._start_counting(TrainState(), last_step=0)

    # -- cadence ---------------------------------------------------------------------------

    def should_log(self, step: int, last_step: int) -> bool:
        """Return whether the step that ends at ``step`` is logged by the cadence."""
        return self.cadence.due(step, last_step)

    def next_due(self, step: int, last_step: int) -> int:
        """Return the next step after ``step`` that is logged."""
        return self.cadence.next_due(step, last_step)

    # -- the run's start -------------------------------------------------------------------

    def memory_line(self) -> str:
        """Return the busiest rank's weights, gradients and optimizer state (a collective)."""
        mine = memory.memory_parts(self.model.engine, self.model.optimizer, self.grid.device)
        rows: list[Any] = [None] * self.grid.world_size
        with watchdog.waiting("memory report gather", axis="world"):
            dist.all_gather_object(rows, mine)
        largest = {k: max(r[k] for r in rows) for k in mine}
        return memory.describe(
            largest, self.grid.replicas.dp, self.cfg.parallel.distributed_optimizer
        )

    def _moe_line(self, parameters: int) -> list[str]:
        """Return the banner's MoE line (none for a dense model): the blocks, the parameters a
        token uses, and the experts' weights on the busiest rank (a collective)."""
        m = self.cfg.model
        blocks = moe_layers(m)
        if not blocks:
            return []
        skipped, held = count_experts(self.model.chunks, self.grid, m.moe_top_k, m.moe_experts)
        return [
            f"experts {m.moe_experts}, top {m.moe_top_k}, router {m.moe_router}, in "
            f"{len(blocks)} of {m.n_layer} blocks: {(parameters - skipped) / 1e6:.2f} M "
            f"parameters active per token (FLOPs and MFU count these); expert weights "
            f"{held / 2**20:.1f} MiB on the busiest rank"
        ]

    def banner(self, resume: str, vocab_size: int, data: str | list[str]) -> list[str]:
        """Return the run's start-up lines (every rank must call this: it gathers memory and
        counts parameters).

        Versions, launcher, grid, memory, engine, run folder and where it resumes from
        (``resume``), model, data (``data`` describes it, in a line or several: a blend's
        sources) and the path of the resolved config, each line prefixed ``hpcllm:`` for grep.
        """
        from hpcllm import __version__

        cfg, g, m, engine = self.cfg, self.grid, self.cfg.model, self.model.engine
        run_dir = Path(cfg.run.dir)
        memory_line = self.memory_line()
        parameters = count_parameters(self.model.chunks, g)
        lines = [
            f"hpcllm {__version__}, torch {torch.__version__}, launcher {g.launch.launcher}, "
            f"device {g.device.type}",
            f"grid t={g.tp} p={g.pp} d={g.dp} v={cfg.parallel.vpp}"
            + (f" ep={g.ep} (inside d; each expert on {g.dp // g.ep} of d)" if g.ep > 1 else "")
            + (f" cp={g.cp} (each sequence split over cp ranks)" if g.cp > 1 else "")
            + f", world size {g.world_size}",
            f"memory per rank (the largest): {memory_line}",
            f"data parallel {engine.name}: {engine.describe()}"
            if g.replicas.dp > 1
            else f"data parallel {engine.name}: d = 1, nothing to reduce",
            f"run folder {run_dir}, {resume}",
            f"model {parameters / 1e6:.2f} M parameters: n_layer {m.n_layer}, "
            f"n_head {m.n_head}, d_model {m.d_model}, seq_len {m.seq_len}, vocab "
            f"{vocab_size} (padded {self.padded_vocab})",
            *self._moe_line(parameters),
            *(
                [f"data {data}"]
                if isinstance(data, str)
                else [f"data {data[0]}", *(f"  {line}" for line in data[1:])]
            ),
            f"train {cfg.train.steps} steps, global batch {self.global_batch} "
            f"({self.tokens_per_step} tokens/step), precision {cfg.train.precision}, "
            f"log every {cfg.train.log_interval}",
            f"config {run_dir / 'config.yaml'}",
        ]
        return [f"hpcllm: {line}" for line in lines]

    def open(self, banner: list[str], state: TrainState, last_step: int, progress: bool) -> None:
        """Start the run's output at ``state``: the banner, metrics.jsonl, the progress bar.

        The bar shows only where ``progress`` is asked and stdout and stderr are terminals, so
        a batch job's log holds no carriage returns.
        """
        from tqdm import tqdm

        self._start_counting(state, last_step)
        if self.is_root:
            print("\n".join(banner), flush=True)
            run = self.cfg.run
            self._log = observe.MetricsLog(
                Path(run.dir), run.tensorboard, state.step, on_failure=run.save_failure
            )
        self._bar = tqdm(
            total=last_step,
            initial=state.step,
            disable=not (progress and self.is_root and sys.stdout.isatty() and sys.stderr.isatty()),
            desc="train",
            unit="step",
            dynamic_ncols=True,
            mininterval=2.0,
        )

    def _start_counting(self, state: TrainState, last_step: int) -> None:
        """Start a run's clock, sums and summary at ``state``."""
        self._started = self._ended = time.perf_counter()
        self._first_step, self._last_step = state.step, last_step
        # Summed on the device between logged steps: no step waits for the GPU to log it.
        self._loss_sum: Any = 0.0
        self._loss_steps = 0
        self._step_times: list[float] = []
        self._intervals = self._run_steps = 0
        self._run_time = 0.0
        self._summary: dict[str, Any] = {"start_step": state.step, "stopped_by": None}

    # -- every step, and the logged ones ---------------------------------------------------

    def add(self, outcome: StepOutcome, state: TrainState) -> None:
        """Count a turn of the loop that ended at ``state``: its loss and step time."""
        record = outcome.record
        self._loss_sum = self._loss_sum + record["loss"]
        self._loss_steps += 1
        # The first step of a process pays one-off costs; keep it out of the rates.
        if state.step > self._first_step + 1 or self._last_step - self._first_step == 1:
            self._step_times += [record["step_time_s"]] * outcome.steps

    def log(
        self,
        outcome: StepOutcome,
        state: TrainState,
        val_loss: float | None = None,
        val_by_source: dict[str, float] | None = None,
    ) -> None:
        """Log the step that ended at ``state``: metrics.jsonl, TensorBoard and a line (a
        collective: every rank gathers its times). A blend's validation logs each source's
        loss too, as ``val_loss/NAME``."""
        record = outcome.record
        for key in ("loss", "grad_norm"):  # device tensors unless waited for
            record[key] = float(record[key])
        record["skipped"] = bool(record["skipped"])
        if val_loss is not None:
            record["val_loss"] = self._summary["val_loss"] = val_loss
            for name, loss in (val_by_source or {}).items():
                record[f"val_loss/{name}"] = self._summary[f"val_loss/{name}"] = loss
        record["loss_mean"] = float(self._loss_sum) / self._loss_steps
        self._loss_sum, self._loss_steps = 0.0, 0
        self._summary["last_loss"] = record["loss"]
        self._intervals += 1
        if self._intervals > 1:
            self._run_steps += len(self._step_times)
            self._run_time += sum(self._step_times)
        self._complete(record, state, self._step_times or [record["step_time_s"]])
        self._step_times = []
        if self._log:
            self._log.write(record)
            scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
            line = observe.interval_line(record, self._last_step, scale, time.time())
            if self._bar.disable:
                print(line, flush=True)
            else:
                self._bar.write(line, file=sys.stdout)
        self._bar.set_postfix(
            loss=f"{record['loss_mean']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}"
        )
        keys = ("tokens_per_s", "tflops_per_gpu", "mfu", "step_time_s")
        self._summary.update({k: record[k] for k in keys})

    def log_diverged(self, outcome: StepOutcome, state: TrainState) -> None:
        """Log the step that ends a diverged run (a collective, as :meth:`log`)."""
        record = outcome.record
        self._complete(record, state, [record["step_time_s"]])
        if self._log:
            self._log.write(record)

    def advance(self, outcome: StepOutcome) -> None:
        """Move the progress bar past a turn of the loop."""
        self._bar.update(outcome.steps)

    def _complete(self, record: dict[str, Any], state: TrainState, step_times: list[float]) -> None:
        """Add the rates over ``step_times``, memory, counters and every rank's times."""
        record.update(self._per_rank(record))
        step_time = sum(step_times) / len(step_times)
        world = self.grid.world_size
        tflops = self.flops_per_step / step_time / world / 1e12
        model_tflops = self.model_flops_per_step / step_time / world / 1e12
        record.update(
            tokens_per_s=self.tokens_per_step / step_time,
            step_time_s=step_time,
            tflops_per_gpu=tflops,
            mfu=model_tflops / self.peak if self.peak else None,
            memory_mb=observe.memory_mb(self.grid.device),
            gpu_util=observe.gpu_utilisation(self.grid.device),
            skipped_steps=state.skipped_steps,
            consumed_samples=state.consumed_samples,
        )

    def _per_rank(self, record: dict[str, Any]) -> dict[str, Any]:
        """Return every rank's compute and wait times of this step, and the slowest rank.

        Synchronous updates wait for the slowest rank: it computes longest and waits least.
        An asynchronous segment's slowest rank is the slowest per gradient it sent.
        """
        device, model = self.grid.device, self.model
        mine = (
            record["compute_s"],
            record["comm_wait_s"],
            observe.gpu_utilisation(device),
            memory.memory_parts(model.engine, model.optimizer, device),
        )
        rows: list[Any] = [None] * self.grid.world_size
        with watchdog.waiting("metrics gather", axis="world"):
            dist.all_gather_object(rows, mine)
        compute = [r[0] for r in rows]
        # ps-async's workers compute as many gradients as their pace allows: the slowest is
        # the one slowest per gradient, not the one that computed most (tp = pp = 1 there, so
        # a dp rank is a world rank).
        sent = record.get("rank_gradients")
        pace = [c / max(n, 1) for c, n in zip(compute, sent, strict=True)] if sent else compute
        return {
            # The busiest rank's bytes of each part (what must fit), in MB.
            "memory_parts_mb": {k: max(r[3][k] for r in rows) / 1e6 for k in rows[0][3]},
            "rank_compute_s": compute,
            "rank_comm_wait_s": [r[1] for r in rows],
            "rank_busy_share": [c / record["step_time_s"] for c in compute],
            "rank_gpu_util": [r[2] for r in rows],
            "slowest_rank": max(range(len(pace)), key=pace.__getitem__),
            "dp_engine": model.engine.name,
        }

    # -- the run's end ---------------------------------------------------------------------

    def write_timeline(self, timeline: list[Interval], step: int) -> Path | None:
        """Write this rank's last recorded pipeline step to RUN_DIR/timeline/ (atomically).

        Runs of one stage write none: their timeline is a row of forwards and backwards.
        """
        g = self.grid
        if not timeline or g.pp == 1:
            return None
        path = Path(self.cfg.run.dir) / "timeline" / f"rank{g.rank:05d}.json"
        record = {
            "rank": g.rank,
            "pp_rank": g.pp_rank,
            "tp_rank": g.tp_rank,
            "dp_rank": g.dp_rank,
            "cp_rank": g.cp_rank,
            "step": step,
            "schedule": self.cfg.parallel.schedule,
            "pp": g.pp,
            "vpp": g.vpp,
            "microbatches": batch_plan(self.cfg.train, g.dp).accumulation,
            "intervals": [[i.kind.value, i.microbatch, i.chunk, i.start, i.end] for i in timeline],
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(record))
        return path

    def close(self) -> None:
        """End the run's output (the bar and metrics.jsonl) and its clock."""
        if self._bar is not None:
            self._bar.close()
        if self._log:
            self._log.close()
            self._log = None
        self._ended = time.perf_counter()

    def summary(self, state: TrainState, stopped_by: str | None) -> dict[str, Any]:
        """Return the run's summary (see :meth:`hpcllm.train.trainer.Trainer.run`); a
        collective (it counts parameters over the stages)."""
        summary = dict(self._summary)
        if stopped_by is not None:
            summary["stopped_by"] = stopped_by
        run_time = self._run_time
        summary.update(
            run_tokens_per_s=self.tokens_per_step * self._run_steps / run_time
            if run_time
            else None,
            wall_s=self._ended - self._started,
            step=state.step,
            skipped_steps=state.skipped_steps,
            parameters=count_parameters(self.model.chunks, self.grid),
            world_size=self.grid.world_size,
            global_batch=self.global_batch,
            run_dir=str(Path(self.cfg.run.dir)),
            # The ops that ran a Triton kernel (model.fused_kernels), on this rank.
            fused_kernels=sorted(
                op for op, impl in kernels.implementations_used().items() if impl == "triton"
            ),
        )
        return summary
