"""metrics.jsonl and TensorBoard keep a run folder's whole history: a resumed run appends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcllm.observe import RESUMED, MetricsLog, read_metrics


def _log(run: Path, start_step: int, losses: dict[int, float], tensorboard: bool) -> None:
    log = MetricsLog(run, tensorboard=tensorboard, start_step=start_step)
    for step, loss in losses.items():
        log.write({"step": step, "loss": loss})
    log.close()


def _tensorboard_losses(run: Path) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return {e.step: round(e.value, 3) for e in events.Scalars("loss")}


def test_a_resumed_run_appends_and_its_later_lines_win(tmp_path):
    # The first process logged steps 1-4 and died after its checkpoint at step 2; the second
    # resumes from 2 and logs 3 and 4 again.
    _log(tmp_path, 0, {1: 4.0, 2: 3.0, 3: 2.0, 4: 1.0}, tensorboard=False)
    first = (tmp_path / "metrics.jsonl").read_text()
    _log(tmp_path, 2, {3: 30.0, 4: 40.0}, tensorboard=False)
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text.startswith(first)  # nothing the first process wrote is gone
    marker = json.loads(text[len(first) :].splitlines()[0])
    assert marker[RESUMED] == 2
    assert {r["step"]: r["loss"] for r in read_metrics(tmp_path)} == {
        1: 4.0,
        2: 3.0,
        3: 30.0,
        4: 40.0,
    }
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    history = read_metrics(tmp_path, history=True)
    assert [r.get("step", "marker") for r in history] == [1, 2, 3, 4, "marker", 3, 4]


def test_two_resumes_from_earlier_and_earlier_steps(tmp_path):
    _log(tmp_path, 0, {1: 1.0, 2: 2.0, 3: 3.0}, tensorboard=False)
    _log(tmp_path, 2, {3: 30.0, 4: 40.0, 5: 50.0}, tensorboard=False)
    _log(tmp_path, 1, {2: 200.0}, tensorboard=False)
    assert {r["step"]: r["loss"] for r in read_metrics(tmp_path)} == {1: 1.0, 2: 200.0}
    assert len(read_metrics(tmp_path, history=True)) == 3 + 1 + 3 + 1 + 1


def test_tensorboard_shows_the_resumed_steps_not_the_lost_ones(tmp_path):
    _log(tmp_path, 0, {1: 4.0, 2: 3.0, 3: 2.0, 4: 1.0}, tensorboard=True)
    files = sorted((tmp_path / "tensorboard").iterdir())
    sizes = {f: f.stat().st_size for f in files}
    _log(tmp_path, 2, {3: 30.0, 4: 40.0}, tensorboard=True)
    # The first events file is untouched; the resumed run wrote a second one.
    assert all(f.stat().st_size == size for f, size in sizes.items())
    assert len(list((tmp_path / "tensorboard").iterdir())) == len(files) + 1
    assert _tensorboard_losses(tmp_path) == {1: 4.0, 2: 3.0, 3: 30.0, 4: 40.0}
    # The second file says so itself: a session start at step 3, which makes viewers purge
    # the earlier file's steps from 3 on even where they read files out of order.
    (new,) = set((tmp_path / "tensorboard").iterdir()) - set(files)
    assert _session_starts(new) == [3]


def _session_starts(path: Path) -> list[int]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.proto.event_pb2 import SessionLog

    return [
        event.step
        for event in EventFileLoader(str(path)).Load()
        if event.HasField("session_log") and event.session_log.status == SessionLog.START
    ]


def test_an_moe_steps_expert_loads_are_tensorboard_histograms(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tmp_path, tensorboard=True)
    log.write({"step": 1, "loss": 1.0, "moe_expert_load": {"3": [0.1, 0.2, 0.3, 0.4]}})
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    (histogram,) = events.Histograms("moe_expert_load/block3")
    assert histogram.step == 1 and histogram.histogram_value.num == 4
    assert histogram.histogram_value.sum == pytest.approx(1.0)


def test_nvtx_ranges_fall_back_to_torchs_markers_without_the_nvtx_package(monkeypatch):
    """A GPU image without the ``nvtx`` package (pip install --no-deps) still runs every
    step: the ranges go to torch's own NVTX markers (on CUDA) or nowhere."""
    import functools
    import sys

    import torch

    from hpcllm import observe

    monkeypatch.setitem(sys.modules, "nvtx", None)  # import nvtx raises ImportError
    observe._nvtx_package.cache_clear()  # asked once per process: ask again
    monkeypatch.setattr(observe, "_nvtx_package", functools.cache(observe._nvtx_package))
    pushed = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: pushed.append(name))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: pushed.append("pop"))
    with observe.nvtx_range("optimizer"):
        pushed.append("inside")
    assert pushed == ["optimizer", "inside", "pop"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with observe.nvtx_range("optimizer"):
        pushed.append("cpu")
    assert pushed[-1] == "cpu" and len(pushed) == 4
    observe._nvtx_package.cache_clear()
