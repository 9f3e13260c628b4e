"""``parallel.dp_engine: local-sgd``: replicas that step alone and meet every H steps.

Each rank steps its own optimizer on its own gradient; every H steps
(``parallel.local_sgd_steps``) the parameters are averaged over the dp group, and with
``parallel.local_sgd_average_optimizer`` AdamW's moments too. ``parallel.local_sgd_engine``
chooses who averages: ``ddp`` (torch's ``model_averaging.utils.average_parameters``, what
PyTorch's post-local SGD averager runs each period: one flat all-reduce on the dp group) or
``horovod`` (one Horovod all-reduce). A checkpoint averages first, so it holds one model.
It runs at t = p = 1 only (``config.check`` refuses other layouts).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from hpcllm.config import ParallelConfig
from hpcllm.parallel.data.engine import Engine
from hpcllm.parallel.data.flat import flatten, unflatten_into
from hpcllm.parallel.data.horovod import start_horovod
from hpcllm.parallel.data.optimizer import MixedPrecisionOptimizer
from hpcllm.topology import Grid


class LocalSGDOptimizer(MixedPrecisionOptimizer):
    """This replica's own step; every H steps, the engine's average of the replicas. Without
    averaged moments each replica's state is its own (:attr:`state_per_replica`)."""

    def __init__(
        self,
        engine: LocalSGDEngine,
        inner: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        clip: float,
    ) -> None:
        super().__init__(inner, scaler, clip, engine.grid.groups, engine.parameters)
        self.engine = engine
        self.state_per_replica = not engine.with_optimizer

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        result = super().step()
        self.engine.done += 1
        if self.engine.done % self.engine.period == 0:
            self.engine.average()
        return result


class LocalSGDEngine(Engine):
    """``local-sgd``: see the module's docstring."""

    name = "local-sgd"

    def __init__(self, grid: Grid, parallel: ParallelConfig) -> None:
        super().__init__(grid)
        self.period = parallel.local_sgd_steps
        self.with_optimizer = parallel.local_sgd_average_optimizer
        self.how = parallel.local_sgd_engine
        self.done = 0  # steps completed (set by resume_at on a resumed run)
        self.averaged_at = 0
        if self.how == "horovod":
            self.hvd, self.settings = start_horovod(grid, parallel)

    def describe(self) -> str:
        what = "parameters and AdamW's moments" if self.with_optimizer else "parameters"
        by = (
            "Horovod all-reduce"
            if self.how == "horovod"
            else "torch's model averaging (post-local SGD's all-reduce)"
        )
        return (
            f"local SGD: each rank steps alone; {what} averaged every {self.period} steps by {by}"
        )

    def wrap(self, modules: Sequence[nn.Module]) -> list[nn.Module]:
        super().wrap(modules)
        self.from_first_replica(self.parameters)
        return list(modules)

    def build_optimizer(
        self,
        inner: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        clip: float,
        accumulation: int,
    ) -> MixedPrecisionOptimizer:
        self.optimizer = LocalSGDOptimizer(self, inner, scaler, clip)
        return self.optimizer

    def resume_at(self, step: int) -> None:
        self.done = self.averaged_at = step

    def broadcast_state(self) -> None:
        # A resumed run: every replica loaded the same (averaged) checkpoint.
        pass

    def before_save(self) -> None:
        self.average()

    def average(self) -> None:
        """Average the replicas now (every H steps, and before a checkpoint)."""
        if self.averaged_at == self.done:
            return
        self.averaged_at = self.done
        if self.grid.dp == 1:
            return
        started = time.perf_counter()
        tensors: list[torch.Tensor] = list(self.parameters)
        if self.with_optimizer and self.optimizer is not None:
            tensors += [
                value
                for state in self.optimizer.state.values()
                for key, value in sorted(state.items())
                if key != "step" and torch.is_tensor(value) and value.is_floating_point()
            ]
        if self.how == "horovod":
            with torch.no_grad():
                flat = flatten(tensors)
                self.hvd.allreduce_(flat, op=self.hvd.Average, name="local_sgd.average")
                unflatten_into(flat, [t.data for t in tensors])
        else:
            # What torch's PeriodicModelAverager does every period, called here directly:
            # it skips tensors without a gradient, and a save averages after zero_grad.
            from torch.distributed.algorithms.model_averaging.utils import average_parameters

            with torch.no_grad():
                average_parameters(iter(tensors), self.grid.groups.dp)
        self.comm_wait_s += time.perf_counter() - started
