"""Nothing silent: messages that say what was used and give advice that works, config input
that is refused when it cannot mean what it says (a misspelt key, a key given twice), paths
written as a shell would read them, and files that follow the umask."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from family_runs import SMALLEST, cli, train_args

from hpcllm.config import load_config
from hpcllm.errors import UserError

TINY = [
    *SMALLEST,
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.eval_interval=0",
    "train.eval_iters=1",
    "train.log_interval=1",
    "run.tensorboard=false",
]


def train(run: Path, data: Path, *sets: str, umask: int | None = None):
    return cli(*train_args(data, run, *TINY, "train.steps=2", *sets), umask=umask)


@pytest.mark.slow
def test_commands_that_read_a_run_name_the_step_they_used(stdlib, tmp_path):
    # Two checkpoints; the newest damaged: evaluate, generate and convert fall back to the
    # older one, say "reading" (not "resuming from") and name its step.
    run = tmp_path / "run"
    done = train(run, stdlib, "train.save_interval=1")
    assert done.returncode == 0, done.stderr
    newest = sorted((run / "checkpoints").glob("step_*"))[-1]
    (newest / "meta.json").write_text("{}")
    evaluated = cli("evaluate", "--checkpoint", str(run), "--data", str(stdlib), "--iters",
                       "1", "--json")  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads(evaluated.stdout)["step"] == 1
    assert "resuming" not in evaluated.stderr
    assert "reading step_00000001" in evaluated.stderr
    line = cli("evaluate", "--checkpoint", str(run), "--data", str(stdlib), "--iters", "1")
    assert line.stdout.startswith("step 1: loss ")
    sampled = cli("generate", "--checkpoint", str(run), "--prompt", "def", "--tokens", "3")
    assert sampled.returncode == 0 and "sampling from step 1" in sampled.stderr
    exported = cli("convert", "--checkpoint", str(run), "--to-hf", str(tmp_path / "hf"))
    assert exported.returncode == 0 and exported.stdout.strip().endswith("from step 1")


@pytest.mark.slow
def test_the_advice_of_a_model_change_refusal_works_on_that_folder(stdlib, tmp_path):
    run = tmp_path / "run"
    assert train(run, stdlib).returncode == 0
    refused = train(run, stdlib, "model.d_model=64", "train.steps=4")
    assert refused.returncode == 2 and "holds another model" in refused.stderr
    advice = refused.stderr.split("start over here with ")[1].split(" (which")[0].split()
    assert advice == ["--set", "run.resume=none", "--set", "run.overwrite=true"]
    followed = train(run, stdlib, "model.d_model=64", "run.resume=none", "run.overwrite=true")
    assert followed.returncode == 0, followed.stderr
    assert len(list(tmp_path.glob("run.old-*"))) == 1  # the earlier run, moved aside


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (["train.step=3"], "unknown key train.step (did you mean train.steps?)"),
        (["trian.steps=3"], "unknown config section trian (did you mean train?)"),
        (["model.nlayer=3"], "(did you mean model.n_layer?)"),
        (["train.zzz=3"], "unknown key train.zzz; train keys:"),  # nothing near: no guess
    ],
)
def test_a_misspelt_key_gets_the_nearest(sets, words):
    with pytest.raises(UserError) as err:
        load_config(None, sets)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_key_or_section_given_twice_is_refused_naming_both_lines(tmp_path):
    twice = tmp_path / "twice.yaml"
    twice.write_text("train:\n  steps: 3\n  lr: 0.1\n  steps: 5\n")
    with pytest.raises(UserError, match=r"'steps' is given twice, on lines 2 and 4"):
        load_config(twice)
    sections = tmp_path / "sections.yaml"
    sections.write_text("train:\n  steps: 3\nrun:\n  dir: x\ntrain:\n  lr: 0.1\n")
    done = cli("train", "--config", str(sections), "--print-config")
    assert done.returncode == 2
    assert "'train' is given twice, on lines 1 and 5; give each key once" in done.stderr
    assert done.stderr.count("\n") == 1


def test_paths_expand_home_and_variables_as_a_shell_would(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PROJECT", "p1")
    cfg = load_config(None, ["run.dir=~/runs/$PROJECT", "data.path=${PROJECT}/data"])
    assert cfg.run.dir == str(tmp_path / "home" / "runs" / "p1")
    assert cfg.data.path == "p1/data"
    cfg = load_config(None, ["train.steps=3", "run.dir=plain"])
    assert cfg.run.dir == "plain"  # nothing to expand


def test_a_config_that_is_a_folder_says_so(tmp_path):
    (tmp_path / "config.yaml").write_text("train:\n  steps: 3\n")
    done = cli("train", "--config", str(tmp_path), "--print-config")
    assert done.returncode == 2
    assert f"config file {tmp_path} is a folder" in done.stderr
    assert f"{tmp_path / 'config.yaml'} is one" in done.stderr


@pytest.mark.slow
def test_every_file_a_run_writes_follows_the_umask(stdlib, tmp_path):
    run = tmp_path / "run"
    done = train(run, stdlib, "train.save_interval=1", "run.tensorboard=true", umask=0o077)
    assert done.returncode == 0, done.stderr
    assert oct(stat.S_IMODE((stdlib / "tokenizer.json").stat().st_mode)) == "0o644"  # the source
    loose = [
        f"{path.relative_to(run)} {oct(stat.S_IMODE(path.stat().st_mode))}"
        for path in run.rglob("*")
        if stat.S_IMODE(path.stat().st_mode) & 0o077
    ]
    assert not loose, loose
    assert (run / "tokenizer.json").is_file() and list(run.rglob("events.out.tfevents*"))
