"""Logs a batch job can read: a start-up banner, one line per log interval and no carriage
returns when stdout is a file; `train --print-config` and `train --help` document the config."""

from __future__ import annotations

import dataclasses
import re
import subprocess

import pytest
from family_runs import SMALLEST, cli, sets

from hpcllm.config import Config, load_config

SMALL = [
    *SMALLEST,
    "train.micro_batch_size=4",
    "train.global_batch_size=4",
    "train.log_interval=2",
    "train.eval_interval=0",
    "run.tensorboard=false",
]

INTERVAL = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \| step +(\d+)/6 \| samples +\d+ \| loss +[\d.]+ \| "
    r"lr [\d.e+-]+ \| grad_norm +[\d.]+ \| ms/step +[\d.]+ \| tokens/s +\d+ \| "
    r"TFLOP/s +[\d.]+ \| MFU +n/a \| mem MB +\d+ \| skipped 0( \| val_loss +[\d.]+)?$"
)


def _hpcllm(*args: str) -> subprocess.CompletedProcess:
    return cli(*args, env={"OMP_NUM_THREADS": "1"}, timeout=180)


@pytest.mark.slow
def test_a_batch_job_logs_a_banner_one_line_per_interval_and_a_run_summary(stdlib, tmp_path):
    folder = tmp_path / "run"
    run = _hpcllm(
        "train", *sets(*SMALL, "train.steps=6", f"data.path={stdlib}", f"run.dir={folder}")
    )
    assert run.returncode == 0, run.stderr
    assert "\r" not in run.stdout + run.stderr
    lines = run.stdout.splitlines()
    banner = [line for line in lines if line.startswith("hpcllm: ")]
    assert 6 <= len(banner) <= 10
    text = "\n".join(banner)
    for part in ("torch ", "launcher single", "t=1 p=1 d=1 v=1, world size 1", "starts fresh"):
        assert part in text
    assert f"run folder {folder}" in text and "M parameters" in text
    assert f"data {stdlib}" in text and "train tokens" in text
    assert str(folder / "config.yaml") in text
    steps = [int(m.group(1)) for line in lines if (m := INTERVAL.match(line))]
    assert steps == [2, 4, 6], run.stdout
    # The validated step (the last) shows its validation loss.
    validated = [m.group(2) is not None for line in lines if (m := INTERVAL.match(line))]
    assert validated == [False, False, True]
    assert lines.index(banner[-1]) < min(i for i, line in enumerate(lines) if INTERVAL.match(line))
    assert re.search(r"^run mean \d+ tokens/s", run.stdout, re.M)
    assert re.search(r"^last interval \d+ tokens/s", run.stdout, re.M)
    assert re.search(r"^wall time [\d.]+ s training, [\d.]+ s in all$", run.stdout, re.M)


@pytest.mark.slow
def test_print_config_round_trips_and_touches_nothing(stdlib, tmp_path):
    folder = tmp_path / "run"
    items = [
        *SMALL,
        "parallel.tp=2",
        "train.global_batch_size=8",
        f"data.path={stdlib}",
        f"run.dir={folder}",
    ]
    run = _hpcllm("train", *sets(*items), "--print-config", "--world-size", "4")
    assert run.returncode == 0, run.stderr
    printed = tmp_path / "printed.yaml"
    printed.write_text(run.stdout)
    assert load_config(printed) == load_config(None, items)
    assert load_config(printed) != Config()
    assert not folder.exists()


@pytest.mark.slow
def test_print_config_of_synthetic_data_ignores_the_prepared_data_at_data_path(stdlib, tmp_path):
    # Training on synthetic ids reads nothing at data.path, so a smaller vocabulary than the
    # prepared data's tokenizer (257, bytes) is no error there, and none in --print-config.
    items = [*SMALL, "data.synthetic=true", "model.vocab_size=128", f"data.path={stdlib}"]
    run = _hpcllm("train", *sets(*items, f"run.dir={tmp_path / 'run'}"), "--print-config")
    assert run.returncode == 0, run.stderr
    assert "vocab_size: 128" in run.stdout


@pytest.mark.slow
def test_print_config_refuses_a_world_size_the_grid_cannot_use(stdlib, tmp_path):
    folder = tmp_path / "run"
    items = [
        *SMALL,
        "parallel.tp=2",
        "train.global_batch_size=8",
        f"data.path={stdlib}",
        f"run.dir={folder}",
    ]
    run = _hpcllm("train", *sets(*items), "--print-config", "--world-size", "3")
    assert run.returncode == 2
    assert run.stdout == ""
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert not folder.exists()


def test_train_help_gives_every_key_its_default():
    run = _hpcllm("train", "--help")
    assert run.returncode == 0
    cfg = Config()
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for key in dataclasses.fields(values):
            value = getattr(values, key.name)
            if value is None or isinstance(value, bool):
                shown = {None: "null", True: "true", False: "false"}[value]
            else:
                shown = str(value)
            pattern = rf"^  {section.name}\.{key.name} +\S.*? {re.escape(shown)}\b"
            assert re.search(pattern, run.stdout, re.M), f"{section.name}.{key.name}"
    assert "[fp32 | bf16 | fp16]" in run.stdout
    from hpcllm.config import fields

    for f in fields():  # each key's description, on the line under it
        assert re.search(rf"^  {re.escape(f.key)} .*\n      {re.escape(f.help)}$", run.stdout, re.M)
