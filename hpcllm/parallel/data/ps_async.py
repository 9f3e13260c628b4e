"""``parallel.dp_engine: ps-async``: a parameter server that waits for no barrier.

The parameter server without its barrier, after stale-synchronous parallel (Ho et al.,
NIPS 2013). The dp group's first rank is the server and a worker at once, as in
``ps``. A worker computes one gradient (its ``accumulation`` micro-batches) on the weights it
holds, sends it with the version of those weights, and waits only for the server's answer to
that gradient; the server applies each gradient as it arrives, scaled by 1/d (one *update*,
which advances its version by one), and answers with its new version, and with fresh weights
when the worker's are more than ``parallel.max_staleness`` (K) versions old. No worker ever
waits for another. With K = 0 the server instead waits for all d gradients of a version and
applies their mean, which is the ``ps`` engine's step exactly.

The server runs in a thread of the root rank, so that a worker's answer never waits for the
root's own forward and backward; the root's worker side hands its gradients to that thread
in memory, everybody else over MPI (the dp communicator; tags below). The server keeps its
own fp32 copy of the weights (the *masters*) and its own optimizer over them, so it may update
while the root's worker side computes on its copy.

Steps: a step is a global batch of samples, as in every engine: d updates at K ≥ 1 (each
1/d of the global batch), one at K = 0. The LR of an update is that of the step it falls in;
``train.steps`` is reached when the server has applied ``train.steps × d`` (K ≥ 1) updates.
The trainer runs the steps between two of its sync points (a logged step, a save, an
evaluation, the end) as one *segment*: when the server has applied the segment's updates it
answers each worker's next gradient with "stop" (that gradient, computed while the quota
filled, is dropped and counted), then every worker takes the server's weights, and the
ranks meet for the loss, the metrics, the stop-signal agreement and the checkpoint.

It runs at t = p = 1 only (``config.check`` refuses other layouts).
"""

from __future__ import annotations

import inspect
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hpcllm import watchdog
from hpcllm.errors import UserError
from hpcllm.parallel.data.engine import Engine, SegmentWorker
from hpcllm.parallel.data.flat import flatten, unflatten_into
from hpcllm.parallel.data.optimizer import MixedPrecisionOptimizer
from hpcllm.topology import Grid

# MPI tags of the server protocol on the dp communicator.
TAG_GRAD, TAG_REPLY, TAG_WEIGHTS = 7101, 7102, 7103
# A gradient message is the flat fp32 gradient followed by this many fp32 values: the
# version its weights had and the worker's mean loss. fp32 holds versions exactly to 2^24.
TRAILER = 2
MAX_VERSION = 2**24


@dataclass
class SegmentStats:
    """What one segment did, the same on every rank (the server broadcasts it)."""

    loss: float = 0.0  # mean loss of the applied gradients
    lr: float = 0.0  # the last update's
    grad_norm: float = 0.0  # the last update's
    updates: int = 0
    dropped: int = 0  # gradients that arrived after the segment's quota
    skipped: int = 0  # updates whose gradient was not finite: the masters stayed as they were
    skipped_steps: int = 0  # steps (of updates_per_step updates) with a skipped update
    bad_steps_in_a_row: int = 0  # whole steps' worth of skipped updates in a row, at the end
    staleness_mean: float = 0.0  # versions between a gradient's weights and its update
    staleness_max: int = 0
    rank_gradients: list[int] = field(default_factory=list)  # gradients sent, by dp rank
    # This rank's own (not broadcast): seconds computing, reading data, waiting for answers.
    compute_s: float = 0.0
    data_s: float = 0.0
    wait_s: float = 0.0

    def metrics(self) -> dict[str, Any]:
        """Return the fields every rank shares, for ``metrics.jsonl``."""
        return {
            "updates": self.updates,
            "dropped_gradients": self.dropped,
            "skipped_updates": self.skipped,
            "staleness_mean": self.staleness_mean,
            "staleness_max": self.staleness_max,
            "rank_gradients": self.rank_gradients,
        }


class AsyncParameterServerEngine(Engine):
    """``ps-async``: see the module's docstring."""

    name = "ps-async"

    def __init__(self, grid: Grid, max_staleness: int, order: str = "arrival") -> None:
        super().__init__(grid)
        if grid.dp > 1 and grid.groups.dp_comm is None:
            raise UserError(
                "parallel.dp_engine: ps-async sends gradients over MPI; launch with mpirun "
                "or srun --mpi=pmix"
            )
        self.comm = grid.groups.dp_comm
        self.k = max_staleness
        self.order = order
        self.is_root = grid.dp_rank == 0
        self.root = grid.layout.dp_group(grid.rank)[0]
        self.updates_per_step = 1 if max_staleness == 0 else grid.dp
        self.params: list[nn.Parameter] = []
        self.version = 0  # of this rank's weights
        self.bad_streak = 0  # the server's updates skipped in a row, across segments

    def describe(self) -> str:
        where = f"server thread on dp rank 0 (world rank {self.root})"
        if self.k == 0:
            return (
                f"asynchronous parameter server at max_staleness 0, i.e. synchronous: {where} "
                f"waits for all {self.grid.dp} gradients of a version and applies their mean"
            )
        return (
            f"asynchronous parameter server, {where}: each gradient applied on arrival "
            f"(scaled 1/{self.grid.dp}, {self.grid.dp} updates a step), a worker more than "
            f"{self.k} versions behind pulls fresh weights; order {self.order}"
        )

    def master_bytes(self) -> int:
        return 4 * sum(p.numel() for p in self.params) if self.is_root else 0

    def wrap(self, modules: Sequence[nn.Module]) -> list[nn.Module]:
        super().wrap(modules)
        self.params = self.parameters
        if any(p.dtype != torch.float32 for p in self.params):
            raise UserError("parallel.dp_engine: ps-async keeps fp32 weights")
        self.from_first_replica(self.params)
        return list(modules)

    def build_optimizer(
        self,
        inner: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        clip: float,
        accumulation: int,
    ) -> MixedPrecisionOptimizer:
        if not self.is_root:
            # A worker never steps: its optimizer holds no state.
            self.optimizer = MixedPrecisionOptimizer(
                inner, scaler, clip, self.grid.groups, self.params
            )
            self.optimizer.holds_state = False
            return self.optimizer
        # The server's weights: one flat fp32 buffer (sent as it is), its parameters views of
        # it, their gradients views of another; an optimizer of the same kind and groups.
        n = sum(p.numel() for p in self.params)
        self.flat_master = torch.empty(n, dtype=torch.float32, device=self.params[0].device)
        self.flat_grad = torch.zeros_like(self.flat_master)
        masters, offset = {}, 0
        for p in self.params:
            size = p.numel()
            master = nn.Parameter(self.flat_master[offset : offset + size].view_as(p))
            master.grad = self.flat_grad[offset : offset + size].view_as(p)
            masters[id(p)] = master
            offset += size
        self.masters = [masters[id(p)] for p in self.params]
        groups = [
            {**g, "params": [masters[id(p)] for p in g["params"]]} for g in inner.param_groups
        ]
        accepted = inspect.signature(type(inner)).parameters
        defaults = {k: v for k, v in inner.defaults.items() if k in accepted}
        server = type(inner)(groups, **defaults)
        # The server's step over its masters: the one every engine's optimizer takes.
        self.optimizer = MixedPrecisionOptimizer(
            server, scaler, clip, self.grid.groups, self.masters
        )
        self._load_masters()
        return self.optimizer

    def _load_masters(self) -> None:
        with torch.no_grad():
            self.flat_master.copy_(flatten(self.params))

    def broadcast_state(self) -> None:
        # After a resume the root's model holds the server's weights: its masters take them,
        # and every worker starts from them.
        if self.is_root:
            self._load_masters()
        self.from_first_replica(self.params)

    # -- one segment -----------------------------------------------------------------------

    def run_segment(self, first_step: int, steps: int, worker: SegmentWorker) -> SegmentStats:
        """Train ``steps`` steps from ``first_step``; every rank calls it, every rank returns
        the same stats (its own times) and the server's weights.

        ``worker`` computes this rank's gradients and names each step's learning rate; the
        server steps with this engine's optimizer (:meth:`build_optimizer`)."""
        u = self.updates_per_step
        self.version = first_step * u
        if self.version + steps * u >= MAX_VERSION:
            raise UserError(f"ps-async counts at most {MAX_VERSION} updates in a run")
        mine = SegmentStats()
        server: _Server | None = None
        if self.is_root:
            server = _Server(self, first_step, steps * u, worker.lr)
            server.start()
        try:
            while True:
                loss, data_s, compute_s = worker.local_gradient()
                mine.data_s += data_s
                mine.compute_s += compute_s
                grad = torch.cat(
                    [
                        (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                        for p in self.params
                    ]
                    + [torch.tensor([float(self.version), float(loss)], device=loss.device)]
                )
                waited = time.perf_counter()
                with watchdog.waiting("ps-async: the server's answer", axis="dp", peer=self.root):
                    version, weights, stop = (
                        server.submit(grad) if server is not None else self._send(grad)
                    )
                if weights is not None:
                    with torch.no_grad():
                        unflatten_into(weights, [p.data for p in self.params])
                    self.version = version
                mine.wait_s += time.perf_counter() - waited
                if stop:
                    break
        finally:
            if server is not None:
                server.finish()
        with watchdog.waiting("ps-async: the segment's end", axis="dp"):
            shared = self._share_stats(server)
            if server is not None:
                with torch.no_grad():
                    unflatten_into(self.flat_master, [p.data for p in self.params])
            self.from_first_replica(self.params)
        self.version = (first_step + steps) * u
        for p in self.params:
            p.grad = None
        shared.compute_s, shared.data_s, shared.wait_s = mine.compute_s, mine.data_s, mine.wait_s
        return shared

    def _send(self, grad: torch.Tensor) -> tuple[int, torch.Tensor | None, bool]:
        """A worker's gradient to the server over MPI; return its answer."""
        import numpy as np

        self.comm.Send(grad.cpu().numpy(), dest=0, tag=TAG_GRAD)
        header = np.zeros(3, dtype=np.int64)
        self.comm.Recv(header, source=0, tag=TAG_REPLY)
        version, fresh, stop = (int(x) for x in header)
        weights = None
        if fresh:
            buf = np.empty(grad.numel() - TRAILER, dtype=np.float32)
            self.comm.Recv(buf, source=0, tag=TAG_WEIGHTS)
            weights = torch.from_numpy(buf).to(grad.device)
        return version, weights, bool(stop)

    def _share_stats(self, server: _Server | None) -> SegmentStats:
        stats = server.stats if server is not None else None
        if self.grid.dp > 1:
            stats = self.comm.bcast(stats, root=0)
        assert stats is not None
        return stats


class _Server:
    """The server side of ``ps-async``, a thread of the root rank for one segment."""

    def __init__(
        self,
        engine: AsyncParameterServerEngine,
        first_step: int,
        quota: int,
        lr_of_step: Callable[[int], float],
    ) -> None:
        self.e = engine
        self.d = engine.grid.dp
        self.first_version = first_step * engine.updates_per_step
        self.version = self.first_version
        self.quota = quota
        self.lr_of_step = lr_of_step
        self.local_in: queue.Queue[torch.Tensor] = queue.Queue()
        self.local_out: queue.Queue[Any] = queue.Queue()
        self.stats = SegmentStats(rank_gradients=[0] * self.d)
        self.last_skipped_step = -1
        self.losses: list[float] = []
        self.staleness: list[int] = []
        self.error: BaseException | None = None
        self.running = set(range(self.d))  # workers not yet told to stop (K >= 1)
        self.thread = threading.Thread(target=self._serve, name="ps-async server", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, grad: torch.Tensor) -> tuple[int, torch.Tensor | None, bool]:
        """The root's own gradient: hand it to the thread, wait for its answer."""
        self.local_in.put(grad)
        while True:
            try:
                answer = self.local_out.get(timeout=0.5)
            except queue.Empty:
                if not self.thread.is_alive():
                    raise RuntimeError("the ps-async server thread ended") from self.error
                continue
            if isinstance(answer, BaseException):
                raise RuntimeError("the ps-async server failed") from answer
            return answer

    def finish(self) -> None:
        """Wait for the workers' gradients in progress (each is answered "stop")."""
        while self.thread.is_alive():
            pending = sorted(self.running - {0})
            group = self.e.grid.layout.dp_group(self.e.grid.rank)
            ranks = ", ".join(str(group[r]) for r in pending)
            with watchdog.waiting(
                f"ps-async: the gradient in progress of world rank(s) {ranks}", axis="dp"
            ):
                while self.thread.is_alive() and sorted(self.running - {0}) == pending:
                    self.thread.join(timeout=0.2)
        if self.error is not None:
            raise RuntimeError("the ps-async server failed") from self.error
        s = self.stats
        s.updates = self.version - self.first_version
        s.loss = sum(self.losses) / len(self.losses) if self.losses else float("nan")
        s.staleness_mean = sum(self.staleness) / len(self.staleness) if self.staleness else 0.0
        s.staleness_max = max(self.staleness, default=0)

    # -- the thread --------------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            if self.e.k == 0:
                self._serve_sync()
            else:
                self._serve_async()
        except BaseException as error:  # handed to the root's training thread
            self.error = error
            self.local_out.put(error)

    def _receive(self, source: int | None) -> tuple[int, torch.Tensor]:
        """Return the next gradient (from dp rank ``source``, or any when None) and its rank."""
        import numpy as np
        from mpi4py import MPI

        status = MPI.Status()
        n = self.e.flat_master.numel() + TRAILER
        while True:
            if source in (None, 0):
                try:
                    return 0, self.local_in.get_nowait()
                except queue.Empty:
                    pass
            if source != 0 and self.d > 1:
                want = MPI.ANY_SOURCE if source is None else source
                if self.e.comm.Iprobe(source=want, tag=TAG_GRAD, status=status):
                    buf = np.empty(n, dtype=np.float32)
                    self.e.comm.Recv(buf, source=status.Get_source(), tag=TAG_GRAD)
                    device = self.e.flat_master.device
                    return status.Get_source(), torch.from_numpy(buf).to(device)
            time.sleep(0.0002)  # lets the root's training thread have the GIL

    def _apply(self, grad: torch.Tensor, scale: float) -> None:
        """One update of the masters with ``grad`` (flat, no trailer) times ``scale``."""
        step = self.version // self.e.updates_per_step
        lr = self.lr_of_step(step)
        opt = self.e.optimizer
        assert opt is not None
        for group in opt.param_groups:
            group["lr"] = lr
        torch.mul(grad, scale, out=self.e.flat_grad)
        norm, skipped = opt.step()
        self.version += 1
        self.stats.lr = lr
        self.stats.grad_norm = float(norm)
        if bool(skipped):
            self.stats.skipped += 1
            if step != self.last_skipped_step:
                self.stats.skipped_steps += 1
                self.last_skipped_step = step
            self.e.bad_streak += 1
        else:
            self.e.bad_streak = 0
        # train.max_bad_steps counts steps: a step's worth of updates skipped in a row is one.
        self.stats.bad_steps_in_a_row = self.e.bad_streak // self.e.updates_per_step

    def _answer(self, rank: int, fresh: bool, stop: bool) -> None:
        import numpy as np

        weights = self.e.flat_master.clone() if fresh else None
        if rank == 0:
            self.local_out.put((self.version, weights, stop))
            return
        header = np.array([self.version, int(fresh), int(stop)], dtype=np.int64)
        self.e.comm.Send(header, dest=rank, tag=TAG_REPLY)
        if weights is not None:
            self.e.comm.Send(weights.cpu().numpy(), dest=rank, tag=TAG_WEIGHTS)

    def _serve_sync(self) -> None:
        # K = 0: the ps engine's step. Every worker's gradient of this version, their mean,
        # one update, fresh weights for everybody.
        applied = 0
        while applied < self.quota:
            total = torch.zeros_like(self.e.flat_master)
            for rank in range(self.d):
                _, grad = self._receive(rank)
                total += grad[:-TRAILER]
                self.losses.append(float(grad[-1]))
                self.staleness.append(self.version - int(grad[-2]))
                self.stats.rank_gradients[rank] += 1
            self._apply(total, 1.0 / self.d)
            applied += 1
            for rank in range(self.d):
                self._answer(rank, fresh=True, stop=applied == self.quota)

    def _serve_async(self) -> None:
        applied = 0
        turn = 0
        while self.running:
            if self.e.order == "round-robin":
                while turn % self.d not in self.running:
                    turn += 1
                rank, grad = self._receive(turn % self.d)
                turn += 1
            else:
                rank, grad = self._receive(None)
            self.stats.rank_gradients[rank] += 1
            computed_on = int(grad[-2])
            if applied < self.quota:
                self.staleness.append(self.version - computed_on)
                self.losses.append(float(grad[-1]))
                self._apply(grad[:-TRAILER], 1.0 / self.d)
                applied += 1
                stop = applied == self.quota
            else:
                self.stats.dropped += 1
                stop = True
            fresh = not stop and self.version - computed_on > self.e.k
            self._answer(rank, fresh, stop)
            if stop:
                self.running.discard(rank)
