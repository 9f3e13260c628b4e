"""The optimizer the trainer steps: ``step()`` unscales, clips, skips on inf/NaN and steps.

As Megatron-Core's optimizers do, :class:`MixedPrecisionOptimizer` wraps a torch optimizer
(AdamW) with the loss scaler, the clipping and the process groups the global norm spans;
``step()`` returns (grad norm, skipped) as 0-d device tensors. Each data-parallel engine
builds its own (:meth:`Engine.build_optimizer <hpcllm.parallel.data.engine.Engine.
build_optimizer>`), changing only what its algorithm changes: Horovod steps without a second
synchronisation, the parameter server steps on its root and broadcasts, local SGD averages
every H steps, the distributed optimizer steps this rank's shard and all-gathers.

The trainer sets the learning rate through :attr:`~MixedPrecisionOptimizer.param_groups` and
checkpoints :meth:`~MixedPrecisionOptimizer.state_dict`, both the wrapped optimizer's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hpcllm.parallel.data.finalize import clip_to_norm, global_grad_norm
from hpcllm.topology import ProcessGroups


class MixedPrecisionOptimizer:
    """A torch optimizer with loss scaling, clipping by the global norm and skipping.

    ``params`` hold the gradients ``inner`` steps with (by default, its parameters; the
    engines give the model's, in module order, the order the norm sums them in); the
    global norm spans ``groups.tp`` and ``groups.pp``. :attr:`holds_state`: whether this rank
    keeps optimizer state (a parameter-server worker does not); :attr:`state_per_replica`:
    whether every dp rank's state is its own, so that a checkpoint keeps each (local SGD
    without averaging the moments).
    """

    holds_state = True
    state_per_replica = False

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        clip: float,
        groups: ProcessGroups,
        params: Sequence[torch.Tensor] | None = None,
    ) -> None:
        self.inner = inner
        self.scaler = scaler
        self.clip = clip
        self.groups = groups
        self.params: list[torch.Tensor] = (
            list(params)
            if params is not None
            else [p for group in inner.param_groups for p in group["params"]]
        )

    # -- what the trainer and the checkpoints read -----------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups (the trainer sets their learning rate)."""
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state."""
        return self.inner.state

    def state_dict(self) -> dict[str, Any]:
        """Return the wrapped optimizer's state, as checkpoints hold it."""
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state :meth:`state_dict` returned into the wrapped optimizer."""
        self.inner.load_state_dict(state)

    def zero_grad(self) -> None:
        """Drop the gradients for the next step."""
        self.inner.zero_grad()

    def state_params(self) -> list[torch.Tensor]:
        """Return the parameters in the order :meth:`state_dict`'s plain state numbers them."""
        return [p for group in self.inner.param_groups for p in group["params"]]

    def main_grads(self) -> list[torch.Tensor]:
        """Return the gradients :meth:`step` steps with, as tensors it reads (with the
        distributed optimizer, this rank's part of the reduced gradient)."""
        return [p.grad for p in self.params if p.grad is not None]

    # -- the step ----------------------------------------------------------------------------

    def grad_norm(self) -> torch.Tensor:
        """Return the global norm of the gradients to step with (scaled, under fp16)."""
        return global_grad_norm(self.params, self.groups.tp, self.groups.pp, self.groups.ep)

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscale, clip, step and update the scaler; return (grad norm, step skipped).

        Both are 0-d device tensors. A step whose gradients are not finite on any tp or pp
        rank (the global norm is not) is skipped on all of them, in every precision, so a NaN
        never reaches the weights:

        - Under fp16 the overflow must also back off every rank's scale alike, as Megatron-LM
          does by all-reducing found-inf. The global norm spans those ranks, so it is computed
          first, on the scaled gradients (the scale is a power of two: dividing by it
          afterwards is exact). Where it is not finite but this rank's own gradients are, one
          of them is set to inf before ``unscale_``, so that the scaler finds the overflow
          itself and skips and backs off through its public interface. fp16 reads its
          overflow back on the host, as the scaler does.
        - Under bf16 and fp32 a fused AdamW (hpcllm's, on CUDA and CPU) takes the verdict on
          the device (its ``found_inf``, the argument GradScaler feeds it), so nothing is read
          back; another optimizer reads it on the host.
        """
        optimizer, scaler, parameters = self.inner, self.scaler, self.params
        enabled = scaler.is_enabled()
        scale = scaler.get_scale() if enabled else 1.0
        norm = self.grad_norm()
        if enabled:
            if not torch.isfinite(norm):
                grad = next((p.grad for p in parameters if p.grad is not None), None)
                if grad is not None:
                    grad[(0,) * grad.dim()] = float("inf")
            scaler.unscale_(optimizer)
            norm = norm / scale
            clip_to_norm(parameters, self.clip, norm)
            scaler.step(optimizer)
            scaler.update()
            return norm, torch.tensor(scaler.get_scale() < scale, device=norm.device)
        bad = ~torch.isfinite(norm)
        clip_to_norm(parameters, self.clip, norm)
        if all(group.get("fused") for group in optimizer.param_groups):
            optimizer.found_inf = bad.float()  # type: ignore[attr-defined]
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf  # type: ignore[attr-defined]
        elif not bool(bad):
            optimizer.step()
        # No host read of the norm: on a GPU the next step's kernels queue behind this one's.
        return norm, bad
