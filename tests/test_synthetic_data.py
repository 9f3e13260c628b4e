"""``data.synthetic``: random ids in place of prepared shards, deterministic, resumable, and
never mixed with real data in one run; the benchmarks that train need no corpus."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from datasets_fixtures import prepare_corpus
from family_runs import SMALLEST, cli, train_args
from mpirun import REPO

from hpcllm.datasets.reader import MicroBatchReader
from hpcllm.datasets.synthetic import BLOCK, SyntheticStream, synthetic_manifest
from hpcllm.errors import UserError
from hpcllm.evaluate import evaluate
from hpcllm.observe import read_metrics

TINY = [
    *SMALLEST,
    "train.micro_batch_size=2",
    "train.save_interval=1",
    "train.eval_interval=0",
    "train.log_interval=1",
    "run.tensorboard=false",
]


def _train(run, *extra: str) -> subprocess.CompletedProcess:
    return cli(*train_args(None, run, *TINY, *extra))


def _batches(seed: int, n: int, **kw) -> list[np.ndarray]:
    reader = MicroBatchReader(
        synthetic_manifest(300, seed), seq_len=40, micro_batch_size=3, seed=seed, **kw
    )
    out = []
    for batch in reader:
        out.append(np.concatenate([batch.input_ids.numpy(), batch.labels.numpy()[:, -1:]], 1))
        if len(out) == n:
            break
    return out


def test_synthetic_tokens_are_a_function_of_seed_split_and_position():
    manifest = synthetic_manifest(300, seed=5)
    stream = SyntheticStream(manifest, "train")
    whole = np.empty(3 * BLOCK, dtype=np.uint16)
    stream.read_into(whole, 0)
    assert whole.max() < 300 and len(np.unique(whole)) > 250  # the whole range, drawn
    # Any window, across block ends, is the same tokens the whole read gave.
    for start, size in ((0, 7), (BLOCK - 3, 10), (2 * BLOCK - 1, BLOCK + 1)):
        part = np.empty(size, dtype=np.uint16)
        SyntheticStream(manifest, "train").read_into(part, start)
        assert np.array_equal(part, whole[start : start + size])
    other = np.empty(100, dtype=np.uint16)
    SyntheticStream(synthetic_manifest(300, seed=6), "train").read_into(other, 0)
    assert not np.array_equal(other, whole[:100])
    SyntheticStream(manifest, "val").read_into(other, 0)
    assert not np.array_equal(other, whole[:100])
    with pytest.raises(IndexError):
        stream.read_into(other, manifest.n_tokens("train") - 10)


def test_the_reader_over_synthetic_data_is_deterministic_and_resumes_exactly():
    first = _batches(3, 6)
    assert all(np.array_equal(a, b) for a, b in zip(first, _batches(3, 6), strict=True))
    assert not np.array_equal(first[0], _batches(4, 1)[0])
    # Resuming at a micro-step's consumed samples yields what the uninterrupted reader did.
    resumed = _batches(3, 3, consumed_samples=3 * 3)
    assert all(np.array_equal(a, b) for a, b in zip(first[3:], resumed, strict=True))
    # Two data-parallel ranks read different samples.
    rank1 = _batches(3, 1, dp_rank=1, dp_size=2)[0]
    rank0 = _batches(3, 1, dp_rank=0, dp_size=2)[0]
    assert not np.array_equal(rank0, rank1)


@pytest.mark.slow
def test_a_synthetic_run_needs_no_data_and_records_what_it_learnt(tmp_path):
    run = tmp_path / "run"
    done = _train(run, "data.synthetic=true", "model.vocab_size=300", "train.steps=2")
    assert done.returncode == 0, done.stderr
    assert "synthetic (random ids over 300" in done.stdout + done.stderr
    record = json.loads((run / "synthetic-data.json").read_text())
    assert record == {"tokenizer": "synthetic", "vocab_size": 300, "seed": 1234}
    assert not (run / "tokenizer.json").exists()
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").open()]
    assert all(abs(loss - np.log(300)) < 0.6 for loss in losses), losses
    # It resumes on synthetic data, with the uninterrupted run's losses.
    more = _train(run, "data.synthetic=true", "model.vocab_size=300", "train.steps=4")
    assert more.returncode == 0, more.stderr
    straight = tmp_path / "straight"
    done = _train(straight, "data.synthetic=true", "model.vocab_size=300", "train.steps=4")
    assert done.returncode == 0, done.stderr
    resumed, whole = read_metrics(run), read_metrics(straight)  # (the resume's marker aside)
    assert [m["loss"] for m in resumed if m["step"] > 2] == pytest.approx(
        [m["loss"] for m in whole if m["step"] > 2], rel=1e-5
    )


@pytest.fixture(scope="module")
def byte_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    prepare_corpus(root / "corpus", root / "byte", tokenizer="byte", val_fraction=0.0)
    return root / "byte"


@pytest.mark.slow
def test_synthetic_and_real_data_never_resume_each_others_runs(byte_data, tmp_path):
    synthetic = tmp_path / "synthetic"
    sets = ("model.vocab_size=300", "train.steps=2")
    assert _train(synthetic, "data.synthetic=true", *sets).returncode == 0
    refused = _train(synthetic, f"data.path={byte_data}", "model.vocab_size=300", "train.steps=3")
    assert refused.returncode == 2
    message = refused.stderr.strip().splitlines()[-1]
    assert "trained on synthetic data" in message and "data.synthetic=true" in message
    with pytest.raises(UserError, match="trained on synthetic data"):
        evaluate(synthetic, byte_data, split="train", iters=1)
    real = tmp_path / "real"
    assert _train(real, f"data.path={byte_data}", *sets).returncode == 0
    refused = _train(real, "data.synthetic=true", "model.vocab_size=300", "train.steps=3")
    assert refused.returncode == 2
    message = refused.stderr.strip().splitlines()[-1]
    assert "data.synthetic has no tokenizer" in message, message
    assert (real / "tokenizer.json").is_file() and not (real / "synthetic-data.json").exists()
    generate = cli("generate", "--checkpoint", str(synthetic), "--prompt", "a", timeout=120)
    assert generate.returncode == 2 and "trained on synthetic data" in generate.stderr


@pytest.mark.slow
def test_a_missing_data_path_says_which_command_makes_it(tmp_path):
    done = _train(tmp_path / "run", f"data.path={tmp_path / 'nowhere'}", "train.steps=1")
    assert done.returncode == 2
    message = done.stderr.strip().splitlines()[-1]
    assert f"hpcllm prepare --out {tmp_path / 'nowhere'}" in message, message
    assert "data.synthetic=true" in message


@pytest.mark.slow
def test_bench_step_smoke_runs_in_an_empty_folder_of_a_fresh_checkout(tmp_path):
    """No data/ anywhere: bench step trains on synthetic data (the acceptance of issue 42)."""
    done = cli("bench", "step", "--cpu-smoke", "--rounds", "2", env={"PYTHONPATH": str(REPO)},
               cwd=tmp_path, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "token ids synthetic (random over 512)" in done.stdout
    assert "| hpcllm step (as configured) |" in done.stdout
    assert not (tmp_path / "data").exists()


@pytest.mark.slow
def test_bench_sync_without_its_data_is_one_line_naming_the_command(tmp_path):
    """bench sync keeps needing its data: one line that says how to make it, no traceback."""
    done = cli("bench", "sync", env={"PYTHONPATH": str(REPO)}, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "hpcllm prepare --out data/stdlib" in done.stderr
