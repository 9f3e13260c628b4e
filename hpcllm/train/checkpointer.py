"""The checkpointer: a run's folder, its checkpoints, and when they are written.

It claims and locks the run folder before the model is built, so a run that is refused leaves
the folder as it was (:mod:`hpcllm.train.run_dir`); it finds the checkpoint to resume from
(the newest that verifies, re-cut with ``run.reshard`` when the layout changed); it loads the
model, optimizer, scaler and random states into the built run and gives back the
:class:`~hpcllm.train.state.TrainState`; it saves every ``train.save_interval`` steps and at
the end, synchronously on every rank (:func:`hpcllm.train.checkpoint.save`), and prunes and
verifies older checkpoints on a thread of rank 0, beside training.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import yaml
from torch import nn
from torch.amp import GradScaler

from hpcllm.config import Config
from hpcllm.datasets import synthetic
from hpcllm.datasets.shards import Manifest
from hpcllm.datasets.synthetic import check_run_data
from hpcllm.datasets.tokenizer import CONFIG_FILE
from hpcllm.errors import UserError
from hpcllm.files import sweep_partials
from hpcllm.model.stages import chunks_state_dict, load_chunks_state_dict
from hpcllm.parallel.data.engine import Engine
from hpcllm.parallel.data.optimizer import MixedPrecisionOptimizer
from hpcllm.topology import Grid
from hpcllm.train import checkpoint, reshard
from hpcllm.train import run_dir as run_folder
from hpcllm.train.optim import load_optimizer_state
from hpcllm.train.state import Cadence, TrainState

Warn = Callable[[str], None]

# What a checkpoint holds, as :meth:`Checkpointer.track` names it.
Tracked = tuple[nn.ModuleList, MixedPrecisionOptimizer, GradScaler, Engine]


class Checkpointer:
    """Owns the run folder (claim, lock, release) and the run's checkpoints (resume, save).

    Built before the model, so that a run the folder refuses costs nothing;
    :meth:`track` then names what a checkpoint holds.
    """

    def __init__(
        self, cfg: Config, grid: Grid, vocab_size: int, warn: Warn, manifest: Manifest
    ) -> None:
        self.cfg, self.grid, self.warn = cfg, grid, warn
        self.manifest = manifest
        self.run_dir = Path(cfg.run.dir)
        self.vocab_size = vocab_size
        self.cadence = Cadence(cfg.train.save_interval)
        # False skips every save (a benchmark of the loop that must not pay for checkpoints).
        self.enabled = True
        self._lock: run_folder.RunLock | None = None
        self._pruning: threading.Thread | None = None
        self._tracked: Tracked | None = None
        # The newest checkpoint that verifies (a damaged newer one is named and passed over),
        # and the saved layout when it differs from this run's (run.reshard re-cuts it).
        self.resume_from: Path | None = None
        self.reshard_from: reshard.Cut | None = None
        self._claim()

    def _claim(self) -> None:
        """Lock the run folder for this job and check it against this run; write nothing else
        (remove only what a killed job left unfinished there).

        ``run.resume: none`` over checkpoints refuses, or with ``run.overwrite`` moves the
        earlier run aside (:func:`hpcllm.train.run_dir.claim`); ``auto`` refuses a checkpoint
        of another model.
        """
        r = self.cfg.run
        self._lock = self.on_rank0(
            lambda: run_folder.claim(self.run_dir, r.resume, r.overwrite, self.warn)
        )
        try:
            self.on_rank0(self._remove_stale_partials)
            if r.resume != "auto":
                return
            self.resume_from = checkpoint.agreed_resumable(
                self.run_dir, self.grid, self.warn, r.allow_unverified
            )
            if self.resume_from is not None:
                checkpoint.check_same_model(self.resume_from, self.cfg, self.vocab_size)
                # The checkpoint's token ids mean what the run's tokenizer says (or it learnt
                # synthetic ids); a run imported without one takes the data's (write_run_dir
                # records it).
                self.on_rank0(
                    lambda: check_run_data(
                        self.run_dir, self.manifest, f"the run {self.run_dir} resumed here"
                    )
                )
                self.reshard_from = reshard.check_resumable(self.resume_from, self.cfg)
        except BaseException:
            self.release(failed=True)
            raise

    def _remove_stale_partials(self) -> None:
        """Remove what a killed job left unfinished in the run folder (rank 0, holding the
        run lock, so no other job of this folder writes): hidden ``.step_N.partial``
        checkpoint folders, and partial files of dead processes of this host."""
        root = self.run_dir / "checkpoints"
        for folder in sorted(root.glob(".step_*.partial")) if root.is_dir() else []:
            shutil.rmtree(folder, ignore_errors=True)
            self.warn(f"removed {folder}, a checkpoint an earlier job did not finish saving")
        for folder in (self.run_dir, root):
            sweep_partials(folder, self.warn)

    def on_rank0(self, work: Callable[[], Any]) -> Any:
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
            if self.grid.groups.world_comm is not None:
                error = self.grid.groups.world_comm.bcast(error, root=0)
            else:
                box = [error]
                dist.broadcast_object_list(box, src=0)
                error = box[0]
        if error is not None:
            raise UserError(error)
        return result

    def write_run_dir(self, manifest: Manifest) -> None:
        """Write the resolved config and the tokenizer (so generate and convert need not find
        the data), and drop an earlier run's timelines, which would mix with this one's.

        Called once set-up has succeeded: a rejected run leaves the folder as it was.
        """

        def write() -> None:
            with run_folder.fs_errors("write", self.run_dir / "config.yaml"):
                shutil.rmtree(self.run_dir / "timeline", ignore_errors=True)
                self.cfg.dump(self.run_dir / "config.yaml")
                tokenizer = self.run_dir / "tokenizer.json"
                record = self.run_dir / synthetic.RUN_RECORD
                # A resumed run's tokenizer is the one its weights learnt: never replaced
                # (_claim checked the data against it). A fresh run's data replaces what a
                # run without checkpoints left: a tokenizer, or the synthetic record.
                # A Hugging Face tokenizer's tokenizer_config.json (its BOS and EOS) goes along.
                config = self.run_dir / CONFIG_FILE
                if isinstance(manifest, synthetic.SyntheticManifest):
                    if self.resume_from is None:
                        tokenizer.unlink(missing_ok=True)
                        config.unlink(missing_ok=True)
                    synthetic.record_run(self.run_dir, manifest)
                elif self.resume_from is None or not tokenizer.is_file():
                    record.unlink(missing_ok=True)
                    shutil.copyfile(manifest.tokenizer_path, tokenizer)  # the umask's mode
                    if manifest.tokenizer_config_path is not None:
                        shutil.copyfile(manifest.tokenizer_config_path, config)
                    else:
                        config.unlink(missing_ok=True)

        self.on_rank0(write)

    def release(self, failed: bool = False) -> None:
        """Give the run folder up; a run that failed to start puts a moved-aside run back."""
        self.finish_pruning()
        if self._lock is not None:
            self._lock.release()
            if failed:
                self._lock.undo_move()
            self._lock = None

    def track(
        self,
        chunks: nn.ModuleList,
        optimizer: MixedPrecisionOptimizer,
        scaler: GradScaler,
        engine: Engine,
    ) -> None:
        """Name what a checkpoint holds: this rank's model chunks, optimizer, scaler, engine."""
        self._tracked = (chunks, optimizer, scaler, engine)

    def describe_resume(self, step: int) -> str:
        """Return where the run starts, for the banner."""
        if self.resume_from is None:
            return "starts fresh"
        text = f"resumes from step {step} ({self.resume_from})"
        if self.reshard_from is not None:
            text += f", re-cut from {self.reshard_from} (run.reshard)"
        return text

    def load(self, global_batch: int) -> TrainState:
        """Load the checkpoint to resume from into the tracked objects; return its state.

        A fresh state when there is none (or ``run.resume: none``).
        """
        folder = self.resume_from
        if self.cfg.run.resume != "auto" or folder is None:
            return TrainState()
        chunks, optimizer, scaler, _ = self._objects()
        g = self.grid
        if self.reshard_from is None:
            shard = checkpoint.load_shard(folder, g.tp_rank, g.pp_rank, g.tp, g.pp, g.dp_rank)
        else:
            shard = reshard.cut_shard(
                reshard.SavedState(folder), reshard.Cut.of(self.cfg), g.tp_rank, g.pp_rank
            )
        load_chunks_state_dict(chunks, g.pp, shard["model"])
        if shard.get("optimizer") is not None:
            load_optimizer_state(optimizer, shard["optimizer"])
        if shard.get("scaler"):
            scaler.load_state_dict(shard["scaler"])
        if shard.get("rng") is not None:
            checkpoint.set_rng_state(shard["rng"], g.device)
        return TrainState.from_meta(checkpoint.read_meta(folder), folder, global_batch)

    def should_save(self, step: int, last_step: int) -> bool:
        """Return whether a checkpoint is due once ``step`` steps are done."""
        return self.cadence.due(step, last_step)

    def next_due(self, step: int, last_step: int) -> int:
        """Return the next step after ``step`` that saves."""
        return self.cadence.next_due(step, last_step)

    def save(self, state: TrainState, global_batch: int, final: bool = False) -> Path | None:
        """Write a checkpoint of ``state`` (every rank must call this); return its folder.

        None when the save failed and ``run.save_failure: warn`` lets the run go on (the next
        interval tries again), or when saving is off (:attr:`enabled`). A ``final`` save (the
        last step, or a stop signal) has no next interval: its failure always ends the run.
        """
        if not self.enabled:
            return None
        chunks, optimizer, scaler, engine = self._objects()
        self.finish_pruning()  # one pruning at a time, and never of a folder being written
        short = self.on_rank0(self._space_short)  # every rank the same answer
        if short is not None:
            if final or self.cfg.run.save_failure == "fail":
                raise UserError(short)
            self.on_rank0(lambda: self.warn(short + "; the run goes on (run.save_failure: warn)"))
            return None
        engine.before_save()  # local SGD: one model in the checkpoint, not d
        shard = {
            "model": chunks_state_dict(chunks, self.grid.pp),
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(),
            "rng": checkpoint.rng_state(self.grid.device),
        }
        folder = checkpoint.save(
            self.run_dir,
            state.step,
            self.grid,
            shard,
            state.meta(global_batch, self.vocab_size),
            yaml.safe_dump(self.cfg.to_dict(), sort_keys=False),
            on_failure="fail" if final else self.cfg.run.save_failure,
            warn=self.warn,
            per_replica=optimizer.state_per_replica,
        )
        keep = self.cfg.run.keep_checkpoints
        if folder is not None and keep is not None and self.grid.rank == 0:
            # Verifying reads the whole checkpoint: rank 0 does it beside training, not in
            # the way of the next step's collectives.
            self._pruning = threading.Thread(
                target=checkpoint.prune, args=(folder, keep, self.warn), name="prune"
            )
            self._pruning.start()
        return folder

    def _space_short(self) -> str | None:
        """Return why the next checkpoint would not fit in the run folder's free space, or
        None (also before the first checkpoint, whose size is unknown: a failed write then
        says so itself). Older checkpoints are pruned only once the new one verifies, so
        ``keep_checkpoints: N`` needs room for one more beside the N kept."""
        folders = checkpoint.checkpoints(self.run_dir)  # newest first, whatever "latest" says
        if not folders:
            return None
        size = sum(f.stat().st_size for f in folders[0].rglob("*") if f.is_file())
        free = shutil.disk_usage(self.run_dir).free
        if free >= size:
            return None
        keep = self.cfg.run.keep_checkpoints
        kept = f"keep_checkpoints: {keep} keeps {keep} and" if keep else "every checkpoint is kept;"
        return (
            f"a checkpoint needs about {size / 1e9:.3g} GB and {self.run_dir} has "
            f"{free / 1e9:.3g} GB free ({kept} the next is written before any is pruned); "
            "free space, or lower run.keep_checkpoints"
        )

    def finish_pruning(self) -> None:
        """Wait for the pruning of older checkpoints that the last save started."""
        if self._pruning is not None:
            self._pruning.join()
            self._pruning = None

    def _objects(self) -> Tracked:
        if self._tracked is None:
            raise RuntimeError("Checkpointer.track names the model before a load or save")
        return self._tracked
