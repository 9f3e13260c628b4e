"""The validator: the mean validation loss every ``train.eval_interval`` steps and at the end.

Validation runs the forward-only schedule over ``train.eval_iters`` micro-batches of the val
split, the same batches every time, through the same pipeline runtime as training; the mean
is taken over every data-parallel rank.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from hpcllm import observe, watchdog
from hpcllm.config import Config
from hpcllm.datasets.blend import Blend, validation_readers
from hpcllm.datasets.reader import MicroBatchReader, validation_reader
from hpcllm.datasets.shards import Manifest
from hpcllm.parallel.pipeline.runtime import Runtime, forward_only
from hpcllm.topology import Grid
from hpcllm.train.parallelize import ParallelModel
from hpcllm.train.stage_work import MicroBatches, stage_loss_sum
from hpcllm.train.state import Cadence


class Validator:
    """Computes the validation loss on its cadence; never, when the data has no val split.

    A blend (``data.blend``) validates each source with a val split on its own, the same
    ``train.eval_iters`` micro-batches each time; its loss is their mean weighed by the
    sources' weights (renormalised over those with a val split), and :attr:`by_source` holds
    each source's.
    """

    def __init__(
        self, cfg: Config, grid: Grid, manifest: Manifest, blend: Blend | None = None
    ) -> None:
        self.cfg, self.grid = cfg, grid
        self.cadence = Cadence(cfg.train.eval_interval)
        # Each source's (weight, reader) by name; one unnamed source without a blend.
        self.readers: dict[str, tuple[float, MicroBatchReader]] = {}
        if blend is not None:
            self.readers = validation_readers(
                blend,
                seq_len=cfg.model.seq_len,
                micro_batch_size=cfg.train.micro_batch_size,
                dp_rank=grid.dp_rank,
                dp_size=grid.dp,
                seed=cfg.data.seed,
                warn=self._warn,
            )
            if not self.readers:
                self._warn(
                    "no source of data.blend has a validation split; val_loss is not computed"
                )
        else:
            reader = self._reader(manifest)
            if reader is not None:
                self.readers[""] = (1.0, reader)
        self.by_source: dict[str, float] = {}

    @property
    def reader(self) -> MicroBatchReader | None:
        """The validation reader (the first source's of a blend; None without a val split)."""
        return next(iter(self.readers.values()))[1] if self.readers else None

    def _warn(self, message: str) -> None:
        if self.grid.rank == 0:
            print(f"hpcllm: warning: {message}", file=sys.stderr, flush=True)

    def _reader(self, manifest: Manifest) -> MicroBatchReader | None:
        """Return the validation reader, None (with a warning) if the data has no val split."""
        if manifest.n_tokens("val") == 0:
            self._warn(
                "the data has no validation split; val_loss is not computed (prepare with "
                "--val-fraction > 0)"
            )
            return None
        # Built now so that a validation split too small for one global micro-batch stops the
        # run before training, not after it.
        return validation_reader(
            manifest,
            seq_len=self.cfg.model.seq_len,
            micro_batch_size=self.cfg.train.micro_batch_size,
            dp_rank=self.grid.dp_rank,
            dp_size=self.grid.dp,
            seed=self.cfg.data.seed,
        )

    def should_validate(self, step: int, last_step: int) -> bool:
        """Return whether validation is due once ``step`` steps are done."""
        return bool(self.readers) and self.cadence.due(step, last_step)

    def next_due(self, step: int, last_step: int) -> int:
        """Return the next step after ``step`` that validates (the last step without a split)."""
        return self.cadence.next_due(step, last_step) if self.readers else last_step

    @torch.no_grad()
    def validate(self, model: ParallelModel) -> float:
        """Return the mean validation loss over ``train.eval_iters`` micro-batches, all ranks
        (a blend's: its sources' weighed, each in :attr:`by_source`)."""
        if not self.readers:
            raise RuntimeError("the data has no validation split")
        losses = {name: self._loss(model, reader) for name, (_, reader) in self.readers.items()}
        if list(losses) == [""]:
            self.by_source = {}
            return losses[""]
        self.by_source = losses
        total = sum(weight for weight, _ in self.readers.values())
        return sum(w * losses[name] for name, (w, _) in self.readers.items()) / total

    def _loss(self, model: ParallelModel, reader: MicroBatchReader) -> float:
        """Return ``reader``'s mean loss over ``train.eval_iters`` micro-batches, all ranks."""
        train, device = self.cfg.train, self.grid.device
        model.chunks.eval()
        reader.consumed_samples = 0  # the same validation batches every time
        batches = iter(reader)
        iters = min(train.eval_iters, reader.steps_per_epoch)
        micro = MicroBatches(batches, iters, device)
        work = model.stage_work(micro, train.precision, device)
        actions = forward_only(
            self.cfg.parallel.pp, self.grid.pp_rank, iters, self.cfg.parallel.vpp
        )
        try:
            with observe.nvtx_range("evaluation"):
                Runtime(model.channel).run(actions, work)
        finally:
            batches.close()
        total = stage_loss_sum(work, model.pp_group, device) / iters
        replicas = self.grid.replicas  # the cp ranks of a sample hold parts of its loss
        if replicas.dp > 1:
            with watchdog.waiting("validation loss all-reduce", axis="dp"):
                dist.all_reduce(total, group=replicas.groups.dp)
            total /= replicas.dp
        return total.item()
