"""What a run has done so far, and the one rule for when a component acts.

:class:`TrainState` is the trainer's position: the step, the samples the data-parallel ranks
have consumed, and the steps skipped for a non-finite loss or gradient. A checkpoint's
meta.json holds it under the keys it always had (:meth:`TrainState.meta`), so checkpoints
written before the state was typed load alike.

:class:`Cadence` is the single rule every component that acts every N steps follows (logging,
saving, validation): at each multiple of N, and at the last step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcllm.errors import UserError


@dataclass
class TrainState:
    """The trainer's position in a run (what a checkpoint must restore besides tensors)."""

    step: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0

    def advance(self, steps: int, global_batch: int) -> None:
        """Count ``steps`` optimizer steps of ``global_batch`` samples each as done."""
        self.step += steps
        self.consumed_samples += steps * global_batch

    def meta(self, global_batch: int, vocab_size: int) -> dict[str, Any]:
        """Return the meta.json entries of this state (the checkpoint adds the grid's)."""
        return {
            "consumed_samples": self.consumed_samples,
            "skipped_steps": self.skipped_steps,
            "global_batch": global_batch,
            "vocab_size": vocab_size,
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any], folder: Path, global_batch: int) -> TrainState:
        """Return the state a checkpoint's meta.json holds, for a run of ``global_batch``.

        A checkpoint of another global batch is refused in one line: the data position
        (consumed samples) would not line up with this run's batches. Checkpoints older than
        a key read it as 0.
        """
        saved_batch = meta.get("global_batch")
        if saved_batch not in (None, global_batch):
            raise UserError(
                f"{folder} was trained with global batch {saved_batch}; this run has "
                f"{global_batch}, so the data position would not line up"
            )
        return cls(
            step=meta["step"],
            consumed_samples=meta.get("consumed_samples", 0),
            skipped_steps=meta.get("skipped_steps", 0),
        )


@dataclass(frozen=True)
class Cadence:
    """Every ``interval`` steps (0: never) and at the run's last step."""

    interval: int

    def due(self, step: int, last_step: int) -> bool:
        """Return whether the component acts once ``step`` steps are done."""
        return step == last_step or (self.interval > 0 and step % self.interval == 0)

    def next_due(self, step: int, last_step: int) -> int:
        """Return the first step after ``step`` at which the component acts (``last_step``
        once ``step`` has reached it)."""
        if self.interval <= 0:
            return last_step
        return min(last_step, (step // self.interval + 1) * self.interval)
