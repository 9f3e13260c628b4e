"""Data and checkpoints that the wrong input can no longer damage: data from another tokenizer
of the same vocabulary size, a rejected prepare over an existing dataset, checkpoints without
a manifest, staging folders a killed command left behind."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest
from datasets_fixtures import prepare_corpus
from family_runs import SMALLEST, cli, train, train_args

from hpcllm.errors import UserError
from hpcllm.evaluate import evaluate

TINY = [
    *SMALLEST,
    "train.micro_batch_size=2",
    "train.save_interval=1",
    "train.eval_interval=0",
    "train.log_interval=1",
    "run.tensorboard=false",
]


def _train(data, run, *extra: str) -> subprocess.CompletedProcess:
    return cli(*train_args(data, run, *TINY, *extra))


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """Two datasets of one corpus whose tokenizers both have 257 ids: raw bytes, and a BPE
    with no merges, which numbers the bytes otherwise."""
    root = tmp_path_factory.mktemp("safety")
    prepare_corpus(root / "corpus", root / "byte", tokenizer="byte", val_fraction=0.0)
    prepare_corpus(
        root / "corpus2", root / "bpe", tokenizer="bpe", vocab_size=257, val_fraction=0.0
    )
    for name in ("byte", "bpe"):
        assert (
            json.loads((root / name / "manifest.json").read_text())["tokenizer"]["vocab_size"]
            == 257
        )
    return root / "byte", root / "bpe"


@pytest.mark.slow
def test_data_of_another_tokenizer_with_the_same_vocabulary_is_refused(datasets, tmp_path):
    byte, bpe = datasets
    run = tmp_path / "run"
    assert _train(byte, run, "train.steps=2").returncode == 0
    tokenizer = (run / "tokenizer.json").read_bytes()
    hashes = [
        json.loads((d / "manifest.json").read_text())["tokenizer"]["sha256"] for d in datasets
    ]
    resumed = _train(bpe, run, "train.steps=4")
    assert resumed.returncode == 2, resumed.stderr
    message = resumed.stderr.strip().splitlines()[-1]
    assert "another tokenizer" in message and all(h[:12] in message for h in hashes), message
    assert (run / "tokenizer.json").read_bytes() == tokenizer
    assert not (run / "checkpoints" / "step_00000003").exists()
    with pytest.raises(UserError, match="another tokenizer"):
        evaluate(run, bpe, split="train", iters=1)
    assert evaluate(run, byte, split="train", iters=1).loss > 0  # its own data still evaluates


@pytest.mark.slow
def test_a_run_without_a_tokenizer_takes_the_datas_on_its_first_training(datasets, tmp_path):
    byte, _ = datasets
    run = tmp_path / "run"
    assert _train(byte, run, "train.steps=2").returncode == 0
    (run / "tokenizer.json").unlink()  # as a run imported without a tokenizer
    assert _train(byte, run, "train.steps=3").returncode == 0
    assert (run / "tokenizer.json").read_bytes() == (byte / "tokenizer.json").read_bytes()


def _drop_manifest(run, step: int) -> None:
    """Make the checkpoint of ``step`` look as a format-1 one does: no manifest, no version."""
    folder = run / "checkpoints" / f"step_{step:08d}"
    (folder / "manifest.json").unlink()
    meta = json.loads((folder / "meta.json").read_text())
    del meta["format_version"]
    (folder / "meta.json").write_text(json.dumps(meta))


@pytest.mark.slow
def test_a_checkpoint_without_its_manifest_loads_only_when_asked(datasets, tmp_path):
    byte, _ = datasets
    run = tmp_path / "run"
    assert _train(byte, run, "train.steps=2").returncode == 0
    _drop_manifest(run, 2)
    refused = _train(byte, run, "train.steps=3")
    assert refused.returncode == 2
    assert (
        "has no manifest.json" in refused.stderr and "run.allow_unverified=true" in refused.stderr
    )
    evaluate_words = ["evaluate", "--data", str(byte), "--split", "train", "--iters", "1"]
    for words in (evaluate_words, ["generate", "--prompt", "x", "--tokens", "2"]):
        got = cli(*words, "--checkpoint", str(run))
        assert got.returncode == 2 and "--allow-unverified" in got.stderr, got.stderr
        cli(*words, "--checkpoint", str(run), "--allow-unverified", check=True)
    resumed = _train(byte, run, "train.steps=3", "run.allow_unverified=true")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from it unchecked" in resumed.stderr + resumed.stdout


def _dead_pid() -> int:
    """Return the id of a process that has ended."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.slow
def test_staging_folders_of_dead_writers_are_removed_and_live_ones_kept(datasets, tmp_path):
    byte, _ = datasets
    run = tmp_path / "run"
    assert _train(byte, run, "train.steps=2").returncode == 0
    host = socket.gethostname()
    # What a killed `convert --to-hf exports/hf` left, a live writer's folder, another host's.
    exports = tmp_path / "exports"
    dead = exports / f".hf.partial-{host}-{_dead_pid()}"
    live = exports / f".other.partial-{host}-{os.getpid()}"
    remote = exports / f".hf.partial-elsewhere-{_dead_pid()}"
    for folder in (dead, live, remote):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"\0" * 1024)
    got = cli("convert", "--checkpoint", str(run), "--to-hf", str(exports / "hf"), check=True)
    assert f"removed {dead}, left by process" in got.stderr
    assert not dead.exists() and live.is_dir() and remote.is_dir()
    assert (exports / "hf" / "config.json").is_file()


@pytest.mark.slow
def test_a_checkpoint_a_killed_job_did_not_finish_is_removed_under_the_run_lock(datasets, tmp_path):
    byte, _ = datasets
    run = tmp_path / "run"
    assert _train(byte, run, "train.steps=2").returncode == 0
    unfinished = run / "checkpoints" / ".step_00000003.partial"
    unfinished.mkdir()
    (unfinished / "model_tp00_pp00.pt").write_bytes(b"\0" * 4096)
    stale = run / f".metrics.jsonl.partial-{socket.gethostname()}-{_dead_pid()}"
    stale.write_text("{}")
    resumed = _train(byte, run, "train.steps=3")
    assert resumed.returncode == 0, resumed.stderr
    said = resumed.stderr + resumed.stdout
    assert f"removed {unfinished}, a checkpoint an earlier job did not finish" in said
    assert f"removed {stale}, left by process" in said
    assert not unfinished.exists() and not stale.exists()
    assert (run / "checkpoints" / "step_00000003").is_dir()


@pytest.mark.slow
def test_under_mpirun_every_rank_refuses_data_of_another_tokenizer(datasets, tmp_path):
    byte, bpe = datasets
    run = tmp_path / "run"

    train(2, byte, run, *TINY, "train.steps=2").check()
    tokenizer = (run / "tokenizer.json").read_bytes()
    refused = train(2, bpe, run, *TINY, "train.steps=4")
    assert refused.returncode != 0
    assert "another tokenizer" in refused.stderr + refused.stdout
    assert (run / "tokenizer.json").read_bytes() == tokenizer
