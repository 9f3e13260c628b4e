"""Pipeline schedules, their simulator and timeline drawings: pure Python, no torch, no MPI."""

import json

import pytest

from hpcllm.parallel.pipeline.schedule import (
    Action,
    Interval,
    Kind,
    alive_after,
    build,
    format_actions,
    peak_in_flight,
    peer_rank,
    rank_actions,
    stage_of,
)
from hpcllm.parallel.pipeline.simulate import (
    DeadlockError,
    ScheduleError,
    format_table,
    simulate,
    theory_table,
)
from hpcllm.parallel.pipeline.timeline import chrome_trace, draw

F, B, W = Kind.F, Kind.B, Kind.W
SF, RF, SB, RB = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B


# Every m up to 16 (below, at and above every p ≤ 8, multiples of p and not) and two larger.
GRID_M = (*range(1, 17), 24, 32)


def grid_cases():
    """Every (schedule, p, m, v) of the grid p ≤ 8, m in GRID_M, v ≤ 4."""
    for p in range(1, 9):
        for m in GRID_M:
            yield "gpipe", p, m, 1
            yield "1f1b", p, m, 1
            yield "zb-h1", p, m, 1
            if p > 1:
                for v in (2, 3, 4):
                    yield "interleaved", p, m, v


@pytest.fixture(scope="module")
def grid():
    """Replay the whole grid under the strictest model: rendezvous sends, waits per batch.

    Unit costs for every compute action (a chunk of an interleaved stage costs 1 as well; the
    bubble ratio does not depend on the scale). Returns {case: (bubble_over_ideal, peaks)}.
    """
    results = {}
    for case in grid_cases():
        actions = build(*case)
        result = simulate(actions, 1.0, 1.0, 1.0, rendezvous=True, wait="batch")
        results[case] = (result.bubble_over_ideal, result.peak_in_flight)
    return results


@pytest.mark.slow
def test_grid_is_deadlock_free_and_sound(grid):
    # The fixture raised on any deadlock, use-before-produce, missing action or swapped message.
    assert len(grid) == 8 * len(GRID_M) * 3 + 7 * len(GRID_M) * 3


@pytest.mark.parametrize("rendezvous", [False, True])
def test_waiting_at_use_is_deadlock_free(rendezvous):
    for schedule, p, m, v in grid_cases():
        if m in (1, 2, 3, 5, 8, 13, 32) and p in (1, 2, 3, 4, 8):
            simulate(
                build(schedule, p, m, v), 1.0, 2.0, 1.0, 0.1, rendezvous=rendezvous, wait="use"
            )


def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m(grid):
    for (schedule, p, m, _), (bubble, _) in grid.items():
        if schedule in ("gpipe", "1f1b"):
            assert bubble == pytest.approx((p - 1) / m, abs=1e-9), (schedule, p, m)


def test_interleaved_bubble_is_p_minus_1_over_v_m(grid):
    for (schedule, p, m, v), (bubble, _) in grid.items():
        if schedule != "interleaved":
            continue
        if m % p == 0:
            assert bubble == pytest.approx((p - 1) / (v * m), abs=1e-9), (p, m, v)
        else:  # supported, but the partial group of micro-batches costs extra
            assert bubble > (p - 1) / (v * m), (p, m, v)


def test_zb_h1_bubble_is_a_third_of_1f1b_at_equal_f_b_w():
    # 1f1b: F = 1, full backward = 2; zb-h1 splits it into B = 1 and W = 1.
    p = 4
    for m in (4, 8, 16):
        one_f_one_b = simulate(build("1f1b", p, m), 1.0, 2.0).bubble_over_ideal
        for rendezvous in (False, True):
            for wait in ("batch", "use"):
                zb = simulate(
                    build("zb-h1", p, m), 1.0, 1.0, 1.0, rendezvous=rendezvous, wait=wait
                ).bubble_over_ideal
                assert zb == pytest.approx((p - 1) * (1 + 1 - 1) / (m * 3), abs=1e-9)
                assert zb == pytest.approx(one_f_one_b / 3, abs=1e-9)
                assert zb <= 0.5 * one_f_one_b


def test_zb_h1_matches_the_paper_for_m_at_least_p(grid):
    for (schedule, p, m, _), (bubble, _) in grid.items():
        if schedule == "zb-h1" and m >= p:
            assert bubble == pytest.approx((p - 1) / (3 * m), abs=1e-9), (p, m)


def test_bubbles_hold_for_any_cost_ratio_when_waiting_at_use():
    for schedule, v, costs in (
        ("gpipe", 1, (1.0, 3.0, 0.0)),
        ("1f1b", 1, (1.0, 2.0, 0.0)),
        ("interleaved", 2, (0.5, 1.0, 0.0)),
        ("interleaved", 4, (0.25, 0.75, 0.0)),
    ):
        for p, m in ((2, 8), (4, 8), (4, 16), (8, 16)):
            actions = build(schedule, p, m, v)
            waits = ("use", "batch") if v == 1 else ("use",)  # see docs/pipeline.md
            for wait in waits:
                result = simulate(actions, *costs, rendezvous=True, wait=wait)
                assert result.bubble_over_ideal == pytest.approx((p - 1) / (v * m), abs=1e-9)


def test_latency_adds_to_the_bubble():
    actions = build("1f1b", 4, 8)
    base = simulate(actions, 1.0, 2.0)
    slow = simulate(actions, 1.0, 2.0, latency=0.1)
    assert slow.makespan > base.makespan
    assert base.idle_fraction == pytest.approx(3 / (8 + 3), abs=1e-9)  # (p-1)/(m+p-1)
    assert base.idle_fraction_per_rank == pytest.approx([3 / 11] * 4, abs=1e-9)


def test_peak_in_flight(grid):
    for (schedule, p, m, v), (_, peaks) in grid.items():
        if schedule == "gpipe":
            assert peaks == [m] * p
        elif schedule == "1f1b":
            assert peaks == [min(p - r, m) for r in range(p)]
        elif schedule == "zb-h1":  # W frees the activations: p everywhere, 1f1b's peak
            assert peaks == [min(p, m)] * p
            assert max(peaks) == min(p, m)
        elif m % p == 0:  # in chunks of 1/v stage: the warm-up plus one
            assert peaks[0] == min(m * v, (v + 1) * p - 1), (p, m, v)


def test_action_lists_for_p4_m8():
    assert [format_actions(a) for a in build("1f1b", 4, 8)] == [
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
    ]
    zb = build("zb-h1", 4, 8)
    # The paper's Figure 3: the first rank does W right after B, the last defers them.
    assert format_actions(zb[0]) == (
        "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7"
    )
    assert format_actions(zb[3]) == (
        "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7"
    )
    inter = build("interleaved", 4, 8, 2)[0]
    assert format_actions(inter).startswith("F0 F1 F2 F3 F0c1 F1c1 F2c1 F3c1 F4 F5 F6 B0c1")


def test_communication_placement():
    actions = build("1f1b", 4, 8)
    for rank, rank_list in enumerate(actions):
        for k, a in enumerate(rank_list):
            stage = stage_of(rank, a.chunk, 4)
            if a.kind is F and stage < 3:  # its send right after it
                assert rank_list[k + 1] == Action(SF, a.microbatch)
            if a.kind is RF:  # a receive comes before its consumer
                assert rank_list.index(Action(F, a.microbatch)) > k
    # Megatron's steady state: F, [send F, receive B], B, [send B, receive F].
    k = actions[1].index(Action(F, 3))
    assert format_actions(actions[1][k : k + 8], compute_only=False) == (
        "F3 SEND_F3 RECV_B1 B1 SEND_B1 RECV_F4 F4 SEND_F4"
    )
    assert all(a.kind.is_compute for a in build("1f1b", 1, 4)[0])
    assert peer_rank(SF, 3, 4) == 0 and peer_rank(RF, 0, 4) == 3
    assert peer_rank(SB, 0, 4) == 3 and peer_rank(RB, 3, 4) == 0
    with pytest.raises(ValueError, match="no peer"):
        peer_rank(F, 0, 4)


def test_rank_actions_is_one_rank_of_build():
    for case in (("1f1b", 4, 8, 1), ("interleaved", 4, 6, 3), ("zb-h1", 3, 5, 1)):
        schedule, p, m, v = case
        whole = build(*case)
        assert [rank_actions(schedule, p, r, m, v) for r in range(p)] == whole


def test_alive_after():
    actions = [Action(F, 0), Action(F, 1), Action(B, 0), Action(F, 2), Action(B, 1)]
    assert alive_after(actions) == [
        {(0, 0)},
        {(0, 0), (1, 0)},
        {(1, 0)},
        {(1, 0), (2, 0)},
        {(2, 0)},
    ]
    split = [Action(F, 0), Action(B, 0), Action(F, 1), Action(W, 0), Action(B, 1), Action(W, 1)]
    assert [len(s) for s in alive_after(split)] == [1, 1, 2, 1, 1, 0]
    assert peak_in_flight(split) == 2


# --- the simulator catches broken schedules --------------------------------------------------


def test_backward_before_its_forward_is_caught():
    actions = build("1f1b", 2, 2)
    last = actions[1]
    i, j = last.index(Action(F, 1)), last.index(Action(B, 1))
    last[i], last[j] = last[j], last[i]
    with pytest.raises(ScheduleError, match="backward before"):
        simulate(actions, 1.0, 1.0)


def test_swapping_two_steps_into_a_deadlock_is_caught():
    # gpipe p=2, m=2, rank 0 runs B0 before F1: B0 needs rank 1's B0, which comes after
    # rank 1's F1, which needs rank 0's F1.
    actions = build("gpipe", 2, 2)
    actions[0] = [
        Action(F, 0), Action(SF, 0), Action(RB, 0), Action(B, 0),
        Action(F, 1), Action(SF, 1), Action(RB, 1), Action(B, 1),
    ]  # fmt: skip
    for wait in ("batch", "use"):
        with pytest.raises(DeadlockError, match=r"rank 0 .*RECV_B0.*rank 1"):
            simulate(actions, 1.0, 1.0, wait=wait)


def test_receive_after_its_consumer_is_caught():
    actions = build("1f1b", 2, 2)
    rank1 = actions[1]
    k = rank1.index(Action(RF, 0))
    rank1[k], rank1[k + 1] = rank1[k + 1], rank1[k]
    with pytest.raises(ScheduleError, match="forward before its input activation"):
        simulate(actions, 1.0, 1.0)


def test_swapped_messages_on_one_channel_are_caught():
    actions = build("gpipe", 2, 2)
    rank0 = actions[0]
    i, j = rank0.index(Action(SF, 0)), rank0.index(Action(SF, 1))
    rank0.remove(Action(SF, 0))
    rank0.insert(j, Action(SF, 0))
    assert i < j
    with pytest.raises(ScheduleError, match="message order on channel rank 0 → rank 1"):
        simulate(actions, 1.0, 1.0)


def test_missing_duplicate_and_early_actions_are_caught():
    zb = build("zb-h1", 2, 3)
    zb[1].remove(Action(W, 2))
    with pytest.raises(ScheduleError, match="rank 1 never runs W2"):
        simulate(zb, 1.0, 1.0, 1.0)

    zb = build("zb-h1", 2, 3)
    zb[0].insert(0, Action(W, 0))
    with pytest.raises(ScheduleError, match="weight gradient before its backward"):
        simulate(zb, 1.0, 1.0, 1.0)

    twice = build("1f1b", 1, 2)
    twice[0].append(Action(B, 1))
    with pytest.raises(ScheduleError, match="runs twice"):
        simulate(twice, 1.0, 1.0)

    early = build("1f1b", 2, 1)
    k = early[0].index(Action(SF, 0))
    early[0].insert(0, early[0].pop(k))
    with pytest.raises(ScheduleError, match="not computed"):
        simulate(early, 1.0, 1.0)

    unmatched = build("1f1b", 2, 1)
    unmatched[1].remove(Action(RF, 0))
    with pytest.raises(ScheduleError):
        simulate(unmatched, 1.0, 1.0)

    no_peer = build("1f1b", 2, 1)
    no_peer[0].insert(0, Action(RF, 0))
    with pytest.raises(ScheduleError, match="no neighbour for RECV_F"):
        simulate(no_peer, 1.0, 1.0)


# --- bad inputs --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "schedule, p, m, v, message",
    [
        ("pipedream", 4, 8, 1, "unknown pipeline schedule 'pipedream'"),
        ("1f1b", 0, 8, 1, "p must be an integer ≥ 1, got 0"),
        ("1f1b", 4, 0, 1, "m must be an integer ≥ 1, got 0"),
        ("1f1b", 4, 8, 0, "v must be an integer ≥ 1, got 0"),
        ("gpipe", 4, 2.0, 1, "m must be an integer"),
        ("gpipe", True, 2, 1, "p must be an integer"),
        ("1f1b", 4, 8, 2, "virtual stages need schedule 'interleaved'"),
        ("gpipe", 4, 8, 2, "one model chunk per rank"),
        ("zb-h1", 4, 8, 2, "one model chunk per rank"),
        ("interleaved", 4, 8, 1, "needs v ≥ 2"),
        ("interleaved", 1, 8, 2, "needs p ≥ 2"),
    ],
)
def test_bad_sizes_raise_clear_errors(schedule, p, m, v, message):
    with pytest.raises(ValueError, match=message):
        build(schedule, p, m, v)
    with pytest.raises(ValueError, match=message):
        rank_actions(schedule, p, 0, m, v)


def test_bad_rank_and_simulator_arguments():
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, p=4\), got 4"):
        rank_actions("1f1b", 4, 4, 8)
    with pytest.raises(ValueError, match="wait must be one of"):
        simulate(build("1f1b", 2, 2), 1.0, 1.0, wait="never")
    with pytest.raises(ScheduleError, match="no actions"):
        simulate([[]], 1.0, 1.0)


# --- table, timeline and trace -----------------------------------------------------------------


def test_theory_table_matches_the_papers():
    rows = theory_table(4, (4, 8, 16))
    assert len(rows) == 15
    for row in rows:
        assert row["bubble_use"] == pytest.approx(row["theory"], abs=1e-9), row
        if row["schedule"] != "interleaved":
            assert row["bubble_batch"] == pytest.approx(row["theory"], abs=1e-9), row
    assert format_table(rows).count("\n") == 16


def test_draw_writes_a_png(tmp_path):
    result = simulate(build("interleaved", 4, 8, 2), 0.5, 1.0)
    path = draw(result.intervals, tmp_path / "figs" / "interleaved.png", "interleaved p=4 m=8")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000
    assert [p.name for p in path.parent.iterdir()] == ["interleaved.png"]  # no temp file left

    as_dicts = [
        [{"kind": i.kind.value, "microbatch": i.microbatch, "start": i.start, "end": i.end}
         for i in rank]
        for rank in simulate(build("zb-h1", 2, 3), 1.0, 1.0, 1.0).intervals
    ]  # fmt: skip
    assert draw(as_dicts, tmp_path / "zb.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="no intervals"):
        draw([[], []], tmp_path / "empty.png")
    with pytest.raises(ValueError, match="not an interval"):
        draw([[{"kind": "F"}]], tmp_path / "bad.png")


def test_chrome_trace_parses(tmp_path):
    result = simulate(build("1f1b", 4, 8), 1.0, 2.0)
    path = chrome_trace(result.intervals, tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == sum(len(rank) for rank in result.intervals)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {"rank 0", "rank 1", "rank 2", "rank 3"}
    first = next(e for e in complete if e["pid"] == 3 and e["name"] == "F0")
    assert first["tid"] == 3
    assert first["ts"] == pytest.approx(3e6)  # rank 3 starts after three forwards of 1 s
    assert first["dur"] == pytest.approx(1e6)
    assert Interval(F, 0, 0, 3.0, 4.0) in result.intervals[3]
