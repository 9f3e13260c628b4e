"""Replay every rank's schedule together: timings, bubbles, memory, and proof of no deadlock.

Model. Each rank runs its list in order; a compute action takes its kind's cost. A run of
consecutive communication actions is one batch (the runtime's ``batch_isend_irecv``), posted
when the rank reaches it. Messages on each directed channel (rank a → rank b) match in
posting order, as untagged p2p does; a mismatch (the k-th send is not the tensor the k-th
receive expects) is an error. Two knobs say how strict the transport and the runtime are:

* ``rendezvous``: False (buffered sends): a send completes when posted and a receive at
  ``max(its post, the send's post + latency)``. True: a transfer starts once both sides have
  posted and both complete ``latency`` later, so a send also waits for its receiver (NCCL, and
  gloo for large tensors).
* ``wait``: ``"batch"``: the rank waits for every operation of a batch before going on (the
  simple runtime). ``"use"``: posting never blocks; a compute waits for the receive it
  consumes, and the rank waits for its sends at the end of its list
  (torch.distributed.pipelining's runtime does this).

``rendezvous=True, wait="batch"`` is the strictest; lists that finish there finish under every
weaker model, NCCL's in-order stream included.

Checks (``ScheduleError``, a ValueError): a forward whose input was not received, a backward
whose forward did not run on that rank and chunk or whose output gradient was not received, a
W before its B, a send of data not yet computed, duplicate or missing actions (every
(microbatch, chunk) gets exactly one F and one B on every rank, and one W on every rank if any
rank splits its backward), unmatched sends. ``DeadlockError`` when no rank can move on.

Bubbles. ``busy`` is a rank's compute time and ``makespan`` the time the last rank finishes.

* ``bubble_over_ideal = (makespan - busy) / busy`` for the busiest rank: the papers' ratio of
  bubble time to ideal time, (p-1)/m for gpipe and 1f1b, (p-1)/(v·m) for interleaved with
  per-chunk costs t/v, (p-1)(t_f+t_b-t_w)/(m(t_f+t_b+t_w)) for zb-h1 (m ≥ p).
* ``idle_fraction = (makespan - busy) / makespan`` per rank and on average: the share of the
  step a GPU sits idle, (p-1)/(m+p-1) for 1f1b.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpcllm.parallel.pipeline.schedule import Action, Interval, Kind, build, peak_in_flight

WAITS = ("batch", "use")


class ScheduleError(ValueError):
    """A schedule that uses data before it exists, repeats or misses actions, or mismatches."""


class DeadlockError(ScheduleError):
    """No rank can make progress: every unfinished rank waits on a message never posted."""


@dataclass(frozen=True)
class SimResult:
    """Timings of one simulated step; see the module docstring for the bubble measures."""

    intervals: list[list[Interval]]
    makespan: float
    busy: list[float]
    idle_fraction_per_rank: list[float]
    idle_fraction: float
    bubble_over_ideal: float
    peak_in_flight: list[int]


# Per (microbatch, chunk) flags a rank keeps while replaying.
_DONE_F, _DONE_B, _DONE_W, _GOT_F, _GOT_B = 1, 2, 4, 8, 16
_DONE = {Kind.F: _DONE_F, Kind.B: _DONE_B, Kind.W: _DONE_W}

# A posted operation is a list [spec, posted at, partner op or None]; a spec is
# (action, is_send, (src, dst), tensor name, flag, own queue, partner queue, (microbatch,
# chunk)), see _comm_spec.
_SPEC, _POSTED, _PARTNER = 0, 1, 2


def simulate(
    actions: Sequence[Sequence[Action]],
    cost_f: float,
    cost_b: float,
    cost_w: float = 0.0,
    latency: float = 0.0,
    *,
    rendezvous: bool = False,
    wait: str = "batch",
) -> SimResult:
    """Return the timings of all ranks' ``actions`` run together; raise ScheduleError if unsound.

    ``cost_*`` is the time of one F, B or W of one chunk; ``latency`` the time from a send's
    start until its data is at the receiver; ``rendezvous`` and ``wait`` as in the module
    docstring.
    """
    m, v, split = _sizes(actions, wait)
    p = len(actions)
    cost = {Kind.F: cost_f, Kind.B: cost_b, Kind.W: cost_w}
    channels: dict[tuple[int, int], tuple[list[list], list[list]]] = {}
    steps = [
        _steps(rank, rank_actions, p, v, cost, channels)
        for rank, rank_actions in enumerate(actions)
    ]
    run = _Replay(steps, rendezvous, latency, lazy=wait == "use")
    work = list(range(p))
    while work:
        _advance(run, work.pop(), work)
    _raise_if_stuck(run)
    _check_complete(run.state, m, v, split)
    _check_channels(channels)
    return _result(actions, run)


def _sizes(actions: Sequence[Sequence[Action]], wait: str) -> tuple[int, int, bool]:
    """Check ``wait`` and the actions; return (micro-batches, chunks, whether any W is split)."""
    if wait not in WAITS:
        raise ValueError(f"wait must be one of {WAITS}, got {wait!r}")
    flat = [a for rank_actions in actions for a in rank_actions]
    if not flat:
        raise ScheduleError("no actions to simulate")
    if min(min(a.microbatch, a.chunk) for a in flat) < 0:
        raise ScheduleError("actions must name micro-batches and chunks ≥ 0")
    m = 1 + max(a.microbatch for a in flat)
    v = 1 + max(a.chunk for a in flat)
    return m, v, any(a.kind is Kind.W for a in flat)


@dataclass(slots=True)
class _Replay:
    """Every rank's replay state: where it is in its steps, its clock, flags and posted ops."""

    steps: list[list[tuple]]
    rendezvous: bool
    latency: float
    lazy: bool  # wait="use"
    pos: list[int] = field(init=False)
    clock: list[float] = field(init=False)
    busy: list[float] = field(init=False)
    state: list[dict[tuple[int, int], int]] = field(init=False)
    # The posted batch a rank waits on (wait="batch").
    batch: list[list[list] | None] = field(init=False)
    received: list[dict[tuple[int, int, int], list]] = field(init=False)
    sent: list[list[list]] = field(init=False)
    # Intervals and posted ops, in the order the rank ran or posted them.
    records: list[list[Interval | list]] = field(init=False)
    finished: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        """Start every rank at its first step, at time 0, with nothing run or posted."""
        p = len(self.steps)
        self.pos = [0] * p
        self.clock = [0.0] * p
        self.busy = [0.0] * p
        self.state = [{} for _ in range(p)]
        self.batch = [None] * p
        self.received = [{} for _ in range(p)]
        self.sent = [[] for _ in range(p)]
        self.records = [[] for _ in range(p)]
        self.finished = [False] * p


def _done_at(op: list, rendezvous: bool, latency: float) -> float | None:
    """Return when a posted operation completes, or None while its partner is unposted."""
    partner = op[_PARTNER]
    is_send = op[_SPEC][1]
    if partner is None:
        return op[_POSTED] if is_send and not rendezvous else None
    if rendezvous:
        return max(op[_POSTED], partner[_POSTED]) + latency
    return op[_POSTED] if is_send else max(op[_POSTED], partner[_POSTED] + latency)


def _advance(run: _Replay, rank: int, work: list[int]) -> None:
    """Run ``rank``'s steps until it waits or ends; ``work`` gets the ranks its posts wake."""
    rank_steps = run.steps[rank]
    i, t = run.pos[rank], run.clock[rank]
    while i < len(rank_steps):
        step = rank_steps[i]
        if step[0] is not None:
            after = _compute(run, rank, step, t)
        else:
            after = _communicate(run, rank, step, t, work)
        if after is None:
            break
        i, t = i + 1, after
    run.pos[rank], run.clock[rank] = i, t
    if i == len(rank_steps) and not run.finished[rank]:
        ends = [_done_at(op, run.rendezvous, run.latency) for op in run.sent[rank]]
        if None not in ends:
            run.clock[rank] = max([t, *ends])
            run.finished[rank] = True


def _compute(run: _Replay, rank: int, step: tuple, t: float) -> float | None:
    """Run a compute step from ``t``; return when it ends, or None while its input is unsent."""
    a, key, flag, needs, duration = step
    flags = run.state[rank]
    have = flags.get(key, 0)
    if have & flag:
        raise _fail(rank, a, "runs twice")
    if have & needs != needs:
        raise _fail(rank, a, _missing(needs & ~have))
    if run.lazy and needs & (_GOT_F | _GOT_B):
        op = run.received[rank][(needs & (_GOT_F | _GOT_B), *key)]
        ready = _done_at(op, run.rendezvous, run.latency)
        if ready is None:
            return None
        if ready > t:
            t = ready
    flags[key] = have | flag
    run.records[rank].append(Interval(a.kind, a.microbatch, a.chunk, t, t + duration))
    run.busy[rank] += duration
    return t + duration


def _communicate(run: _Replay, rank: int, step: tuple, t: float, work: list[int]) -> float | None:
    """Post a batch at ``t`` if not yet posted; return when the rank goes on, or None to wait."""
    flags = run.state[rank]
    ops = run.batch[rank]
    if ops is None:
        ops = [_post(rank, spec, t, flags, work) for spec in step[1]]
        run.records[rank] += ops
        if run.lazy:
            for op in ops:
                if op[_SPEC][1]:
                    run.sent[rank].append(op)
                else:
                    _mark_received(rank, op[_SPEC], flags)
                    run.received[rank][(op[_SPEC][4], *op[_SPEC][7])] = op
            return t
        run.batch[rank] = ops
    end = _batch_end(ops, t, run.rendezvous, run.latency)
    if end is None:
        return None
    for op in ops:
        if not op[_SPEC][1]:
            _mark_received(rank, op[_SPEC], flags)
    run.batch[rank] = None
    return end


def _batch_end(ops: list[list], t: float, rendezvous: bool, latency: float) -> float | None:
    """Return when every operation of a batch waited on from ``t`` is done, or None if one isn't."""
    end = t
    for op in ops:  # _done_at(op), inlined: this loop is the replay's hot path
        partner = op[_PARTNER]
        if partner is None:
            if rendezvous or not op[_SPEC][1]:
                return None
            continue
        if rendezvous:
            ready = op[_POSTED] if op[_POSTED] > partner[_POSTED] else partner[_POSTED]
            ready += latency
        elif op[_SPEC][1]:
            continue
        else:
            ready = partner[_POSTED] + latency
        if ready > end:
            end = ready
    return end


def _raise_if_stuck(run: _Replay) -> None:
    """Raise DeadlockError, saying what each rank waits for, if any rank did not finish."""
    stuck = [r for r in range(len(run.steps)) if not run.finished[r]]
    if stuck:
        raise DeadlockError(
            "deadlock: "
            + "; ".join(
                _describe_wait(
                    r,
                    run.steps[r][run.pos[r]] if run.pos[r] < len(run.steps[r]) else None,
                    run.batch[r],
                    run.received[r],
                )
                for r in stuck
            )
        )


def _check_channels(channels: dict[tuple[int, int], tuple[list[list], list[list]]]) -> None:
    """Raise ScheduleError if a channel has more sends than receives or the other way round."""
    for (src, dst), (sends, recvs) in channels.items():
        if len(sends) != len(recvs):
            extra = (sends if len(sends) > len(recvs) else recvs)[min(len(sends), len(recvs))]
            raise ScheduleError(
                f"channel rank {src} → rank {dst}: {len(sends)} sends but {len(recvs)} receives "
                f"(first unmatched: {extra[_SPEC][0]})"
            )


def _result(actions: Sequence[Sequence[Action]], run: _Replay) -> SimResult:
    """Return a finished replay's intervals, makespan and bubble measures."""
    intervals = [
        [
            r
            if isinstance(r, Interval)
            else Interval(
                r[0][0].kind,
                r[0][0].microbatch,
                r[0][0].chunk,
                r[1],
                _done_at(r, run.rendezvous, run.latency),
            )
            for r in rank_records
        ]
        for rank_records in run.records
    ]
    makespan = max(run.clock)
    top = max(run.busy)
    idle = [(makespan - b) / makespan if makespan > 0 else 0.0 for b in run.busy]
    return SimResult(
        intervals=intervals,
        makespan=makespan,
        busy=run.busy,
        idle_fraction_per_rank=idle,
        idle_fraction=sum(idle) / len(actions),
        bubble_over_ideal=(makespan - top) / top if top > 0 else 0.0,
        peak_in_flight=[peak_in_flight(rank_actions) for rank_actions in actions],
    )


def _post(rank: int, spec: tuple, t: float, flags: dict, work: list[int]) -> list:
    """Post one operation at time ``t``, match it with its partner if posted, wake the partner."""
    a, is_send, chan, what, flag, mine, theirs, key = spec
    if is_send and not flags.get(key, 0) & flag:
        raise _fail(rank, a, "sends data its rank has not computed yet")
    op = [spec, t, None]
    mine.append(op)
    if len(theirs) >= len(mine):
        other = theirs[len(mine) - 1]
        if other[_SPEC][3] != what:
            raise _order_error(chan, len(mine), op, other)
        op[_PARTNER], other[_PARTNER] = other, op
        work.append(chan[1] if is_send else chan[0])
    return op


def _mark_received(rank: int, spec: tuple, flags: dict) -> None:
    """Record that a receive's tensor is (or will be, wait="use") on this rank."""
    a, flag, key = spec[0], spec[4], spec[7]
    have = flags.get(key, 0)
    if have & flag:
        raise _fail(rank, a, "receives the same tensor twice")
    flags[key] = have | flag


def _steps(
    rank: int, actions: Sequence[Action], p: int, v: int, cost: dict, channels: dict
) -> list[tuple]:
    """Return a rank's actions as replay steps, each run of communication actions as one batch.

    A compute step is ``(action, key, done flag, needed flags, cost)``; a batch is
    ``(None, [communication spec, ...])``. ``channels`` collects the (sends, receives) queues
    of each directed channel.
    """
    fwd, bwd, wgt = Kind.F, Kind.B, Kind.W
    last = v * p - 1
    steps: list[tuple] = []
    for a in actions:
        kind = a.kind
        stage = a.chunk * p + rank
        if kind is fwd:
            needs = _GOT_F if stage > 0 else 0
        elif kind is bwd:
            needs = _DONE_F | _GOT_B if stage < last else _DONE_F
        elif kind is wgt:
            needs = _DONE_B
        else:
            if not steps or steps[-1][0] is not None:
                steps.append((None, []))
            steps[-1][1].append(_comm_spec(rank, a, stage, last, p, channels))
            continue
        steps.append((a, (a.microbatch, a.chunk), _DONE[kind], needs, cost[kind]))
    return steps


def _comm_spec(rank: int, a: Action, stage: int, last: int, p: int, channels: dict) -> tuple:
    """Return the spec (module comment at _SPEC) of a communication action.

    The flag is what a send needs done (its F or B) or what a receive provides.
    """
    kind = a.kind
    with_prev = kind is Kind.RECV_F or kind is Kind.SEND_B
    if (with_prev and stage == 0) or (not with_prev and stage == last):
        raise _fail(rank, a, f"stage {stage} has no neighbour for {kind.value}")
    nxt, prev, mb = (rank + 1) % p, (rank - 1) % p, a.microbatch
    if kind is Kind.SEND_F:
        chan, what, flag = (rank, nxt), ("activation", mb, stage + 1), _DONE_F
    elif kind is Kind.RECV_F:
        chan, what, flag = (prev, rank), ("activation", mb, stage), _GOT_F
    elif kind is Kind.SEND_B:
        chan, what, flag = (rank, prev), ("gradient", mb, stage - 1), _DONE_B
    else:
        chan, what, flag = (nxt, rank), ("gradient", mb, stage), _GOT_B
    is_send = kind is Kind.SEND_F or kind is Kind.SEND_B
    sends, recvs = channels.setdefault(chan, ([], []))
    queues = (sends, recvs) if is_send else (recvs, sends)
    return (a, is_send, chan, what, flag, *queues, (mb, a.chunk))


def _fail(rank: int, a: Action, why: str) -> ScheduleError:
    return ScheduleError(f"rank {rank}, {a}: {why}")


def _missing(flags: int) -> str:
    """Return why a compute action cannot run while ``flags`` are not yet set."""
    if flags & _GOT_F:
        return "forward before its input activation was received"
    if flags & _DONE_F:
        return "backward before its forward ran on this rank and chunk"
    if flags & _GOT_B:
        return "backward before its output gradient was received"
    return "weight gradient before its backward"


def _order_error(chan: tuple[int, int], n: int, op: list, other: list) -> ScheduleError:
    send, recv = (op, other) if op[_SPEC][1] else (other, op)
    kind, mb, stage = send[_SPEC][3]
    return ScheduleError(
        f"message order on channel rank {chan[0]} → rank {chan[1]}: send #{n} is "
        f"{send[_SPEC][0]} ({kind} of micro-batch {mb} for stage {stage}) but receive #{n} "
        f"is {recv[_SPEC][0]}"
    )


def _describe_wait(rank: int, step: tuple | None, ops: list[list] | None, received: dict) -> str:
    """Return what a stuck rank waits for, e.g. ``rank 1 waits in batch [RECV_B3] for …``."""
    if ops is None and step is not None:  # wait="use": a compute waits for its receive
        a, key, _, needs, _ = step
        ops = [received[(needs & (_GOT_F | _GOT_B), *key)]]
        where = f"at {a}"
    elif ops is None:
        return f"rank {rank} waits for its sends to be received"
    else:
        where = f"in batch [{' '.join(str(op[_SPEC][0]) for op in ops)}]"
    pending = ", ".join(
        f"{spec[0]} ({spec[3][0]} of micro-batch {spec[3][1]}, stage {spec[3][2]}) "
        + (f"to rank {spec[2][1]}" if spec[1] else f"from rank {spec[2][0]}")
        for spec, _, partner in ops
        if partner is None
    )
    return f"rank {rank} waits {where} for {pending}"


def _check_complete(state: list[dict[tuple[int, int], int]], m: int, v: int, split: bool) -> None:
    """Raise ScheduleError unless every rank ran every (microbatch, chunk) once per kind."""
    kinds = (Kind.F, Kind.B, Kind.W) if split else (Kind.F, Kind.B)
    for rank, flags in enumerate(state):
        for kind in kinds:
            missing = [
                (i, c) for i in range(m) for c in range(v) if not flags.get((i, c), 0) & _DONE[kind]
            ]
            if missing:
                listed = ", ".join(str(Action(kind, i, c)) for i, c in missing[:5])
                raise ScheduleError(f"rank {rank} never runs {listed}")


# --- the bubble table and figures of docs/pipeline.md ----------------------------------------

# (schedule, v, cost of F, B, W for a whole stage): a backward costs twice a forward, and
# zb-h1 splits it into B and W of one forward each.
TABLE_CASES = (
    ("gpipe", 1, (1.0, 2.0, 0.0)),
    ("1f1b", 1, (1.0, 2.0, 0.0)),
    ("interleaved", 2, (1.0, 2.0, 0.0)),
    ("interleaved", 4, (1.0, 2.0, 0.0)),
    ("zb-h1", 1, (1.0, 1.0, 1.0)),
)


def theory_bubble(
    schedule: str, p: int, m: int, v: int, t_f: float, t_b: float, t_w: float
) -> float:
    """Return the papers' bubble over ideal time for a schedule (stage costs; zb-h1 needs m ≥ p)."""
    if schedule == "zb-h1":
        return (p - 1) * (t_f + t_b - t_w) / (m * (t_f + t_b + t_w))
    return (p - 1) / (v * m)


def theory_table(p: int = 4, ms: Sequence[int] = (4, 8, 16)) -> list[dict[str, float | int | str]]:
    """Return, per schedule and m, the simulated bubble next to the papers' formula.

    Costs are per stage (F = 1, full backward = 2; a chunk costs 1/v of that); latency 0;
    rendezvous sends. ``bubble_use`` waits for a tensor where it is used, ``bubble_batch``
    after every batch; ``peak_stages`` is rank 0's peak activations in whole-stage units.
    """
    rows: list[dict[str, float | int | str]] = []
    for m in ms:
        for schedule, v, (t_f, t_b, t_w) in TABLE_CASES:
            actions = build(schedule, p, m, v)
            costs = (t_f / v, t_b / v, t_w / v)
            use = simulate(actions, *costs, rendezvous=True, wait="use")
            batch = simulate(actions, *costs, rendezvous=True, wait="batch")
            rows.append(
                {
                    "schedule": schedule,
                    "p": p,
                    "m": m,
                    "v": v,
                    "theory": theory_bubble(schedule, p, m, v, t_f, t_b, t_w),
                    "bubble_use": use.bubble_over_ideal,
                    "bubble_batch": batch.bubble_over_ideal,
                    "idle_fraction": use.idle_fraction,
                    "peak_stages": use.peak_in_flight[0] / v,
                }
            )
    return rows


def format_table(rows: Sequence[Mapping[str, float | int | str]]) -> str:
    """Return ``theory_table`` rows as a Markdown table."""
    lines = [
        "| schedule | p | m | v | theory | simulated (wait at use) | simulated (wait per batch) "
        "| idle fraction | peak activations, rank 0 (stages) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['schedule']} | {r['p']} | {r['m']} | {r['v']} | {r['theory']:.4f} "
            f"| {r['bubble_use']:.4f} | {r['bubble_batch']:.4f} | {r['idle_fraction']:.4f} "
            f"| {r['peak_stages']:g} |"
        )
    return "\n".join(lines)


def draw_figures(folder: str | Path, p: int = 4, m: int = 8) -> list[Path]:
    """Draw the simulated 1f1b, interleaved (v=2) and zb-h1 timelines of docs/pipeline.md."""
    from hpcllm.parallel.pipeline.timeline import draw

    paths = []
    for schedule, v, (t_f, t_b, t_w) in TABLE_CASES:
        if schedule == "gpipe" or v == 4:
            continue
        result = simulate(build(schedule, p, m, v), t_f / v, t_b / v, t_w / v, wait="use")
        name = f"sim_{schedule.replace('-', '')}_p{p}_m{m}" + (f"_v{v}" if v > 1 else "")
        title = (
            f"{schedule}, p={p}, m={m}"
            + (f", v={v}" if v > 1 else "")
            + f": bubble {result.bubble_over_ideal:.3f} of ideal time"
            + f" (theory {theory_bubble(schedule, p, m, v, t_f, t_b, t_w):.3f})"
        )
        paths.append(draw(result.intervals, Path(folder) / f"{name}.png", title, "stage forwards"))
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m hpcllm.parallel.pipeline.simulate [--table] [--figures DIR]``."""
    parser = argparse.ArgumentParser(
        prog="python -m hpcllm.parallel.pipeline.simulate",
        description="Simulated pipeline bubbles against the papers' formulas.",
    )
    parser.add_argument("--table", action="store_true", help="print the bubble table (p=4)")
    parser.add_argument("--figures", metavar="DIR", help="draw the timeline PNGs into DIR")
    args = parser.parse_args(argv)
    if args.table or not args.figures:
        print(format_table(theory_table()))
    if args.figures:
        for path in draw_figures(args.figures):
            print(path)


if __name__ == "__main__":
    main()
