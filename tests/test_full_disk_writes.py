"""A full disk under metrics.jsonl, TensorBoard's events and the next checkpoint: one line, or
(``run.save_failure: warn``) a warning and the run goes on."""

from __future__ import annotations

import errno
import os
from collections import namedtuple

import pytest
from family_runs import SMALLEST
from full_disk import open_on_full_disk

from hpcllm import observe
from hpcllm.config import load_config
from hpcllm.errors import UserError
from hpcllm.train import checkpoint
from hpcllm.train import checkpointer as checkpointer_module
from hpcllm.train.trainer import Trainer

SMALL = [
    *SMALLEST,
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.log_interval=1",
    "train.eval_interval=0",
    "train.eval_iters=1",
    "train.steps=4",
    "train.save_interval=1",
]


def _train(stdlib, run, *sets):
    cfg = load_config(None, [*SMALL, f"data.path={stdlib}", f"run.dir={run}", *sets])
    with Trainer(cfg) as trainer:
        return trainer.run(progress=False)


def _full_metrics(monkeypatch):
    real_open = open

    def open_full(path, mode="r", *args, **kwargs):
        if str(path).endswith("metrics.jsonl") and "a" in mode:
            return open_on_full_disk(path, mode, *args, **kwargs)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(observe, "open", open_full, raising=False)


def test_metrics_on_a_full_disk_end_the_run_in_one_line(stdlib, tmp_path, monkeypatch):
    _full_metrics(monkeypatch)
    with pytest.raises(UserError) as caught:
        _train(stdlib, tmp_path / "run", "run.tensorboard=false")
    message = str(caught.value)
    assert "\n" not in message and "metrics.jsonl failed: No space left on device" in message
    assert "run.save_failure=warn" in message


def test_metrics_on_a_full_disk_warn_and_go_on_when_asked(stdlib, tmp_path, monkeypatch, capsys):
    _full_metrics(monkeypatch)
    summary = _train(stdlib, tmp_path / "run", "run.tensorboard=false", "run.save_failure=warn")
    assert summary["step"] == 4 and checkpoint.step_of(checkpoint.latest(tmp_path / "run")) == 4
    warned = [line for line in capsys.readouterr().err.splitlines() if "metrics.jsonl" in line]
    assert len(warned) == 1 and "the run goes on without it" in warned[0]


def test_tensorboard_on_a_full_disk_ends_the_run_in_one_line(stdlib, tmp_path, monkeypatch):
    from torch.utils.tensorboard import SummaryWriter

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(SummaryWriter, "add_scalar", full)
    with pytest.raises(UserError, match="TensorBoard events failed: No space left on device"):
        _train(stdlib, tmp_path / "run", "run.tensorboard=true")


def test_a_save_that_would_not_fit_is_refused_before_writing(stdlib, tmp_path, monkeypatch):
    # After the first checkpoint, each save checks the free space against its size: the
    # newest stays whole, and no partial folder is left.
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(
        checkpointer_module.shutil, "disk_usage", lambda _path: usage(10**6, 10**6 - 1000, 1000)
    )
    run = tmp_path / "run"
    with pytest.raises(UserError) as caught:
        _train(stdlib, run, "run.tensorboard=false", "run.keep_checkpoints=2")
    message = str(caught.value)
    assert "\n" not in message and "GB free (keep_checkpoints: 2 keeps 2" in message
    assert checkpoint.step_of(checkpoint.latest(run)) == 1
    assert checkpoint.verify(checkpoint.latest(run)).status == "ok"
    assert not list((run / "checkpoints").glob(".*partial*"))


def test_a_full_disk_under_the_tokenizer_names_it_and_leaves_no_part_of_it(
    stdlib, tmp_path, monkeypatch
):
    from hpcllm import files

    real_open = open

    def open_full(path, mode="r", *args, **kwargs):
        if ".tokenizer.json.partial" in str(path) and "w" in mode:
            return open_on_full_disk(path, mode, *args, **kwargs)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(files, "open", open_full, raising=False)
    run = tmp_path / "run"
    with pytest.raises(UserError) as caught:
        _train(stdlib, run, "run.tensorboard=false")
    message = str(caught.value)
    assert "\n" not in message and "tokenizer.json" in message and "config.yaml" not in message
    assert "No space left on device" in message
    # Written whole or not at all: no truncated tokenizer, no partial file beside it.
    assert not (run / "tokenizer.json").exists()
    assert not [p.name for p in run.iterdir() if ".partial" in p.name]
