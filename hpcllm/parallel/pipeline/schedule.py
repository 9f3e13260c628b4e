"""Pipeline schedules as data: each rank's ordered list of actions for one training step.

Layout. ``p`` ranks hold ``S = v·p`` model stages; rank ``r`` holds the chunks ``c = 0..v-1``
of stages ``c·p + r`` (Megatron's interleaved layout; ``v = 1`` is the plain pipeline). The
next stage of any stage is on rank ``r + 1 (mod p)`` and the previous one on ``r - 1 (mod p)``.

Actions. ``Action(kind, microbatch, chunk)``; ``chunk`` is the local model chunk (0 if v = 1):

* ``F``: forward of that micro-batch through that chunk; on the last stage it also computes
  the loss.
* ``B``: backward through that chunk: the full backward, or in ``zb-h1`` only the input
  gradient (the weight gradient is kept for later).
* ``W``: ``zb-h1`` only: the weight gradient of that chunk, after its ``B``; frees what the
  ``B`` kept for it.
* ``RECV_F`` / ``SEND_F``: receive the input activation of ``F(i, c)`` from the previous stage
  / send the output of ``F(i, c)`` to the next stage.
* ``RECV_B`` / ``SEND_B``: receive the gradient of ``F(i, c)``'s output from the next stage /
  send the input gradient computed by ``B(i, c)`` to the previous stage.

  A communication action names the compute action on *this* rank that consumes or produces
  the tensor; ``peer_rank`` gives the rank at the other end. The first stage has no
  ``RECV_F``/``SEND_B``, the last no ``SEND_F``/``RECV_B``, ``W`` never communicates, and
  with ``p = 1`` there is no communication at all (plain gradient accumulation).

Placement. A send comes right after the compute that produces its tensor. A receive comes
before the compute that consumes it, at the point where the receiving rank stands when the
sender posts that send in a run where every F, B and W costs the same: the two sides of
every transfer are then posted together (Megatron's ``send_forward_recv_backward`` pairs fall
out of this), and a receive may come several computes before its consumer.

Execution convention for the runtime. A maximal run of consecutive communication actions is
one batch: post it, in list order, with one ``batch_isend_irecv``. Then either

* wait for the whole batch before the next action (simplest), or
* better: wait for a receive right before the F or B that consumes it, and for the sends at
  the end of the step (before the send buffers are freed).

Both are deadlock-free for every schedule here, even when a send blocks until its receiver
has posted (rendezvous: NCCL, and gloo for large tensors). ``simulate`` proves it for
p ≤ 8, m ≤ 32, v ≤ 4 under the strictest model. Messages between two ranks match in posting
order (the k-th send from a to b is the tensor b's k-th receive from a expects), so untagged
p2p (NCCL ignores tags) never swaps two tensors. Timing: waiting per batch meets the papers'
bubbles when F, B and W cost the same (gpipe and 1f1b: at any ratio); waiting at use meets
them at any F:B ratio (zb-h1: at the paper's F = B = W), see docs/pipeline.md.
"""

from __future__ import annotations

import bisect
import enum
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


class Kind(str, enum.Enum):
    """What an action does; the value is its short name in texts and traces."""

    F = "F"
    B = "B"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        """Return True for F, B and W."""
        return self in (Kind.F, Kind.B, Kind.W)


@dataclass(frozen=True, slots=True)
class Action:
    """One step of a rank's schedule: ``kind`` on ``microbatch`` in local model ``chunk``."""

    kind: Kind
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        chunk = f"c{self.chunk}" if self.chunk else ""
        return f"{self.kind.value}{self.microbatch}{chunk}"


@dataclass(frozen=True, slots=True)
class Interval:
    """What ran on a rank from ``start`` to ``end`` (seconds): simulated or recorded by the runtime.

    A communication action's interval runs from its posting to its completion.
    """

    kind: Kind
    microbatch: int
    chunk: int
    start: float
    end: float

    @property
    def action(self) -> Action:
        """Return the action this interval timed."""
        return Action(self.kind, self.microbatch, self.chunk)


def stage_of(rank: int, chunk: int, p: int) -> int:
    """Return the model stage index that ``chunk`` of ``rank`` holds: ``chunk·p + rank``."""
    return chunk * p + rank


def peer_rank(kind: Kind, rank: int, p: int) -> int:
    """Return the rank at the other end of a communication action taken on ``rank``."""
    if kind in (Kind.SEND_F, Kind.RECV_B):
        return (rank + 1) % p
    if kind in (Kind.RECV_F, Kind.SEND_B):
        return (rank - 1) % p
    raise ValueError(f"{kind.value} is a compute action and has no peer")


def check_sizes(schedule: str, p: int, m: int, v: int = 1) -> None:
    """Raise ValueError, saying what works, unless ``schedule`` can run p stages, m micro-batches.

    ``interleaved`` needs p ≥ 2 and v ≥ 2 and takes any m ≥ 1, where Megatron asks
    m % p == 0: micro-batches go through the chunks in groups of p, and for other m the list is
    that of the next multiple of p with the extra micro-batches left out. That is correct
    (deadlock-free, checked) but its bubble is above (p-1)/(v·m), so choose m a multiple of p.
    The other schedules need v = 1; zb-h1 meets its paper's bubble from m ≥ p on.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")
    for name, value in (("p", p), ("m", m), ("v", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer ≥ 1, got {value!r}")
    if schedule == "interleaved":
        if v < 2:
            raise ValueError(
                f"schedule 'interleaved' needs v ≥ 2 virtual stages per rank, got v={v} "
                "(v = 1 is schedule '1f1b')"
            )
        if p < 2:
            raise ValueError(
                f"schedule 'interleaved' needs p ≥ 2 pipeline ranks, got p={p}; with one rank "
                "there is nothing to interleave (use '1f1b' with v = 1)"
            )
    elif v != 1:
        raise ValueError(
            f"schedule {schedule!r} runs one model chunk per rank (v = 1), got v={v}; "
            "virtual stages need schedule 'interleaved'"
        )


def build(schedule: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Return every rank's ordered actions for one step of ``schedule`` (index = rank)."""
    check_sizes(schedule, p, m, v)
    orders = [_COMPUTE_ORDERS[schedule](p, rank, m, v) for rank in range(p)]
    return _place_communication(orders, p, v)


def rank_actions(schedule: str, p: int, rank: int, m: int, v: int = 1) -> list[Action]:
    """Return the ordered actions of pipeline ``rank`` for one step of ``schedule``."""
    check_sizes(schedule, p, m, v)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < p:
        raise ValueError(f"rank must be an integer in [0, p={p}), got {rank!r}")
    return build(schedule, p, m, v)[rank]


def alive_after(actions: Sequence[Action]) -> list[frozenset[tuple[int, int]]]:
    """Return, after each action, the (microbatch, chunk) pairs whose activations are held.

    A pair is alive from its F until its last backward piece: W when the list splits the
    backward (zb-h1), else B.
    """
    return [frozenset(alive) for alive in _walk_alive(actions)]


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Return the most (microbatch, chunk) activations a rank holds at once."""
    return max((len(alive) for alive in _walk_alive(actions)), default=0)


def _walk_alive(actions: Sequence[Action]) -> Iterator[set[tuple[int, int]]]:
    """Yield the (one, updated) set of alive (microbatch, chunk) pairs after each action."""
    fwd = Kind.F
    frees = Kind.W if any(a.kind is Kind.W for a in actions) else Kind.B
    alive: set[tuple[int, int]] = set()
    for a in actions:
        if a.kind is fwd:
            alive.add((a.microbatch, a.chunk))
        elif a.kind is frees:
            alive.discard((a.microbatch, a.chunk))
        yield alive


def format_actions(actions: Iterable[Action], compute_only: bool = True) -> str:
    """Return the actions as one line of text, e.g. ``F0 F1 B0 F2 B1 B2``."""
    return " ".join(str(a) for a in actions if a.kind.is_compute or not compute_only)


# --- compute orders: which F/B/W a rank runs, in order, before communication is placed ------


def _gpipe(p: int, rank: int, m: int, v: int) -> list[Action]:
    """All forwards, then all backwards (in micro-batch order)."""
    return [Action(Kind.F, i) for i in range(m)] + [Action(Kind.B, i) for i in range(m)]


def _one_f_one_b(p: int, rank: int, m: int, v: int) -> list[Action]:
    """PipeDream-Flush: p - rank - 1 warm-up forwards, then one forward one backward, then drain."""
    warmup = min(p - rank - 1, m)
    order = [Action(Kind.F, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action(Kind.F, warmup + i), Action(Kind.B, i)]
    order += [Action(Kind.B, i) for i in range(m - warmup, m)]
    return order


def _interleaved(p: int, rank: int, m: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B over v chunks per rank, micro-batches in groups of p.

    Forwards go group by group, each group through chunk 0, 1, …, v-1; backwards the same with
    the chunks reversed. The warm-up runs 2(p - rank - 1) + (v - 1)·p forwards: enough for the
    first backward (micro-batch 0 of the last chunk) to be reachable, plus the round trip
    between this rank and the last one, so the steady 1F1B phase never waits. When p does not
    divide m, this is the order for the next multiple of p with the extra micro-batches left
    out: dropping actions from every rank's list only removes waits, so it stays deadlock-free.
    """
    padded = -(-m // p) * p
    groups = [range(g, g + p) for g in range(0, padded, p)]
    forwards = [(i, c) for group in groups for c in range(v) for i in group]
    backwards = [(i, c) for group in groups for c in reversed(range(v)) for i in group]
    total = padded * v
    warmup = min(total, 2 * (p - rank - 1) + (v - 1) * p)
    pairs = [(Kind.F, forwards[k]) for k in range(warmup)]
    for k in range(total - warmup):
        pairs += [(Kind.F, forwards[warmup + k]), (Kind.B, backwards[k])]
    pairs += [(Kind.B, backwards[k]) for k in range(total - warmup, total)]
    return [Action(kind, i, c) for kind, (i, c) in pairs if i < m]


def _zb_h1(p: int, rank: int, m: int, v: int) -> list[Action]:
    """Zero-bubble H1: 1F1B's F and B order, each W as late as 1F1B's peak memory allows.

    At most p micro-batches are alive (F done, W not) on any rank, which is 1F1B's peak on
    rank 0. Before a forward that would exceed it, the oldest pending W runs; in the drain,
    a W runs before each B (filling the wait for its gradient) and the rest at the end.
    """
    warmup = min(p - rank - 1, m)
    order = [Action(Kind.F, i) for i in range(warmup)]
    pending_w: deque[int] = deque()
    alive = warmup

    def forward(i: int) -> None:
        nonlocal alive
        if alive == p:
            order.append(Action(Kind.W, pending_w.popleft()))
            alive -= 1
        order.append(Action(Kind.F, i))
        alive += 1

    def backward(i: int) -> None:
        order.append(Action(Kind.B, i))
        pending_w.append(i)

    for i in range(m - warmup):
        forward(warmup + i)
        backward(i)
    for i in range(m - warmup, m):
        if pending_w:
            order.append(Action(Kind.W, pending_w.popleft()))
        backward(i)
    order += [Action(Kind.W, i) for i in pending_w]
    return order


_COMPUTE_ORDERS = {
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "interleaved": _interleaved,
    "zb-h1": _zb_h1,
}


def _reference_times(orders: list[list[Action]], p: int, v: int) -> list[list[tuple[int, int]]]:
    """Return (start, end) of every compute action with unit costs, each as early as it can run.

    An F waits for the previous stage's F of its micro-batch, a B for the next stage's B; a
    rank runs its own list in order.
    """
    fwd, bwd = Kind.F, Kind.B
    last = v * p - 1
    ends: dict[tuple[Kind, int, int], int] = {}
    times: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    free = [0] * p
    pending = list(range(p))
    while pending:
        blocked = []
        moved = False
        for rank in pending:
            order, mine, t = orders[rank], times[rank], free[rank]
            k = len(mine)
            while k < len(order):
                a = order[k]
                stage = a.chunk * p + rank
                dep: int | None = 0
                if a.kind is fwd and stage > 0:
                    dep = ends.get((fwd, a.microbatch, stage - 1))
                elif a.kind is bwd and stage < last:
                    dep = ends.get((bwd, a.microbatch, stage + 1))
                if dep is None:
                    break
                start = max(t, dep)
                t = start + 1
                mine.append((start, t))
                ends[(a.kind, a.microbatch, stage)] = t
                k += 1
                moved = True
            free[rank] = t
            if k < len(order):
                blocked.append(rank)
        if not moved:
            raise RuntimeError(f"compute orders of ranks {blocked} wait on each other")
        pending = blocked
    return times


def _place_communication(orders: list[list[Action]], p: int, v: int) -> list[list[Action]]:
    """Return each rank's compute order with its sends and receives placed (module docstring).

    Each send goes right after the compute producing it. Its receive goes into the receiver's
    gap (between two computes) at the time the send is posted in a unit-cost run, so in that
    run every send and its receive are posted together and nobody waits on a rendezvous.
    """
    fwd, bwd = Kind.F, Kind.B
    times = _reference_times(orders, p, v)
    starts = [[start for start, _ in rank_times] for rank_times in times]
    last = v * p - 1
    sends: list[list[Action | None]] = [[None] * (len(o) + 1) for o in orders]
    recvs: list[list[list[tuple[int, Action]]]] = [[[] for _ in range(len(o) + 1)] for o in orders]
    for rank, order in enumerate(orders):
        for k, a in enumerate(order):
            stage = a.chunk * p + rank
            if a.kind is fwd and stage < last:
                send, to, their_stage, recv = Kind.SEND_F, (rank + 1) % p, stage + 1, Kind.RECV_F
            elif a.kind is bwd and stage > 0:
                send, to, their_stage, recv = Kind.SEND_B, (rank - 1) % p, stage - 1, Kind.RECV_B
            else:
                continue
            sent_at = times[rank][k][1]
            sends[rank][k + 1] = Action(send, a.microbatch, a.chunk)
            gap = bisect.bisect_left(starts[to], sent_at)
            recvs[to][gap].append((sent_at, Action(recv, a.microbatch, their_stage // p)))
    out = []
    for rank, order in enumerate(orders):
        actions: list[Action] = []
        for gap in range(len(order) + 1):
            if sends[rank][gap] is not None:
                actions.append(sends[rank][gap])
            if recvs[rank][gap]:
                actions += [a for _, a in sorted(recvs[rank][gap], key=lambda r: r[0])]
            if gap < len(order):
                actions.append(order[gap])
        out.append(actions)
    return out
