"""The checkpointer: a run's folder, its checkpoints, and when they are written.

It claims and locks the run folder before the model is built, so a run that is refused leaves
the folder as it was (:mod:`hpcllm.train.run_dir`); it finds the checkpoint to resume from
(the newest that verifies, re-cut with ``run.reshard`` when the layout changed); it loads the
named parts of the built run and gives back the :class:`~hpcllm.train.state.TrainState`; it
saves every ``train.save_interval`` steps and at the end, synchronously on every rank
(:func:`hpcllm.train.checkpoint.save`), and prunes and verifies older checkpoints on a thread
of rank 0, beside training.

What a checkpoint holds is a set of named parts (:meth:`Checkpointer.track`), each any object
with ``state_dict`` and ``load_state_dict``: the trainer names ``model``, ``optimizer``,
``scaler`` and ``rng``; another component (a data blend's position, say) adds its own under a
new name, and each is saved, verified and loaded under it. A part is the same on every
data-parallel replica of a (tp, pp) shard (the model's weights and persistent buffers, the
optimizer, whose per-dp parts the format itself splits off, and anything replicated), but
for what differs by ep rank at ep > 1: a part with a ``by_ep(state)`` method (the model's and
the optimizer's) splits its routed experts off into the experts file of its ep rank, and
reads them back cut for the run's ep, whatever ep saved them.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
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
from hpcllm.files import atomic_write, sweep_partials
from hpcllm.model.stages import chunks_state_dict, load_chunks_state_dict
from hpcllm.parallel.data.experts import expert_indices, held_part, is_expert
from hpcllm.parallel.data.optimizer import MixedPrecisionOptimizer
from hpcllm.topology import Grid
from hpcllm.train import checkpoint, reshard
from hpcllm.train import run_dir as run_folder
from hpcllm.train.optim import load_optimizer_state
from hpcllm.train.state import Cadence, TrainState

Warn = Callable[[str], None]


class Stateful(Protocol):
    """What a named part of a checkpoint is: anything whose state a dict holds."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


@dataclass
class _Part:
    obj: Stateful
    optional: bool  # a checkpoint without it (written before it existed) leaves it as built


def _per_expert(value: Any) -> bool:
    """Whether an expert's optimizer entry holds ``value`` per expert (its moments, its fp32
    master), not once (the step)."""
    return torch.is_tensor(value) and value.dim() > 0


class ModelChunks:
    """This rank's model chunks as a named part: weights and persistent buffers, keyed as
    checkpoints hold them (:func:`hpcllm.model.stages.chunks_state_dict`). At ep > 1 its
    routed experts differ by ep rank: :meth:`by_ep` splits them off into the experts file."""

    def __init__(self, chunks: nn.ModuleList, pp: int, grid: Any = None) -> None:
        self.chunks, self.pp = chunks, pp
        ep = grid.ep if grid is not None else 1
        self.ep_rank = grid.ep_rank if grid is not None else 0
        named = chunks[0].named_parameters() if pp == 1 else chunks.named_parameters()
        self.experts = {name: p.shape[0] for name, p in named if is_expert(p)} if ep > 1 else {}

    def state_dict(self) -> dict[str, Any]:
        return chunks_state_dict(self.chunks, self.pp)

    def by_ep(self, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Return (the state without this rank's experts, its experts)."""
        own = {key: state[key] for key in self.experts}
        return {k: v for k, v in state.items() if k not in own}, own

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.experts:
            state = dict(state)
            for key, mine in self.experts.items():
                state[key] = held_part(state[key], mine, self.ep_rank)
        load_chunks_state_dict(self.chunks, self.pp, state)


class OptimizerState:
    """The optimizer as a named part; a checkpoint without its state (an imported model:
    None) leaves the fresh optimizer, and settings that are not state are not restored
    (:func:`hpcllm.train.optim.load_optimizer_state`). At ep > 1 the moments of the routed
    experts are split off into the experts file, as :class:`ModelChunks`' weights are."""

    def __init__(self, optimizer: MixedPrecisionOptimizer, grid: Any = None) -> None:
        self.optimizer = optimizer
        ep = grid.ep if grid is not None else 1
        params = optimizer.state_params()
        self.experts = {i: params[i].shape[0] for i in expert_indices(params)} if ep > 1 else {}
        self.ep_rank = grid.ep_rank if grid is not None else 0

    def state_dict(self) -> Any:
        return self.optimizer.state_dict()

    def by_ep(self, state: Any) -> tuple[Any, dict[str, Any]]:
        """Return (the state without this rank's experts' moments, their moments)."""
        shared: dict[int, Any] = {}
        own: dict[int, Any] = {}
        for i, entry in state["state"].items():
            if int(i) in self.experts:
                own[i] = {k: v for k, v in entry.items() if _per_expert(v)}
                entry = {k: v for k, v in entry.items() if not _per_expert(v)}
            shared[i] = entry
        return {**state, "state": shared}, {"state": own}

    def load_state_dict(self, state: Any) -> None:
        if state is not None:
            if self.experts:
                state = self._own(state)
            load_optimizer_state(self.optimizer, state)

    def _own(self, state: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for i, entry in state["state"].items():
            mine = self.experts.get(int(i))
            if mine is not None:
                entry = {
                    k: held_part(v, mine, self.ep_rank) if _per_expert(v) else v
                    for k, v in entry.items()
                }
            out[i] = entry
        return {**state, "state": out}

    @property
    def per_replica(self) -> bool:
        """Whether each dp replica steps (and saves) its own state (local SGD)."""
        return self.optimizer.state_per_replica


class ScalerState:
    """The loss scaler as a named part (an fp32 or bf16 run's disabled scaler saves {})."""

    def __init__(self, scaler: GradScaler) -> None:
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.scaler.load_state_dict(state)


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
        self._parts: dict[str, _Part] = {}
        self._before_save: list[Callable[[], None]] = []
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
            # Each file atomically, and a failure names the file that did not fit.
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
                with run_folder.fs_errors("write", self.run_dir / synthetic.RUN_RECORD):
                    synthetic.record_run(self.run_dir, manifest)
            elif self.resume_from is None or not tokenizer.is_file():
                record.unlink(missing_ok=True)
                copies = [(manifest.tokenizer_path, tokenizer)]
                if manifest.tokenizer_config_path is not None:
                    copies.append((manifest.tokenizer_config_path, config))
                else:
                    config.unlink(missing_ok=True)
                for source, target in copies:
                    with run_folder.fs_errors("write", target):
                        atomic_write(target, Path(source).read_bytes())  # the umask's mode

        self.on_rank0(write)

    def release(self, failed: bool = False) -> None:
        """Give the run folder up; a run that failed to start puts a moved-aside run back."""
        self.finish_pruning()
        if self._lock is not None:
            self._lock.release()
            if failed:
                self._lock.undo_move()
            self._lock = None

    def track(self, name: str, part: Stateful, *, optional: bool = False) -> None:
        """Name a part of what a checkpoint holds: saved under ``name``, loaded from it.

        ``optional``: a checkpoint without the part (one saved before it existed, or a re-cut
        that cannot place it) leaves the part as built instead of refusing to resume.
        """
        if name in self._parts:
            raise ValueError(f"the checkpoint already holds a part named {name!r}")
        self._parts[name] = _Part(part, optional)

    def before_save(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` on every rank before each save (local SGD: one model, not d)."""
        self._before_save.append(hook)

    def track_run(
        self,
        chunks: nn.ModuleList,
        optimizer: MixedPrecisionOptimizer,
        scaler: GradScaler,
        before_save: Callable[[], None],
    ) -> None:
        """Name the parts every run has: its model chunks, optimizer, scaler, random states."""
        self.track("model", ModelChunks(chunks, self.grid.pp, self.grid))
        # None: an import.
        self.track("optimizer", OptimizerState(optimizer, self.grid), optional=True)
        self.track("scaler", ScalerState(scaler), optional=True)
        # A re-cut rank whose saved stage started elsewhere keeps its fresh streams.
        self.track("rng", checkpoint.RandomStates(self.grid.device), optional=True)
        self.before_save(before_save)

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
        self._check_tracked()
        g = self.grid
        if self.reshard_from is None:
            shard = checkpoint.load_shard(
                folder, g.tp_rank, g.pp_rank, g.tp, g.pp, g.dp_rank, ep=g.ep, ep_rank=g.ep_rank
            )
        else:
            shard = reshard.cut_shard(
                reshard.SavedState(folder), reshard.Cut.of(self.cfg), g.tp_rank, g.pp_rank
            )
        for name, part in self._parts.items():
            if name in shard:
                part.obj.load_state_dict(shard[name])
            elif not part.optional:
                raise UserError(
                    f"checkpoint {folder} holds no {name!r} (its parts: "
                    f"{', '.join(shard) or 'none'}); it was saved by a run without it",
                    same_on_all_ranks=False,
                )
        unknown = sorted(set(shard) - set(self._parts))
        if unknown and g.rank == 0:
            self.warn(f"{folder} holds parts this run does not use, left unread: {unknown}")
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
        self._check_tracked()
        self.finish_pruning()  # one pruning at a time, and never of a folder being written
        short = self.on_rank0(self._space_short)  # every rank the same answer
        if short is not None:
            if final or self.cfg.run.save_failure == "fail":
                raise UserError(short)
            self.on_rank0(lambda: self.warn(short + "; the run goes on (run.save_failure: warn)"))
            return None
        for hook in self._before_save:
            hook()
        shard, by_ep = {}, {}
        for name, part in self._parts.items():
            shard[name] = part.obj.state_dict()
            split = getattr(part.obj, "by_ep", None)
            if self.grid.ep > 1 and split is not None:
                shard[name], by_ep[name] = split(shard[name])
        meta = state.meta(global_batch, self.vocab_size)
        for name, part in self._parts.items():
            # A part may say something of itself in meta.json, for `hpcllm inspect` to read
            # without loading the shards (a blend: how many samples each source gave).
            describe = getattr(part.obj, "meta", None)
            if describe is not None:
                meta[name] = describe()
        folder = checkpoint.save(
            self.run_dir,
            state.step,
            self.grid,
            shard,
            meta,
            yaml.safe_dump(self.cfg.to_dict(), sort_keys=False),
            on_failure="fail" if final else self.cfg.run.save_failure,
            warn=self.warn,
            per_replica=self._per_replica(),
            by_ep=by_ep,
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

    def _per_replica(self) -> bool:
        """Whether each dp replica saves its own optimizer state (local SGD's replicas)."""
        part = self._parts.get("optimizer")
        return part is not None and bool(getattr(part.obj, "per_replica", False))

    def _check_tracked(self) -> None:
        if "model" not in self._parts:
            raise RuntimeError("Checkpointer.track names the model before a load or save")
