"""``parallel.dp_engine: ps``: one parameter server, what ``nn.DataParallel`` does.

After the last backward every rank sends its whole gradient, flattened, to the dp group's
first rank with one reduce; that root averages, unscales, clips and steps; then one broadcast
sends every parameter back. No overlap and one root link carrying everything: the bottleneck
Bai (2022) measured.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from hpcllm.parallel.data.engine import Engine
from hpcllm.parallel.data.flat import flatten, unflatten_into
from hpcllm.parallel.data.optimizer import MixedPrecisionOptimizer
from hpcllm.topology import Grid


class ParameterServerOptimizer(MixedPrecisionOptimizer):
    """The root steps on the averaged gradient; every rank then takes its weights and loss
    scale. Its :attr:`holds_state` is whether this rank is the root."""

    def __init__(
        self,
        engine: ParameterServerEngine,
        inner: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        clip: float,
    ) -> None:
        super().__init__(inner, scaler, clip, engine.grid.groups, engine.params)
        self.engine = engine
        self.holds_state = engine.is_root

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.engine
        if e.grid.dp == 1:
            return super().step()
        device = e.params[0].device  # nccl moves CUDA tensors only
        result = torch.zeros(3, device=device)  # grad norm, skipped, new loss scale
        scaler = self.scaler
        if e.is_root:
            norm, skipped = super().step()
            result = torch.stack(
                [
                    norm.to(device=device, dtype=torch.float32),
                    skipped.to(device=device, dtype=torch.float32),
                    torch.tensor(scaler.get_scale() if scaler.is_enabled() else 1.0, device=device),
                ]
            )
        started = time.perf_counter()
        with torch.no_grad():
            flat = flatten(e.params)
            dist.broadcast(flat, src=e.root, group=e.grid.groups.dp)
            dist.broadcast(result, src=e.root, group=e.grid.groups.dp)
            if not e.is_root:
                unflatten_into(flat, [p.data for p in e.params])
        e.comm_wait_s += time.perf_counter() - started
        if not e.is_root:
            # Only the root stepped; the others drop their (unreduced) gradients and take the
            # root's loss scale so the next backward scales alike.
            self.zero_grad()
            if scaler.is_enabled():
                scaler.update(new_scale=float(result[2]))
        return result[0], result[1] > 0


class ParameterServerEngine(Engine):
    """One parameter server (the dp group's first rank): reduce, step on the root, broadcast."""

    name = "ps"

    def __init__(self, grid: Grid) -> None:
        super().__init__(grid)
        self.root = grid.layout.dp_group(grid.rank)[0]
        self.is_root = grid.dp_rank == 0
        self.params: list[nn.Parameter] = []

    def describe(self) -> str:
        return f"one server (dp rank 0, world rank {self.root}): reduce, step, broadcast"

    def wrap(self, modules: Sequence[nn.Module]) -> list[nn.Module]:
        super().wrap(modules)
        self.params = self.parameters
        self.from_first_replica(self.params)  # every replica starts from the server's weights
        return list(modules)

    def build_optimizer(
        self,
        inner: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        clip: float,
        accumulation: int,
    ) -> MixedPrecisionOptimizer:
        self.optimizer = ParameterServerOptimizer(self, inner, scaler, clip)
        return self.optimizer

    def reduce_grads(self) -> None:
        if self.grid.dp == 1:
            return
        started = time.perf_counter()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.reduce(flat, dst=self.root, group=self.grid.groups.dp)
        if self.is_root:
            flat /= self.grid.dp
            for p, g in zip(self.params, grads, strict=True):
                if p.grad is None:
                    p.grad = g
            unflatten_into(flat, [p.grad for p in self.params])
        self.comm_wait_s += time.perf_counter() - started
