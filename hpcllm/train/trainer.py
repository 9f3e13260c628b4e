"""The training loop: the one place that wires grid, data, model, engine and components.

Set-up builds, in order: the grid, the checkpointer (which claims the run folder before
anything costly is built), this rank's model chunks wrapped by the data-parallel engine
(:func:`~hpcllm.train.parallelize.parallelize`), the state a checkpoint resumes, the reader,
the validator, the metrics and the step strategy (:mod:`hpcllm.train.step`: a synchronous
step, or ps-async's segment). :meth:`Trainer.run` is then a short loop: a step, then each
component on its own cadence (:class:`~hpcllm.train.state.Cadence`): the checkpointer saves,
the validator validates, the metrics log.

SIGTERM or SIGUSR1 finishes the step in flight, saves a checkpoint and ends the run cleanly
(``hpcllm train`` then exits 75, so that a batch script can requeue the job).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpcllm import kernels, observe, startup, topology, watchdog
from hpcllm.config import Config, batch_plan, padded_vocab
from hpcllm.datasets.blend import BLEND_PART, Blend, BlendedReader, BlendPosition, blend_lines
from hpcllm.datasets.reader import MicroBatchReader
from hpcllm.datasets.synthetic import load_data
from hpcllm.errors import UserError
from hpcllm.model.documents import DocumentMasks
from hpcllm.parallel.data.engine import Engine
from hpcllm.parallel.data.optimizer import MixedPrecisionOptimizer
from hpcllm.train.checkpointer import Checkpointer, Stateful
from hpcllm.train.divergence import DivergenceGuard
from hpcllm.train.metrics import Metrics
from hpcllm.train.parallelize import check_compile_mode, compiled_how, parallelize
from hpcllm.train.preflight import check_job, cpu_has_native_bf16, startup_warnings
from hpcllm.train.process import ProcessSettings
from hpcllm.train.profiler import ProfilerWindow
from hpcllm.train.step import GradHook, ScheduleRunner, choose_step
from hpcllm.train.validator import Validator

__all__ = ["GradHook", "Trainer"]


class Trainer:
    """Sets up a run from its config on this rank's grid position, then trains it.

    The trainer changes process-wide state (signal handlers, threads, kernels, TF32, random
    generators) through one :class:`ProcessSettings`. :meth:`run` hands the signal handlers
    back when it ends; :meth:`close`, or leaving a ``with Trainer(cfg) as trainer:`` block,
    hands back the rest.
    """

    checkpointer: Checkpointer

    def __init__(
        self,
        cfg: Config,
        grad_hooks: list[GradHook] | None = None,
        parts: Mapping[str, Stateful] | None = None,
    ) -> None:
        self.cfg = cfg
        self.grad_hooks = grad_hooks if grad_hooks is not None else []
        # Named parts a checkpoint holds beside the run's own (Checkpointer.track).
        self.parts = dict(parts or {})
        self.process = ProcessSettings()
        self._closed = False
        try:
            self._set_up()
        except BaseException:
            self.process.restore()
            if hasattr(self, "checkpointer"):  # a run folder claimed before the failure
                self.checkpointer.release(failed=True)
            raise

    def _set_up(self) -> None:
        cfg, parallel, train = self.cfg, self.cfg.parallel, self.cfg.train
        # A stop signal during set-up (minutes on a big model) is honoured at the first step.
        self._stop_signal: int | None = None
        self.process.handle_signals(self._on_signal, signal.SIGTERM, signal.SIGUSR1)
        self.grid = topology.init(
            tp=parallel.tp,
            pp=parallel.pp,
            dp=parallel.dp,
            vpp=parallel.vpp,
            ep=parallel.ep,
            cp=parallel.cp,
            # Until the first step is done the groups wait as long as start-up may take (it
            # compiles), so that a stall there is the start-up watcher's to name, first.
            timeout_s=watchdog.backstop_s(max(cfg.run.timeout_s, cfg.run.startup_timeout_s)),
        )
        self.device = self.grid.device
        if train.straggler_rank is not None and train.straggler_rank >= self.grid.world_size:
            raise UserError(
                f"train.straggler_rank {train.straggler_rank} is not a rank of this job "
                f"(world size {self.grid.world_size})"
            )
        # A blend's first source speaks for its tokenizer (every source has the same).
        self.blend = Blend(cfg.data.blend) if cfg.data.blend is not None else None
        self.manifest = (
            self.blend.manifest
            if self.blend is not None
            else load_data(cfg.data.synthetic, cfg.data.path, cfg.model.vocab_size, cfg.data.seed)
        )
        # Every check of the config against the job and its data before the run folder is
        # touched: the checks `hpcllm train --print-config` makes.
        vocab = self.vocab_size = check_job(cfg, self.grid.world_size, self.manifest, self.blend)
        self._set_process()
        self.batch = batch_plan(train, self.grid.dp)
        self.accumulation = self.batch.accumulation
        check_compile_mode(
            cfg.model.compile_mode,
            compiled_how(cfg, self.device, self.grid.world_size),
            self.device.type,
            self.accumulation,
        )
        if self.grid.rank == 0:
            for line in startup_warnings(
                cfg,
                world_size=self.grid.world_size,
                device_type=self.device.type,
                cpu_has_bf16=cpu_has_native_bf16(),
                # A blend's repeats are its banner's (each source's epochs).
                train_tokens=self.manifest.n_tokens("train") if self.blend is None else None,
                val_tokens=self.manifest.n_tokens("val") if self.blend is None else None,
            ):
                self._warn(line)
        self.run_dir = Path(cfg.run.dir)
        # The engines, checkpoints and the step see the d·cp ranks holding the same weights as
        # their data-parallel axis (the grid itself at cp = 1); the readers serve d.
        replicas = self.grid.replicas
        self.checkpointer = Checkpointer(cfg, replicas, vocab, self._warn, self.manifest)

        self.global_batch = self.batch.global_batch
        self.tokens_per_step = self.global_batch * cfg.model.seq_len
        self.parallelized = parallelize(
            cfg,
            replicas,
            vocab,
            self.accumulation,
            # Synthetic ids have no end-of-text token (the config refuses the masks there).
            None if self.manifest.synthetic else DocumentMasks.of(cfg.data, self.manifest.eos_id),
        )
        self.padded_vocab = padded_vocab(vocab, parallel.tp)
        self.scaler = self.optimizer.scaler
        self.checkpointer.track_run(
            self.model, self.optimizer, self.scaler, before_save=self.engine.before_save
        )
        for name, part in self.parts.items():
            self.checkpointer.track(name, part)
        position = None
        if self.blend is not None:
            # The blend's position is the checkpoint's `data_blend` part: the samples each
            # source has given, at the consumed samples of the state saved with it.
            position = BlendPosition(self.blend, lambda: self.state.consumed_samples)
            # A checkpoint without one (a run on one folder, an import) begins the blend.
            self.checkpointer.track(BLEND_PART, position, optional=True)
        self.state = self.checkpointer.load(self.global_batch)
        self.engine.resume_at(self.state.step)
        self.engine.broadcast_state()
        read = {
            "seq_len": cfg.model.seq_len,
            "micro_batch_size": train.micro_batch_size,
            "dp_rank": self.grid.dp_rank,
            "dp_size": self.grid.dp,
            "seed": cfg.data.seed,
            "consumed_samples": self.state.consumed_samples,
            "prefetch": cfg.data.prefetch,
        }
        self.reader: MicroBatchReader | BlendedReader = (
            position.reader_for(**read)
            if position is not None
            else MicroBatchReader(self.manifest, **read)
        )
        if position is not None and position.note is not None and self.grid.rank == 0:
            self._warn(position.note)
        self.validator = Validator(cfg, self.grid, self.manifest, self.blend)
        self.metrics = Metrics(
            cfg, self.grid, self.parallelized, self.scaler, self.global_batch, self.padded_vocab
        )
        self.profiler = ProfilerWindow(train.profile_steps, self.device)
        resumed = self.checkpointer.resume_from is not None
        self.guard = DivergenceGuard(
            train.max_bad_steps,
            self.scaler,
            self.device,
            train.precision,
            last_saved=self.state.step if resumed else None,
        )
        self.runner = ScheduleRunner(cfg, replicas, self.parallelized, self.accumulation)
        self.stepper = choose_step(self.runner, self.guard, self.global_batch, self.grad_hooks)
        self.checkpointer.write_run_dir(self.manifest)

    def _set_process(self) -> None:
        """Set what this process computes with: RNG keeping, threads, fused kernels, TF32."""
        cfg = self.cfg
        self.process.keep_rng_state(self.device)
        if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # Ranks sharing a node share its cores; torch would start a thread per core each.
            cores = len(os.sched_getaffinity(0))
            self.process.torch_threads(max(1, cores // self.grid.launch.local_size))
        # auto times Triton against eager torch per op and shape, on each rank alone; at
        # t > 1 replicated activations must be computed alike on every tp rank, so there
        # every op runs its Triton kernel, as with "on". Inside compiled graphs auto leaves
        # every op but the cross-entropy to inductor, alike on every rank.
        fused = kernels.resolve_fused(cfg.model.fused_kernels, self.device)
        auto = cfg.model.fused_kernels == "auto"
        choose = auto and cfg.parallel.tp == 1
        self.process.fused_kernels(fused, choose=choose, compiled_reference=auto)
        if self.device.type == "cuda":
            # fp32 matmuls on TF32 tensor cores, as Megatron-LM runs them; MFU's fp32 peak
            # assumes it.
            self.process.float32_matmul_precision("high")

    def close(self) -> None:
        """Give the process back its signal handlers, threads, kernels and random states.

        The trainer cannot train after this.
        """
        self.checkpointer.finish_pruning()
        self.process.restore()
        self.checkpointer.release()
        self._closed = True

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _warn(self, message: str) -> None:
        print(f"hpcllm: warning: {message}", file=sys.stderr, flush=True)

    # -- what the components and callers read ----------------------------------------------

    @property
    def model(self) -> torch.nn.ModuleList:
        """This rank's model chunks (one, the whole GPT, with one pipeline stage)."""
        return self.parallelized.chunks

    @property
    def engine(self) -> Engine:
        """The data-parallel engine."""
        return self.parallelized.engine

    @property
    def optimizer(self) -> MixedPrecisionOptimizer:
        """The optimizer of this rank's parameters (its step unscales, clips and skips)."""
        return self.parallelized.optimizer

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        return self.state.step

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite loss or gradient, as last read from the device."""
        return self.state.skipped_steps

    @property
    def val_reader(self) -> MicroBatchReader | None:
        """The validation split's reader (None without one)."""
        return self.validator.reader

    def banner(self) -> list[str]:
        """Return the run's start-up lines (every rank must call this: it gathers)."""
        where = (
            f"synthetic (random ids over {self.manifest.vocab_size}, seed {self.cfg.data.seed})"
            if self.manifest.synthetic
            else self.cfg.data.path
        )
        data: str | list[str]
        if self.blend is not None:
            assert isinstance(self.reader, BlendedReader)
            samples = self.cfg.train.steps * self.global_batch
            data = blend_lines(self.blend, samples, self.reader)
        else:
            reader = self.reader
            assert isinstance(reader, MicroBatchReader)
            data = (
                f"{where}: {self.manifest.n_tokens('train')} train tokens, "
                f"{reader.dataset.n_samples} samples"
            )
        documents = self.parallelized.documents
        if documents is not None:  # what the packed samples' end-of-text tokens do
            acts = ["attention and positions restart after each end-of-text token"] * bool(
                documents.reset_attention
            )
            acts += ["no loss where the input is end-of-text"] * bool(documents.mask_loss)
            line = f"documents: {'; '.join(acts)} (id {documents.eos_id})"
            data = [*([data] if isinstance(data, str) else data), line]
        resume = self.checkpointer.describe_resume(self.state.step)
        return self.metrics.banner(resume, self.vocab_size, data)

    # -- one step, and what the loop runs between steps ------------------------------------

    def train_step(
        self, batches: Iterator[Any], timed: bool = False, wait: bool = True
    ) -> dict[str, Any]:
        """Run one turn of the step strategy (one step; a segment of one under ps-async);
        return its metrics record (see :meth:`hpcllm.train.step.SynchronousStep.run`)."""
        self._check_open()
        until = self.state.step + 1
        return self.stepper.run(batches, self.state, until=until, timed=timed, wait=wait).record

    def next_sync_step(self) -> int:
        """Return the next step at which a component acts: a logged step, a save, a
        validation, a bound of ``train.profile_steps``, or the last step.

        An asynchronous segment runs up to it, so every rank meets there.
        """
        step, last = self.state.step, self.cfg.train.steps
        components = (self.metrics, self.checkpointer, self.validator, self.profiler)
        return min(component.next_due(step, last) for component in components)

    def evaluate(self) -> float:
        """Return the mean validation loss over ``train.eval_iters`` micro-batches, all ranks."""
        timer = self.parallelized.engine.all_to_all_timer
        # The MoE all-to-all's logged time is the training steps' (moe_all_to_all_s).
        with timer.paused() if timer is not None else contextlib.nullcontext():
            return self.validator.validate(self.parallelized)

    def save(self, final: bool = False) -> Path | None:
        """Write a checkpoint of the current step (every rank must call this).

        Return its folder, or None when the save failed and ``run.save_failure: warn`` lets
        the run go on (the next interval tries again). A ``final`` save (the last step, or a
        stop signal) has no next interval: its failure always ends the run with an error.
        A diverged run is never saved: the last good checkpoint stays the newest.
        """
        diverged = self.guard.check(self.state)
        if diverged:
            raise UserError(diverged)
        folder = self.checkpointer.save(self.state, self.global_batch, final)
        if folder is not None:
            self.guard.last_saved = self.state.step
        return folder

    def write_timeline(self) -> Path | None:
        """Write this rank's last recorded pipeline step to RUN_DIR/timeline/ (atomically)."""
        return self.metrics.write_timeline(self.runner.timeline, self.state.step)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Trainer is closed; build a new one to train again")

    def _on_signal(self, signum: int, _frame: Any) -> None:
        first = self._stop_signal is None
        self._stop_signal = signum
        if first and getattr(self, "grid", None) is not None and self.grid.rank == 0:
            # At once, and with os.write (safe inside a signal handler): the save may take
            # minutes, and whoever sent the signal must know it is coming.
            name = signal.Signals(signum).name
            line = f"hpcllm: {name}: finishing the step in flight, then saving and stopping\n"
            with contextlib.suppress(OSError):
                os.write(sys.stderr.fileno(), line.encode())

    def _warn_stop(self, step: int, saved: Path | None, seconds: float) -> None:
        where = f"saved {saved} in {seconds:.1f} s" if saved else "saving is off"
        print(
            f"hpcllm: stopping at step {step}: {where}; the same command resumes it",
            file=sys.stderr,
            flush=True,
        )

    def _stop_requested(self) -> bool:
        # Every rank must agree, or one would save while another waits in the next step. On
        # the host through MPI where the job has it: a device collective read back would make
        # every step wait for the GPU.
        mine = int(bool(self._stop_signal))
        if self.grid.world_size == 1:
            return bool(mine)
        with watchdog.waiting("stop-signal agreement", axis="world"):
            if self.grid.groups.world_comm is not None:
                return self.grid.groups.world_comm.allreduce(mine) > 0
            flag = torch.tensor([float(mine)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return bool(flag.item())

    # -- the run ---------------------------------------------------------------------------

    def run(self, progress: bool = True) -> dict[str, Any]:
        """Train to ``train.steps`` (or a stop signal); return the run's summary.

        Rank 0 prints :meth:`banner` first, then one line per logged step on stdout
        (:func:`hpcllm.observe.interval_line`). ``progress`` shows a tqdm bar, and only where
        stdout and stderr are terminals. The summary's ``run_tokens_per_s`` is the rate over
        every interval but the first (which pays compilation and warm-up), None with only
        one; ``wall_s`` is the loop's time.
        """
        self._check_open()
        state, metrics, last = self.state, self.metrics, self.cfg.train.steps
        metrics.open(self.banner(), state, last, progress)
        batches = iter(self.reader)
        dog: watchdog.Watchdog | None = None
        startup.phase("step 1")
        stopped_by: str | None = None
        # Phases that compute or write as well as wait may take up to twice their longest so
        # far on top of run.timeout_s before the watchdog calls them stuck.
        longest_step = longest_save = 0.0
        try:
            while state.step < last:
                self.profiler.before_step(state.step)
                logged = metrics.should_log(state.step + 1, last)
                started = time.monotonic()
                with (
                    observe.nvtx_range(f"step {state.step}"),
                    watchdog.waiting("train step", allow_s=2 * longest_step, step=state.step + 1),
                ):
                    outcome = self.stepper.run(
                        batches, state, until=self.next_sync_step(), timed=logged, wait=logged
                    )
                longest_step = max(longest_step, time.monotonic() - started)
                self.profiler.after_step(state.step)
                if dog is None:  # armed once the first step has compiled and autotuned
                    startup.done()  # the start-up watcher's part is over
                    timeout_s = self.cfg.run.timeout_s
                    topology.set_timeout(self.grid, watchdog.backstop_s(timeout_s))
                    dog = watchdog.start(timeout_s, self.grid.rank, self.run_dir)
                diverged = self.guard.check(state) if outcome.synced else None
                if diverged:  # log the step that ends the run (every rank: it gathers)
                    metrics.log_diverged(outcome, state)
                    raise UserError(diverged)
                metrics.add(outcome, state)
                # Save before validating: a stop signal or an error in validation must not
                # cost the step's checkpoint.
                stop = self._stop_requested()
                if stop or self.checkpointer.should_save(state.step, last):
                    started = time.monotonic()
                    with watchdog.waiting(
                        "checkpoint save", allow_s=2 * longest_save, step=state.step
                    ):
                        saved = self.save(final=stop or state.step == last)
                    longest_save = max(longest_save, time.monotonic() - started)
                    if stop and self.grid.rank == 0:
                        self._warn_stop(state.step, saved, time.monotonic() - started)
                val_loss = None
                if not stop and self.validator.should_validate(state.step, last):
                    with watchdog.at(phase="evaluation", step=state.step):
                        val_loss = self.evaluate()
                if metrics.should_log(state.step, last) or val_loss is not None or stop:
                    by_source = self.validator.by_source if val_loss is not None else None
                    metrics.log(outcome, state, val_loss, by_source)
                metrics.advance(outcome)
                if stop:
                    stopped_by = signal.Signals(self._stop_signal or signal.SIGTERM).name
                    break
        finally:
            if dog is not None:
                dog.stop()
            batches.close()
            self.write_timeline()
            self.checkpointer.finish_pruning()
            # The run's signal handlers end with it; the rest is the trainer's until close().
            self.process.restore("signals")
            metrics.close()
        return metrics.summary(state, stopped_by)
