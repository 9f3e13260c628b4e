"""The divergence guard: counts skipped steps and stops a run that only skips.

A step whose loss or gradient is not finite is skipped (the optimizer's step,
:meth:`~hpcllm.parallel.data.optimizer.MixedPrecisionOptimizer.step`), so the weights stay
those of the last good step. The guard counts skips on the device, so that
no step waits for the GPU to be counted, and reads the count where the host meets the device
anyway (a logged step, a save, a segment's end). ``train.max_bad_steps`` skips in a row end
the run with one line that says what to change.
"""

from __future__ import annotations

import torch
from torch.amp import GradScaler

from hpcllm.train.state import TrainState


class DivergenceGuard:
    """Counts a run's skipped steps; says when ``max_bad_steps`` came in a row."""

    def __init__(
        self,
        max_bad_steps: int,
        scaler: GradScaler,
        device: torch.device,
        precision: str = "fp32",
        last_saved: int | None = None,
    ) -> None:
        self.max_bad_steps = max_bad_steps
        self.scaler = scaler
        self.precision = precision
        # The step of the newest checkpoint (the one resumed from, then each save's): what
        # the message tells the user to resume from.
        self.last_saved = last_saved
        self._pending = torch.zeros((), dtype=torch.int64, device=device)
        self._streak = torch.zeros((), dtype=torch.int64, device=device)

    def count_step(self, skipped: torch.Tensor) -> None:
        """Count one step, skipped or not (a 0-d device tensor: read later, not now)."""
        self._pending += skipped
        bad = skipped
        if self.scaler.is_enabled():
            # fp16 skips while its scaler backs off from 2^16 are the scaler settling, not
            # divergence (fp16 reads its verdict on the host anyway): the streak counts
            # only skips once the scale is down to 1.
            bad = skipped & (self.scaler.get_scale() <= 1.0)
        self._streak = (self._streak + 1) * bad

    def count_segment(self, skipped_steps: int, bad_steps_in_a_row: int) -> None:
        """Count a segment of asynchronous steps (its skipped steps and the streak it ends on)."""
        self._pending += skipped_steps
        self._streak.fill_(bad_steps_in_a_row)

    def check(self, state: TrainState) -> str | None:
        """Add the skips counted on the device to ``state``; return why the run must stop.

        None while fewer than ``max_bad_steps`` skipped steps came in a row.
        """
        state.skipped_steps += int(self._pending)
        self._pending.zero_()
        streak, limit = int(self._streak), self.max_bad_steps
        if streak < limit:
            return None
        good = state.step - streak
        if self.last_saved is None:
            saved = "no checkpoint was written"
        elif self.last_saved >= good:  # saved during the streak: the skips changed nothing
            saved = f"the checkpoint of step {self.last_saved} holds them"
        else:
            saved = f"the newest checkpoint is of step {self.last_saved}"
        fixes = "a lower train.lr, more train.warmup_steps or train.grad_clip"
        if self.precision == "fp16":  # bf16's range does not overflow where fp16's does
            fixes += ", or bf16 instead of fp16"
        return (
            f"training diverged: the last {streak} steps (to step {state.step}) had a "
            f"non-finite loss or gradient and were skipped (train.max_bad_steps is {limit}); "
            f"the weights are still those of step {good}, and {saved}. Resume with {fixes}"
        )
