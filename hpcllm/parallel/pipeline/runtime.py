"""Executes a rank's pipeline schedule (:mod:`.schedule`) with torch.distributed point-to-point.

The runtime owns the communication and the bookkeeping; what a forward, a backward and a
weight-gradient step compute is a :class:`StageWork` (the GPT's stages, or the fixed-cost
synthetic stage of ``hpcllm bench pipeline``). Each run of consecutive communication actions
is posted as one ``batch_isend_irecv``; a receive is waited for just before the compute that
uses it, and sends when they complete or the step ends. Waiting for a whole batch at once
would hold a rank on a receive posted early for a later compute (the schedules post some
receives a few computes ahead) and, with a backward twice the forward, would grow the
interleaved schedule's bubble well past (p-1)/(v·m); the simulator shows it (``wait``).

Scatter/gather (Narayanan et al., SC21 §4.1): with t > 1 the activation crossing a stage
boundary is the same on every tp rank, so each tp rank sends only its 1/t of it and the
receiving stage all-gathers the parts within its tp group (NVLink inside a node) — t times
fewer bytes over the inter-node links. Under sequence parallelism each tp rank already holds
a different 1/t (its part of the sequence) and sends just that.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hpcllm.observe import nvtx_range
from hpcllm.parallel.pipeline.schedule import Action, Interval, Kind
from hpcllm.watchdog import waiting

_ACTIVATION, _GRADIENT = 0, 1  # p2p tags: gloo matches on them, NCCL keeps channel order


class StageWork(Protocol):
    """What one rank's model chunks do for the runtime's compute actions."""

    def forward(self, chunk: int, microbatch: int, x: torch.Tensor | None) -> torch.Tensor | None:
        """Run the forward; return the activation for the next stage (None on the last)."""

    def backward(
        self, chunk: int, microbatch: int, grad: torch.Tensor | None, weights: bool
    ) -> torch.Tensor | None:
        """Run the backward (with the weight gradient if ``weights``); return the input
        gradient for the previous stage (None on the first)."""

    def backward_weight(self, chunk: int, microbatch: int) -> None:
        """Run the deferred weight gradient of a ``backward(weights=False)``."""


@dataclass
class Channel:
    """Point-to-point between pipeline neighbours, with the scatter/gather optimisation.

    ``shape``/``dtype`` are those of one micro-batch's activation on this rank; ``prev`` and
    ``next`` are world ranks (they wrap around the ring, for interleaved schedules). Under
    ``sequence_parallel`` the activation is already this tp rank's own part: it goes whole.
    """

    prev: int
    next: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    tp_group: Any = None
    scatter_gather: bool = False
    sequence_parallel: bool = False
    bytes_sent: int = 0

    def __post_init__(self) -> None:
        self.tp = 1 if self.tp_group is None else dist.get_world_size(self.tp_group)
        self.tp_rank = 0 if self.tp_group is None else dist.get_rank(self.tp_group)
        numel = 1
        for size in self.shape:
            numel *= size
        self.numel = numel
        self.split = (
            self.scatter_gather
            and not self.sequence_parallel
            and self.tp > 1
            and numel % self.tp == 0
        )

    def outgoing(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return what this rank sends of ``tensor``: all of it, or its 1/t part."""
        flat = tensor.detach().to(self.dtype).contiguous().view(-1)
        if self.split:
            flat = flat.chunk(self.tp)[self.tp_rank].contiguous()
        self.bytes_sent += flat.numel() * flat.element_size()
        return flat

    def buffer(self) -> torch.Tensor:
        """Return an empty receive buffer for one message."""
        numel = self.numel // self.tp if self.split else self.numel
        return torch.empty(numel, dtype=self.dtype, device=self.device)

    def incoming(self, flat: torch.Tensor) -> torch.Tensor:
        """Return the whole activation from a received message (all-gathering the parts)."""
        if self.split:
            parts = [torch.empty_like(flat) for _ in range(self.tp)]
            dist.all_gather(parts, flat, group=self.tp_group)
            flat = torch.cat(parts)
        return flat.view(self.shape)


class Runtime:
    """Runs one rank's action list for one training step; records what ran when."""

    def __init__(self, channel: Channel | None) -> None:
        self.channel = channel
        self._sending: list[tuple[Any, torch.Tensor]] = []

    def run(
        self,
        actions: Sequence[Action],
        work: StageWork,
        split_backward: bool = False,
        origin: float | None = None,
        synchronize: Callable[[], None] | None = None,
    ) -> list[Interval]:
        """Execute ``actions``; return the intervals of its compute and communication.

        ``split_backward`` (zb-h1) makes B compute only input gradients, W the weights'.
        Times are seconds since ``origin`` (default: now). A compute's interval starts once
        its input has arrived, so time spent waiting shows as idle. On a GPU, pass
        ``synchronize`` (``torch.cuda.synchronize``) for intervals that time the kernels
        rather than their launches; it costs the overlap of launches with running kernels.
        """
        origin = time.perf_counter() if origin is None else origin
        received_f: dict[tuple[int, int], Any] = {}
        received_b: dict[tuple[int, int], Any] = {}
        outbox_f: dict[tuple[int, int], torch.Tensor] = {}
        outbox_b: dict[tuple[int, int], torch.Tensor] = {}
        intervals: list[Interval] = []
        i = 0
        while i < len(actions):
            action = actions[i]
            key = (action.microbatch, action.chunk)
            if action.kind == Kind.F:
                x = self._arrived(received_f, key, forward=True)
                started = time.perf_counter()
                if x is not None:
                    x.requires_grad_()
                out = work.forward(action.chunk, action.microbatch, x)
                if out is not None:
                    outbox_f[key] = out
                i += 1
            elif action.kind == Kind.B:
                grad = self._arrived(received_b, key, forward=False)
                started = time.perf_counter()
                grad = work.backward(
                    action.chunk, action.microbatch, grad, weights=not split_backward
                )
                if grad is not None:
                    outbox_b[key] = grad
                i += 1
            elif action.kind == Kind.W:
                started = time.perf_counter()
                work.backward_weight(action.chunk, action.microbatch)
                i += 1
            else:
                started = time.perf_counter()
                end = i
                while end < len(actions) and not actions[end].kind.is_compute:
                    end += 1
                self._post(actions[i:end], received_f, received_b, outbox_f, outbox_b)
                i = end
            if synchronize is not None and action.kind.is_compute:
                synchronize()
            finished = time.perf_counter()
            intervals.append(
                Interval(
                    action.kind,
                    action.microbatch,
                    action.chunk,
                    started - origin,
                    finished - origin,
                )
            )
            # Forget the sends that have completed, and their buffers with them.
            self._sending = [(r, t) for r, t in self._sending if not r.is_completed()]
        if self._sending:
            with waiting("send completion", axis="pp"):
                for request, _ in self._sending:
                    request.wait()
        self._sending = []
        if outbox_f or outbox_b or received_f or received_b:
            raise RuntimeError(
                "pipeline schedule left messages unsent or unused: "
                f"{sorted(outbox_f) + sorted(outbox_b)}"
            )
        return intervals

    def _post(
        self,
        batch: Sequence[Action],
        received_f: dict,
        received_b: dict,
        outbox_f: dict,
        outbox_b: dict,
    ) -> None:
        """Post a batch of sends and receives; receives are waited for where they are used."""
        channel = self.channel
        if channel is None:
            raise RuntimeError("a pipeline of one stage has no communication")
        ops, targets = [], []
        for action in batch:
            key = (action.microbatch, action.chunk)
            if action.kind in (Kind.SEND_F, Kind.SEND_B):
                forward = action.kind == Kind.SEND_F
                tensor = channel.outgoing((outbox_f if forward else outbox_b).pop(key))
                ops.append(
                    dist.P2POp(
                        dist.isend,
                        tensor,
                        channel.next if forward else channel.prev,
                        tag=_ACTIVATION if forward else _GRADIENT,
                    )
                )
                targets.append(tensor)
            else:
                forward = action.kind == Kind.RECV_F
                buffer = channel.buffer()
                ops.append(
                    dist.P2POp(
                        dist.irecv,
                        buffer,
                        channel.prev if forward else channel.next,
                        tag=_ACTIVATION if forward else _GRADIENT,
                    )
                )
                targets.append((received_f if forward else received_b, key, buffer))
        # Asynchronous, except the first on NCCL, which connects the two ranks.
        label = ", ".join(f"{a.kind.name.lower()} mb{a.microbatch} chunk {a.chunk}" for a in batch)
        with (
            nvtx_range(f"p2p post {label}"),
            waiting("post sends and receives", axis="pp", microbatch=batch[0].microbatch),
        ):
            requests = dist.batch_isend_irecv(ops)
        if len(requests) != len(ops):  # a backend that returns one request for the batch
            requests = [requests[0]] * len(ops)
        for request, target in zip(requests, targets, strict=True):
            if isinstance(target, tuple):
                store, key, buffer = target
                store[key] = (request, buffer)
            else:
                self._sending.append((request, target))

    def _arrived(
        self, store: dict[tuple[int, int], Any], key: tuple[int, int], forward: bool
    ) -> torch.Tensor | None:
        """Return the tensor received for ``key`` (waiting for it), or None if none is due.

        ``forward``: an activation from the previous stage, else a gradient from the next.
        """
        if key not in store:
            return None
        request, buffer = store.pop(key)
        microbatch, chunk = key
        what, peer = (
            ("recv activation", self.channel.prev)
            if forward
            else ("recv gradient", self.channel.next)
        )
        with (
            nvtx_range(f"p2p wait {what} mb{microbatch} chunk {chunk}"),
            waiting(what, axis="pp", peer=peer, microbatch=microbatch, chunk=chunk),
        ):
            request.wait()
        with waiting("gather the received parts", axis="tp", microbatch=microbatch, chunk=chunk):
            return self.channel.incoming(buffer)


def forward_only(p: int, rank: int, m: int, v: int) -> list[Action]:
    """Return an evaluation schedule: forwards only, micro-batch by micro-batch.

    Every rank walks (micro-batch, chunk) in the same order and each forward waits only for
    forwards earlier in that order, so blocking sends cannot deadlock.
    """
    actions: list[Action] = []
    last_stage = p * v - 1
    for microbatch in range(m):
        for chunk in range(v):
            stage = chunk * p + rank
            if stage > 0:
                actions.append(Action(Kind.RECV_F, microbatch, chunk))
            actions.append(Action(Kind.F, microbatch, chunk))
            if stage < last_stage:
                actions.append(Action(Kind.SEND_F, microbatch, chunk))
    return actions
