"""The training loop: the one place that wires grid, data, model, engine and optimizer.

Every layout takes one path. :func:`~hpcllm.train.parallelize.parallelize` gives this rank's
model chunks (one, the whole GPT, with p = v = 1), wrapped by the data-parallel engine, and
its schedule; a step runs the schedule's forwards and backwards over ``accumulation``
micro-batches through the pipeline runtime (with one stage, plain gradient accumulation),
finishes the gradients and steps the optimizer (:mod:`hpcllm.train.grads`), then records
metrics. Evaluation runs the forward-only schedule the same way.
SIGTERM or SIGUSR1 finishes the step in flight, saves a checkpoint and ends the run cleanly
(``hpcllm train`` then exits 75, so that a batch script can requeue the job).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpcllm import kernels, observe, topology, watchdog
from hpcllm.config import Config, accumulation_steps, padded_vocab, parse_profile_steps
from hpcllm.datasets.reader import MicroBatchReader
from hpcllm.datasets.shards import load_manifest
from hpcllm.errors import UserError
from hpcllm.files import atomic_write
from hpcllm.flops import step_flops
from hpcllm.model.stages import chunks_state_dict, load_chunks_state_dict
from hpcllm.parallel.pipeline.runtime import Runtime, forward_only
from hpcllm.parallel.pipeline.schedule import Interval
from hpcllm.parallel.tensor.layers import is_split
from hpcllm.train import checkpoint, grads, memory, reshard
from hpcllm.train import run_dir as run_folder
from hpcllm.train.optim import (
    autocast,
    build_scaler,
    load_optimizer_state,
    lr_at,
    step_autocast_cache,
)
from hpcllm.train.parallelize import parallelize
from hpcllm.train.preflight import cpu_has_native_bf16, preflight, startup_warnings
from hpcllm.train.process import ProcessSettings
from hpcllm.train.stage_work import GPTStageWork, MicroBatches

# Called after the gradients are finished, before the optimizer step, with the step and this
# rank's model chunks (a ModuleList; one chunk, the whole GPT, with one pipeline stage).
GradHook = Callable[[int, torch.nn.Module], None]


class Trainer:
    """Sets up a run from its config on this rank's grid position, then trains it.

    The trainer changes process-wide state (signal handlers, threads, kernels, TF32, random
    generators) through one :class:`ProcessSettings`. :meth:`run` hands the signal handlers
    back when it ends; :meth:`close`, or leaving a ``with Trainer(cfg) as trainer:`` block,
    hands back the rest.
    """

    def __init__(self, cfg: Config, grad_hooks: list[GradHook] | None = None) -> None:
        self.cfg = cfg
        self.grad_hooks = grad_hooks or []
        self.process = ProcessSettings()
        self._closed = False
        self._lock: run_folder.RunLock | None = None
        self._pruning: threading.Thread | None = None
        try:
            self._set_up()
        except BaseException:
            self.process.restore()
            self._release_run_dir(failed=True)
            raise

    def _set_up(self) -> None:
        cfg, p, t = self.cfg, self.cfg.parallel, self.cfg.train
        # A stop signal during set-up (minutes on a big model) is honoured at the first step.
        self._stop_signal: int | None = None
        self.process.handle_signals(self._on_signal, signal.SIGTERM, signal.SIGUSR1)
        self.grid = topology.init(
            tp=p.tp, pp=p.pp, dp=p.dp, vpp=p.vpp, timeout_s=watchdog.backstop_s(cfg.run.timeout_s)
        )
        self.device = self.grid.device
        if t.straggler_rank is not None and t.straggler_rank >= self.grid.world_size:
            raise UserError(
                f"train.straggler_rank {t.straggler_rank} is not a rank of this job "
                f"(world size {self.grid.world_size})"
            )
        self.process.keep_rng_state(self.device)
        if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # Ranks sharing a node share its cores; torch would start a thread per core each.
            cores = len(os.sched_getaffinity(0))
            self.process.torch_threads(max(1, cores // self.grid.launch.local_size))
        self.manifest = load_manifest(cfg.data.path)
        vocab = self.vocab_size = cfg.model.vocab_size or self.manifest.vocab_size
        if vocab < self.manifest.vocab_size:
            raise UserError(
                f"model.vocab_size {vocab} is smaller than the data's tokenizer "
                f"({self.manifest.vocab_size})"
            )
        # auto times Triton against compiled torch per op and shape, on each rank alone; at
        # t > 1 replicated activations must be computed alike on every tp rank, so there
        # every op runs its Triton kernel, as with "on".
        fused = kernels.resolve_fused(cfg.model.fused_kernels, self.device)
        choose = cfg.model.fused_kernels == "auto" and cfg.parallel.tp == 1
        self.process.fused_kernels(fused, choose=choose)
        if self.device.type == "cuda":
            # fp32 matmuls on TF32 tensor cores, as Megatron-LM runs them; MFU's fp32 peak
            # assumes it.
            self.process.float32_matmul_precision("high")
        # Every check of the config against the job before the run folder is touched.
        preflight(cfg, self.grid.world_size)
        self.accumulation = accumulation_steps(t, self.grid.dp)
        if self.grid.rank == 0:
            for line in startup_warnings(
                cfg,
                world_size=self.grid.world_size,
                device_type=self.device.type,
                cpu_has_bf16=cpu_has_native_bf16(),
                train_tokens=self.manifest.n_tokens("train"),
                val_tokens=self.manifest.n_tokens("val"),
            ):
                self._warn(line)
        self.run_dir = Path(cfg.run.dir)
        self._claim_run_dir(vocab)

        self.global_batch = t.micro_batch_size * self.accumulation * self.grid.dp
        self.tokens_per_step = self.global_batch * cfg.model.seq_len
        self.parallelized = parallelize(cfg, self.grid, vocab, self.accumulation)
        self.model = self.parallelized.chunks
        self.engine = self.parallelized.engine
        self.optimizer = self.parallelized.optimizer
        self.padded_vocab = padded_vocab(vocab, p.tp)
        self.timeline: list[Interval] = []
        self.scaler = build_scaler(t.precision, self.device)
        self.step = 0
        self.consumed_samples = 0
        self.skipped_steps = 0
        self._bad_pending = torch.zeros((), dtype=torch.int64, device=self.device)
        self._bad_streak = torch.zeros((), dtype=torch.int64, device=self.device)
        self._resume()
        self.engine.resume_at(self.step)
        self.engine.broadcast_state(self.optimizer)
        self.reader = MicroBatchReader(
            self.manifest,
            seq_len=cfg.model.seq_len,
            micro_batch_size=t.micro_batch_size,
            dp_rank=self.grid.dp_rank,
            dp_size=self.grid.dp,
            seed=cfg.data.seed,
            consumed_samples=self.consumed_samples,
            prefetch=cfg.data.prefetch,
        )
        self.val_reader = self._val_reader()
        self.flops_per_step = step_flops(
            self.global_batch,
            cfg.model.seq_len,
            cfg.model.n_layer,
            cfg.model.d_model,
            self.padded_vocab,
            cfg.model.recompute,
        )
        self.model_flops_per_step = step_flops(
            self.global_batch,
            cfg.model.seq_len,
            cfg.model.n_layer,
            cfg.model.d_model,
            self.padded_vocab,
            "none",
        )
        self.peak = observe.peak_tflops(self.device, t.precision, t.peak_tflops)
        self.profile = parse_profile_steps(t.profile_steps) if t.profile_steps else None
        self._write_run_dir()

    def close(self) -> None:
        """Give the process back its signal handlers, threads, kernels and random states.

        The trainer cannot train after this.
        """
        self._finish_pruning()
        self.process.restore()
        self._release_run_dir()
        self._closed = True

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _val_reader(self) -> MicroBatchReader | None:
        """Return the validation reader, None (with a warning) if the data has no val split."""
        if self.manifest.n_tokens("val") == 0:
            if self.grid.rank == 0:
                print(
                    "hpcllm: warning: the data has no validation split; val_loss is not "
                    "computed (prepare with --val-fraction > 0)",
                    file=sys.stderr,
                    flush=True,
                )
            return None
        # Built now so that a validation split too small for one global micro-batch stops the
        # run before training, not after it.
        return MicroBatchReader(
            self.manifest,
            split="val",
            seq_len=self.cfg.model.seq_len,
            micro_batch_size=self.cfg.train.micro_batch_size,
            dp_rank=self.grid.dp_rank,
            dp_size=self.grid.dp,
            seed=self.cfg.data.seed,
            prefetch=2,
        )

    def _on_rank0(self, work: Callable[[], Any]) -> Any:
        """Run ``work`` on rank 0; a UserError it raises is raised on every rank, alike."""
        result, error = None, None
        if self.grid.rank == 0:
            try:
                result = work()
            except UserError as err:
                error = str(err)
            except OSError as err:  # a file-system failure is one line too
                error = str(run_folder.fs_error("use", Path(err.filename or "?"), err))
        if self.grid.world_size > 1:
            if self.grid.world_comm is not None:
                error = self.grid.world_comm.bcast(error, root=0)
            else:
                box = [error]
                dist.broadcast_object_list(box, src=0)
                error = box[0]
        if error is not None:
            raise UserError(error)
        return result

    def _claim_run_dir(self, vocab: int) -> None:
        """Lock the run folder for this job and check it against this run; write nothing else.

        Everything the run writes there (config, tokenizer, metrics, checkpoints) comes after
        set-up has succeeded (:meth:`_write_run_dir`), so a rejected run leaves the folder as
        it was. ``run.resume: none`` over checkpoints refuses, or with ``run.overwrite`` moves
        the earlier run aside (:func:`hpcllm.train.run_dir.claim`); ``auto`` refuses a
        checkpoint of another model.
        """
        r = self.cfg.run

        def claim() -> run_folder.RunLock:
            return run_folder.claim(self.run_dir, r.resume, r.overwrite, self._warn)

        self._lock = self._on_rank0(claim)
        # The newest checkpoint that verifies; a damaged newer one is named and passed over.
        self._resume_from: Path | None = None
        self._reshard_from: reshard.Cut | None = None
        if r.resume == "auto":
            self._resume_from = checkpoint.agreed_resumable(self.run_dir, self.grid, self._warn)
            if self._resume_from is not None:
                checkpoint.check_same_model(self._resume_from, self.cfg, vocab)
                # The saved layout when it differs from this run's (run.reshard re-cuts it).
                self._reshard_from = reshard.check_resumable(self._resume_from, self.cfg)

    def _write_run_dir(self) -> None:
        """Write the resolved config and the tokenizer (so generate and convert need not find
        the data), and drop an earlier run's timelines, which would mix with this one's."""

        def write() -> None:
            with run_folder.fs_errors("write", self.run_dir / "config.yaml"):
                shutil.rmtree(self.run_dir / "timeline", ignore_errors=True)
                self.cfg.dump(self.run_dir / "config.yaml")
                shutil.copy(self.manifest.tokenizer_path, self.run_dir / "tokenizer.json")

        self._on_rank0(write)

    def _release_run_dir(self, failed: bool = False) -> None:
        """Give the run folder up; a run that failed to start puts a moved-aside run back."""
        if self._lock is not None:
            self._lock.release()
            if failed:
                self._lock.undo_move()
            self._lock = None

    def _warn(self, message: str) -> None:
        print(f"hpcllm: warning: {message}", file=sys.stderr, flush=True)

    # -- state ---------------------------------------------------------------------------

    def _resume(self) -> None:
        if self.cfg.run.resume != "auto":
            return
        folder = self._resume_from
        if folder is None:
            return
        if self._reshard_from is None:
            shard = checkpoint.load_shard(
                folder,
                self.grid.tp_rank,
                self.grid.pp_rank,
                self.grid.tp,
                self.grid.pp,
                self.grid.dp_rank,
            )
        else:
            shard = reshard.cut_shard(
                reshard.SavedState(folder),
                reshard.Cut.of(self.cfg),
                self.grid.tp_rank,
                self.grid.pp_rank,
            )
        load_chunks_state_dict(self.model, self.grid.pp, shard["model"])
        if shard.get("optimizer") is not None:
            load_optimizer_state(self.optimizer, shard["optimizer"])
        if shard.get("scaler"):
            self.scaler.load_state_dict(shard["scaler"])
        if shard.get("rng") is not None:
            checkpoint.set_rng_state(shard["rng"], self.device)
        meta = checkpoint.read_meta(folder)
        self.step = meta["step"]
        self.consumed_samples = meta.get("consumed_samples", 0)
        self.skipped_steps = meta.get("skipped_steps", 0)
        if meta.get("global_batch") not in (None, self.global_batch):
            raise UserError(
                f"{folder} was trained with global batch {meta['global_batch']}; "
                f"this run has {self.global_batch}, so the data position would "
                "not line up"
            )

    def save(self, final: bool = False) -> Path | None:
        """Write a checkpoint of the current step (every rank must call this).

        Return its folder, or None when the save failed and ``run.save_failure: warn`` lets
        the run go on (the next interval tries again). A ``final`` save (the last step, or a
        stop signal) has no next interval: its failure always ends the run with an error.
        """
        import yaml

        diverged = self._count_bad_steps()
        if diverged:  # never a checkpoint of a stalled run: the last good one stays newest
            raise UserError(diverged)
        self._finish_pruning()  # one pruning at a time, and never of a folder being written
        self.engine.before_save()  # local SGD: one model in the checkpoint, not d

        shard = {
            "model": chunks_state_dict(self.model, self.grid.pp),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": checkpoint.rng_state(self.device),
        }
        meta = {
            "consumed_samples": self.consumed_samples,
            "skipped_steps": self.skipped_steps,
            "global_batch": self.global_batch,
            "vocab_size": self.vocab_size,
        }
        folder = checkpoint.save(
            self.run_dir,
            self.step,
            self.grid,
            shard,
            meta,
            yaml.safe_dump(self.cfg.to_dict(), sort_keys=False),
            on_failure="fail" if final else self.cfg.run.save_failure,
            warn=self._warn,
            per_replica=self.engine.optimizer_per_replica,
        )
        keep = self.cfg.run.keep_checkpoints
        if folder is not None and keep is not None and self.grid.rank == 0:
            # Verifying reads the whole checkpoint: rank 0 does it beside training, not in
            # the way of the next step's collectives.
            self._pruning = threading.Thread(
                target=checkpoint.prune, args=(folder, keep, self._warn), name="prune"
            )
            self._pruning.start()
        return folder

    def _finish_pruning(self) -> None:
        """Wait for the pruning of older checkpoints that the last save started."""
        if self._pruning is not None:
            self._pruning.join()
            self._pruning = None

    # -- one step ------------------------------------------------------------------------

    def _set_lr(self) -> float:
        lr = lr_at(self.step, self.cfg.train, self.global_batch)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def train_step(
        self, batches: Iterator[Any], timed: bool = False, wait: bool = True
    ) -> dict[str, Any]:
        """Run one optimizer step over ``accumulation`` micro-batches; return its metrics.

        ``timed`` (on logged steps) waits for the GPU after each forward and backward, so that
        the per-rank compute time measures the device's work, not kernel launches. Without
        ``wait`` the step reads nothing back from the device (bf16 and fp32; fp16's skip check
        must): its loss and grad norm stay 0-d device tensors and its step time is the host's,
        so on a GPU the next step's kernels queue behind this one's. The loop waits on logged
        steps only; its mean step time over a logging interval is then still the device's.
        """
        if self._closed:
            raise RuntimeError("this Trainer is closed; build a new one to train again")
        t = self.cfg.train
        started = time.perf_counter()
        lr = self._set_lr()
        self.model.train()
        self.engine.reset_timers()
        loss_sum, data_time, compute_time = self._run_schedule(batches, timed)
        compute_time = self._straggle(compute_time)
        with (
            observe.nvtx_range("gradient communication"),
            watchdog.waiting("gradient communication", axis="dp"),
        ):
            grads.finish_gradients(
                self.model,
                self.engine,
                self.optimizer,
                self.parallelized.tp_group,
                self.parallelized.embedding_group,
            )
        if self.engine.waits_in_backward:
            compute_time -= self.engine.comm_wait_s
        for hook in self.grad_hooks:
            hook(self.step, self.model)
        with observe.nvtx_range("optimizer"), watchdog.waiting("optimizer step", axis="mp"):
            grad_norm, skipped = grads.step(
                self.engine,
                self.parallelized.parameters,
                self.optimizer,
                self.scaler,
                t.grad_clip,
                self.parallelized.tp_group,
                self.parallelized.pp_group,
            )
            self.optimizer.zero_grad()
        # Counted on the device; read on logged steps and before saving (_count_bad_steps).
        self._bad_pending += skipped
        bad = skipped
        if self.scaler.is_enabled():
            # fp16 skips while its scaler backs off from 2^16 are the scaler settling, not
            # divergence (fp16 reads its verdict on the host anyway): the streak counts
            # only skips once the scale is down to 1.
            bad = skipped & (self.scaler.get_scale() <= 1.0)
        self._bad_streak = (self._bad_streak + 1) * bad
        self.consumed_samples += self.global_batch
        self.step += 1
        loss_mean = loss_sum / self.accumulation
        if self.grid.dp > 1:
            with watchdog.waiting("loss all-reduce", axis="dp"):
                dist.all_reduce(loss_mean, group=self.grid.dp_group)
            loss_mean /= self.grid.dp
        if wait:
            # On a GPU the host meets a stalled collective here, where it reads the device.
            with watchdog.waiting("device results"):
                self._count_bad_steps()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
        step_time = time.perf_counter() - started
        return {
            "step": self.step,
            "loss": loss_mean.item() if wait else loss_mean,
            "lr": lr,
            "grad_norm": grad_norm.item() if wait else grad_norm,
            "step_time_s": step_time,
            "data_time_s": data_time,
            "compute_s": compute_time,
            "comm_wait_s": self.engine.comm_wait_s,
            "skipped": bool(skipped) if wait else skipped,
        }

    def _straggle(self, compute_time: float) -> float:
        """Return this rank's compute time, made ``train.straggler_factor`` times as long on
        ``train.straggler_rank``: as if its forward and backward took that long, before its
        gradients leave it (its peers wait for them, or for it)."""
        t = self.cfg.train
        if self.grid.rank == t.straggler_rank and t.straggler_factor > 1:
            with observe.nvtx_range("straggler sleep"):
                time.sleep((t.straggler_factor - 1) * compute_time)
            compute_time *= t.straggler_factor
        return compute_time

    def train_segment(self, batches: Iterator[Any], steps: int) -> dict[str, Any]:
        """Run ``steps`` steps under an engine that runs segments (ps-async); return the
        metrics of the segment's last step, its times the segment's means per step."""
        t = self.cfg.train
        started = time.perf_counter()
        self.model.train()
        params = self.parallelized.parameters

        def local_gradient() -> tuple[torch.Tensor, float, float]:
            for p in params:
                p.grad = None
            loss_sum, data_time, compute_time = self._run_schedule(batches, timed=False)
            return loss_sum / self.accumulation, data_time, self._straggle(compute_time)

        def server_step(masters: list[torch.nn.Parameter], opt: torch.optim.Optimizer) -> Any:
            return grads.optimizer_step(masters, opt, self.scaler, t.grad_clip)

        stats = self.engine.run_segment(  # type: ignore[attr-defined]
            self.step,
            steps,
            local_gradient,
            lambda step: lr_at(step, t, self.global_batch),
            server_step,
        )
        self.step += steps
        self.consumed_samples += steps * self.global_batch
        # A step with a skipped update counts as a skipped step; train.max_bad_steps counts
        # whole steps' worth of the server's updates skipped in a row (the segment's stats
        # carry both to every rank).
        self._bad_pending += stats.skipped_steps
        self._bad_streak.fill_(stats.bad_steps_in_a_row)
        return {
            "step": self.step,
            "loss": stats.loss,
            "lr": stats.lr,
            "grad_norm": stats.grad_norm,
            "step_time_s": (time.perf_counter() - started) / steps,
            "data_time_s": stats.data_s / steps,
            "compute_s": stats.compute_s / steps,
            "comm_wait_s": stats.wait_s / steps,
            "skipped": stats.skipped > 0,
            "steps": steps,
            **stats.metrics(),
        }

    def _segment_steps(self) -> int:
        """Return the steps from here to the next sync point: a logged step, a save, an
        evaluation, the start or end of ``train.profile_steps``, or the end."""
        t = self.cfg.train
        ends = [t.steps]
        every = [t.log_interval, t.save_interval]
        if self.val_reader is not None:
            every.append(t.eval_interval)
        ends += [(self.step // n + 1) * n for n in every if n]
        if self.profile:  # the profiler starts and stops between segments
            ends += [step for step in self.profile if step > self.step]
        return min(ends) - self.step

    def _count_bad_steps(self) -> str | None:
        """Add the skipped steps counted on the device to ``skipped_steps``.

        A step whose loss or gradient is not finite is skipped (:func:`grads.optimizer_step`),
        so the weights stay those of the last good step. Return why the run must stop when
        ``train.max_bad_steps`` of them came in a row, else None.
        """
        self.skipped_steps += int(self._bad_pending)
        self._bad_pending.zero_()
        streak, limit = int(self._bad_streak), self.cfg.train.max_bad_steps
        if streak < limit:
            return None
        return (
            f"training diverged: the last {streak} steps (to step {self.step}) had a "
            f"non-finite loss or gradient and were skipped (train.max_bad_steps is {limit}); "
            f"the weights are still those of step {self.step - streak}, and no checkpoint "
            "was written since. Resume with a lower train.lr, more train.warmup_steps or "
            "train.grad_clip, or bf16 instead of fp16"
        )

    def _run_schedule(
        self, batches: Iterator[Any], timed: bool
    ) -> tuple[torch.Tensor, float, float]:
        """Run the step's micro-batches through this rank's schedule.

        Returns the sum of the micro-batch losses (on every stage), the data time and this
        rank's compute time; keeps the step's intervals in ``self.timeline``. On a GPU,
        ``timed`` steps wait for each action's kernels, so their intervals time the device.
        """
        t, parallelized = self.cfg.train, self.parallelized
        micro = MicroBatches(batches, self.accumulation, self.device)
        # Only the last stage scales a loss; every stage's scaler must hold the scale, since
        # each unscales its own gradients and all of them update it together.
        self.scaler.scale(torch.zeros((), device=self.device))
        work = GPTStageWork(
            self.model,
            self.engine,
            micro,
            modules=parallelized.forward_modules,
            autocast=lambda: autocast(t.precision, self.device),
            scale=self.scaler.scale,
            split_backward=parallelized.split_backward,
        )
        if timed and parallelized.pp_group is not None:
            # Stages of a logged step start together, so that its recorded timelines share
            # one origin; other steps skip it (on NCCL a barrier waits for the device).
            with watchdog.waiting("pipeline start barrier", axis="pp"):
                dist.barrier(group=parallelized.pp_group)
        with (
            observe.nvtx_range(f"pipeline {parallelized.schedule}"),
            step_autocast_cache(t.precision, self.device),
        ):
            sync = torch.cuda.synchronize if timed and self.device.type == "cuda" else None
            self.timeline = Runtime(parallelized.channel).run(
                parallelized.actions,
                work,
                split_backward=parallelized.split_backward,
                synchronize=sync,
            )
        # Micro-batches are read inside the forwards that first need them.
        compute = sum(i.end - i.start for i in self.timeline if i.kind.is_compute)
        return self._stage_loss_sum(work), micro.data_time, compute - micro.data_time

    def _stage_loss_sum(self, work: GPTStageWork) -> torch.Tensor:
        """Return the sum of the losses of ``work``'s micro-batches, on every pipeline stage."""
        loss_sum = torch.zeros((), device=self.device)
        for loss in work.losses.values():
            loss_sum += loss.float()
        if self.parallelized.pp_group is not None:  # only the last stage has the losses
            with watchdog.waiting("loss all-reduce", axis="pp"):
                dist.all_reduce(loss_sum, group=self.parallelized.pp_group)
        return loss_sum

    def _model_parameters(self) -> int:
        """Return the whole model's parameter count (padded vocabulary), summed over the grid.

        Tensor-parallel slices count t times, whole parameters once, and pipeline stages add
        up, leaving out the last stage's copy of the tied embedding.
        """
        count = sum(
            p.numel() * (self.grid.tp if is_split(p) else 1)
            for p in self.model.parameters()
            if not getattr(p, "pipeline_duplicate", False)
        )
        if self.grid.pp > 1:
            total = torch.tensor([count], dtype=torch.int64, device=self.device)
            dist.all_reduce(total, group=self.grid.pp_group)
            count = int(total.item())
        return count

    def write_timeline(self) -> Path | None:
        """Write this rank's last recorded pipeline step to RUN_DIR/timeline/ (atomically).

        Runs of one stage write none: their timeline is a row of forwards and backwards.
        """
        if not self.timeline or self.grid.pp == 1:
            return None
        path = self.run_dir / "timeline" / f"rank{self.grid.rank:05d}.json"
        record = {
            "rank": self.grid.rank,
            "pp_rank": self.grid.pp_rank,
            "tp_rank": self.grid.tp_rank,
            "dp_rank": self.grid.dp_rank,
            "step": self.step,
            "schedule": self.cfg.parallel.schedule,
            "pp": self.grid.pp,
            "vpp": self.grid.vpp,
            "microbatches": self.accumulation,
            "intervals": [
                [i.kind.value, i.microbatch, i.chunk, i.start, i.end] for i in self.timeline
            ],
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(record))
        return path

    @torch.no_grad()
    def evaluate(self) -> float:
        """Return the mean validation loss over ``train.eval_iters`` micro-batches, all ranks."""
        t, p = self.cfg.train, self.cfg.parallel
        self.model.eval()
        reader = self.val_reader
        reader.consumed_samples = 0  # the same validation batches every time
        batches = iter(reader)
        iters = min(t.eval_iters, reader.steps_per_epoch)
        micro = MicroBatches(batches, iters, self.device)
        work = GPTStageWork(
            self.model,
            self.engine,
            micro,
            modules=self.parallelized.forward_modules,
            autocast=lambda: autocast(t.precision, self.device),
        )
        actions = forward_only(p.pp, self.grid.pp_rank, iters, p.vpp)
        try:
            with observe.nvtx_range("evaluation"):
                Runtime(self.parallelized.channel).run(actions, work)
        finally:
            batches.close()
        total = self._stage_loss_sum(work) / iters
        if self.grid.dp > 1:
            with watchdog.waiting("validation loss all-reduce", axis="dp"):
                dist.all_reduce(total, group=self.grid.dp_group)
            total /= self.grid.dp
        return total.item()

    # -- the run -------------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._stop_signal = signum

    def _stop_requested(self) -> bool:
        # Every rank must agree, or one would save while another waits in the next step. On
        # the host through MPI where the job has it: a device collective read back would make
        # every step wait for the GPU.
        mine = int(bool(self._stop_signal))
        if self.grid.world_size == 1:
            return bool(mine)
        with watchdog.waiting("stop-signal agreement", axis="world"):
            if self.grid.world_comm is not None:
                return self.grid.world_comm.allreduce(mine) > 0
            flag = torch.tensor([float(mine)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return bool(flag.item())

    def _per_rank(self, record: dict[str, Any]) -> dict[str, Any]:
        """Return every rank's compute and wait times of this step, and the slowest rank.

        Synchronous updates wait for the slowest rank: it computes longest and waits least.
        """
        mine = (
            record["compute_s"],
            record["comm_wait_s"],
            observe.gpu_utilisation(self.device),
            memory.memory_parts(self.engine, self.optimizer, self.device),
        )
        rows: list[Any] = [None] * self.grid.world_size
        with watchdog.waiting("metrics gather", axis="world"):
            dist.all_gather_object(rows, mine)
        compute = [r[0] for r in rows]
        return {
            # The busiest rank's bytes of each part (what must fit), in MB.
            "memory_parts_mb": {k: max(r[3][k] for r in rows) / 1e6 for k in rows[0][3]},
            "rank_compute_s": compute,
            "rank_comm_wait_s": [r[1] for r in rows],
            "rank_busy_share": [c / record["step_time_s"] for c in compute],
            "rank_gpu_util": [r[2] for r in rows],
            "slowest_rank": max(range(len(compute)), key=compute.__getitem__),
            "dp_engine": self.engine.name,
        }

    def _metrics(self, record: dict[str, Any], step_times: list[float]) -> dict[str, Any]:
        record.update(self._per_rank(record))
        step_time = sum(step_times) / len(step_times)
        tflops = self.flops_per_step / step_time / self.grid.world_size / 1e12
        model_tflops = self.model_flops_per_step / step_time / self.grid.world_size / 1e12
        record.update(
            tokens_per_s=self.tokens_per_step / step_time,
            step_time_s=step_time,
            tflops_per_gpu=tflops,
            mfu=model_tflops / self.peak if self.peak else None,
            memory_mb=observe.memory_mb(self.device),
            gpu_util=observe.gpu_utilisation(self.device),
            skipped_steps=self.skipped_steps,
            consumed_samples=self.consumed_samples,
        )
        return record

    def _memory_line(self) -> str:
        """Return the busiest rank's weights, gradients and optimizer state (a collective)."""
        mine = memory.memory_parts(self.engine, self.optimizer, self.device)
        rows: list[Any] = [None] * self.grid.world_size
        with watchdog.waiting("memory report gather", axis="world"):
            dist.all_gather_object(rows, mine)
        largest = {k: max(r[k] for r in rows) for k in mine}
        return memory.describe(largest, self.grid.dp, self.cfg.parallel.distributed_optimizer)

    def banner(self) -> list[str]:
        """Return the run's start-up lines (every rank must call this: it counts parameters).

        Versions, launcher, grid, run folder and where it resumes from, model, data and the
        path of the resolved config, each line prefixed ``hpcllm:`` for grep.
        """
        from hpcllm import __version__

        cfg, g, m = self.cfg, self.grid, self.cfg.model
        resume = (
            f"resumes from step {self.step} ({self._resume_from})"
            if self._resume_from is not None
            else "starts fresh"
        )
        if self._reshard_from is not None:
            resume += f", re-cut from {self._reshard_from} (run.reshard)"
        lines = [
            f"hpcllm {__version__}, torch {torch.__version__}, launcher {g.launch.launcher}, "
            f"device {self.device.type}",
            f"grid t={g.tp} p={g.pp} d={g.dp} v={cfg.parallel.vpp}, world size {g.world_size}",
            f"memory per rank (the largest): {self._memory_line()}",
            f"data parallel {self.engine.name}: {self.engine.describe()}"
            if g.dp > 1
            else f"data parallel {self.engine.name}: d = 1, nothing to reduce",
            f"run folder {self.run_dir}, {resume}",
            f"model {self._model_parameters() / 1e6:.2f} M parameters: n_layer {m.n_layer}, "
            f"n_head {m.n_head}, d_model {m.d_model}, seq_len {m.seq_len}, vocab "
            f"{self.vocab_size} (padded {self.padded_vocab})",
            f"data {cfg.data.path}: {self.manifest.n_tokens('train')} train tokens, "
            f"{self.reader.dataset.n_samples} samples",
            f"train {cfg.train.steps} steps, global batch {self.global_batch} "
            f"({self.tokens_per_step} tokens/step), precision {cfg.train.precision}, "
            f"log every {cfg.train.log_interval}",
            f"config {self.run_dir / 'config.yaml'}",
        ]
        return [f"hpcllm: {line}" for line in lines]

    def run(self, progress: bool = True) -> dict[str, Any]:
        """Train to ``train.steps`` (or a stop signal); return the run's summary.

        Rank 0 prints :meth:`banner` first, then one line per logged step on stdout
        (:func:`hpcllm.observe.interval_line`). ``progress`` shows a tqdm bar, and only where
        stdout and stderr are terminals, so a batch job's log holds no carriage returns. The
        summary's ``run_tokens_per_s`` is the rate over every interval but the first (which
        pays compilation and warm-up), None with only one; ``wall_s`` is the loop's time.
        """
        t = self.cfg.train
        is_root = self.grid.rank == 0
        banner = self.banner()
        if is_root:
            print("\n".join(banner), flush=True)
        started = time.perf_counter()
        log = (
            observe.MetricsLog(self.run_dir, self.cfg.run.tensorboard, self.step)
            if is_root
            else None
        )
        from tqdm import tqdm

        bar = tqdm(
            total=t.steps,
            initial=self.step,
            disable=not (progress and is_root and sys.stdout.isatty() and sys.stderr.isatty()),
            desc="train",
            unit="step",
            dynamic_ncols=True,
            mininterval=2.0,
        )
        batches = iter(self.reader)
        step_times: list[float] = []
        summary: dict[str, Any] = {"start_step": self.step, "stopped_by": None}
        first_step = self.step
        # Summed on the device between logged steps: no step waits for the GPU to log it.
        loss_sum: Any = 0.0
        loss_steps = 0
        intervals = run_steps = 0
        run_time = 0.0
        dog: watchdog.Watchdog | None = None
        # Phases that compute or write as well as wait may take up to twice their longest so
        # far on top of run.timeout_s before the watchdog calls them stuck.
        longest_step = longest_save = 0.0
        try:
            while self.step < t.steps:
                if self.profile and self.step == self.profile[0] and self.device.type == "cuda":
                    torch.cuda.profiler.start()
                logged = (self.step + 1) % t.log_interval == 0 or self.step + 1 == t.steps
                step_started = time.monotonic()
                with (
                    observe.nvtx_range(f"step {self.step}"),
                    watchdog.waiting("train step", allow_s=2 * longest_step, step=self.step + 1),
                ):
                    if self.engine.runs_segments:
                        record = self.train_segment(batches, self._segment_steps())
                    else:
                        record = self.train_step(batches, timed=logged, wait=logged)
                longest_step = max(longest_step, time.monotonic() - step_started)
                if self.profile and self.step == self.profile[1] and self.device.type == "cuda":
                    torch.cuda.profiler.stop()
                if dog is None:  # armed once the first step has compiled and autotuned
                    dog = watchdog.start(self.cfg.run.timeout_s, self.grid.rank, self.run_dir)
                counted = logged or self.engine.runs_segments  # a segment ends at a sync point
                diverged = self._count_bad_steps() if counted else None
                if diverged:  # log the step that ends the run (every rank: _metrics gathers)
                    record = self._metrics(record, [record["step_time_s"]])
                    if log:
                        log.write(record)
                    raise UserError(diverged)
                loss_sum = loss_sum + record["loss"]
                loss_steps += 1
                # The first step of a process pays one-off costs; keep it out of the rates.
                if self.step > first_step + 1 or t.steps - first_step == 1:
                    step_times += [record["step_time_s"]] * record.get("steps", 1)
                # Save before evaluating: a stop signal or an error in evaluation must not
                # cost the step's checkpoint.
                stop = self._stop_requested()
                if (
                    (t.save_interval and self.step % t.save_interval == 0)
                    or stop
                    or self.step == t.steps
                ):
                    save_started = time.monotonic()
                    last = stop or self.step == t.steps
                    with watchdog.waiting(
                        "checkpoint save", allow_s=2 * longest_save, step=self.step
                    ):
                        self.save(final=last)
                    longest_save = max(longest_save, time.monotonic() - save_started)
                evaluate = (
                    self.val_reader is not None
                    and not stop
                    and (
                        t.eval_interval and self.step % t.eval_interval == 0 or self.step == t.steps
                    )
                )
                if evaluate:
                    with watchdog.at(phase="evaluation", step=self.step):
                        record["val_loss"] = summary["val_loss"] = self.evaluate()
                if self.step % t.log_interval == 0 or self.step == t.steps or evaluate or stop:
                    for key in ("loss", "grad_norm"):  # device tensors unless waited for
                        record[key] = float(record[key])
                    record["skipped"] = bool(record["skipped"])
                    record["loss_mean"] = float(loss_sum) / loss_steps
                    loss_sum, loss_steps = 0.0, 0
                    summary["last_loss"] = record["loss"]
                    intervals += 1
                    if intervals > 1:
                        run_steps += len(step_times)
                        run_time += sum(step_times)
                    record = self._metrics(record, step_times or [record["step_time_s"]])
                    step_times = []
                    if log:
                        log.write(record)
                        scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
                        line = observe.interval_line(record, t.steps, scale, time.time())
                        if bar.disable:
                            print(line, flush=True)
                        else:
                            bar.write(line, file=sys.stdout)
                    bar.set_postfix(
                        loss=f"{record['loss_mean']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}"
                    )
                    summary.update(
                        {
                            k: record[k]
                            for k in ("tokens_per_s", "tflops_per_gpu", "mfu", "step_time_s")
                        }
                    )
                bar.update(record.get("steps", 1))
                if stop:
                    summary["stopped_by"] = signal.Signals(self._stop_signal or signal.SIGTERM).name
                    break
        finally:
            if dog is not None:
                dog.stop()
            bar.close()
            batches.close()
            self.write_timeline()
            self._finish_pruning()
            # The run's signal handlers end with it; the rest is the trainer's until close().
            self.process.restore("signals")
            if log:
                log.close()
        summary.update(
            run_tokens_per_s=self.tokens_per_step * run_steps / run_time if run_time else None,
            wall_s=time.perf_counter() - started,
            step=self.step,
            skipped_steps=self.skipped_steps,
            parameters=self._model_parameters(),
            world_size=self.grid.world_size,
            global_batch=self.global_batch,
            run_dir=str(self.run_dir),
        )
        return summary
