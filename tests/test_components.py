"""The trainer's components alone: the cadence rule, the typed state, the divergence guard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpcllm.errors import UserError
from hpcllm.train.divergence import DivergenceGuard
from hpcllm.train.optim import build_scaler
from hpcllm.train.state import Cadence, TrainState

FIXTURE = Path(__file__).resolve().parent / "recorded" / "checkpoint_before_components"


@pytest.mark.parametrize("interval", [0, 1, 3, 4, 10, 25])
@pytest.mark.parametrize("last", [1, 10, 12])
def test_cadence_acts_every_interval_and_at_the_last_step_and_knows_its_next(interval, last):
    cadence = Cadence(interval)
    due = [s for s in range(1, last + 1) if cadence.due(s, last)]
    every = set(range(interval, last + 1, interval)) if interval else set()
    assert due == sorted(every | {last})
    for step in range(last):
        assert cadence.next_due(step, last) == min(s for s in due if s > step)


def test_train_state_keeps_meta_json_keys_and_reads_checkpoints_written_before_it():
    meta = json.loads((FIXTURE / "checkpoints" / "step_00000002" / "meta.json").read_text())
    state = TrainState.from_meta(meta, FIXTURE, global_batch=meta["global_batch"])
    assert (state.step, state.consumed_samples, state.skipped_steps) == (2, 32, 0)
    written = state.meta(meta["global_batch"], meta["vocab_size"])
    assert written == {k: meta[k] for k in written}  # the keys and values main wrote
    # A checkpoint older than the counters reads them as 0; another global batch is refused.
    assert TrainState.from_meta({"step": 5}, FIXTURE, 8) == TrainState(step=5)
    with pytest.raises(UserError, match="global batch 16; this run has 8"):
        TrainState.from_meta(meta, FIXTURE, global_batch=8)
    state.advance(3, 16)
    assert (state.step, state.consumed_samples) == (5, 80)


def test_divergence_guard_stops_after_max_bad_steps_in_a_row_and_counts_every_skip():
    guard = DivergenceGuard(3, build_scaler("fp32", torch.device("cpu")), torch.device("cpu"))
    state = TrainState()
    pattern = [True, True, False, True, True]  # a good step breaks the streak
    for skipped in pattern:
        guard.count_step(torch.tensor(skipped))
        state.step += 1
    assert guard.check(state) is None and state.skipped_steps == 4
    guard.count_step(torch.tensor(True))
    state.step += 1
    message = guard.check(state)
    assert message and "the last 3 steps (to step 6)" in message and "of step 3" in message
    assert state.skipped_steps == 5  # read once: a second check adds nothing
    guard.check(state)
    assert state.skipped_steps == 5
    guard.count_segment(skipped_steps=2, bad_steps_in_a_row=0)
    assert guard.check(state) is None and state.skipped_steps == 7


def test_the_step_strategy_is_chosen_once_from_the_engine():
    from types import SimpleNamespace

    from hpcllm.train.step import SegmentStep, SynchronousStep, choose_step

    class Segments:  # what RunsSegments asks of an engine: run_segment
        def run_segment(self, first_step, steps, worker):
            raise AssertionError("not run here")

    def runner(runs_segments: bool) -> SimpleNamespace:
        engine = Segments() if runs_segments else SimpleNamespace(name="ddp")
        return SimpleNamespace(cfg=None, grid=None, model=SimpleNamespace(engine=engine))

    guard = DivergenceGuard(1, build_scaler("fp32", torch.device("cpu")), torch.device("cpu"))
    hooks: list = []
    synchronous = choose_step(runner(False), guard, 16, hooks)
    assert isinstance(synchronous, SynchronousStep) and synchronous.grad_hooks is hooks
    segment = choose_step(runner(True), guard, 16, hooks)
    assert isinstance(segment, SegmentStep) and isinstance(segment.engine, Segments)


def test_the_trainer_stays_a_short_loop_over_its_components():
    # The sizes the trainer-components issue set: the trainer module, its loop, and every
    # function of hpcllm/train/; and the loop asks no engine what kind it is.
    import ast
    import inspect

    from hpcllm.train import trainer

    train = Path(trainer.__file__).parent
    assert len(Path(trainer.__file__).read_text().splitlines()) <= 500
    lengths = {}
    for path in sorted(train.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lengths[f"{path.name}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert lengths["trainer.py:run"] <= 80
    assert max(lengths.values()) <= 120, max(lengths.items(), key=lambda item: item[1])
    loop = inspect.getsource(trainer.Trainer.run)
    assert "runs_segments" not in loop and "engine" not in loop
