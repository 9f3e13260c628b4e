"""Every layout gives the losses the trainer gave before all layouts took the pipeline runtime.

Until the step paths merged, the trainer had two: one for pipelines and one for everything
else. ``tests/recorded/losses_before_one_step_path.json`` holds the training and validation
losses that commit d60f3a4 (the last with two paths) gave for the cases below, run exactly
as :func:`test_losses_equal_the_recorded_ones` runs them: the tiny preset at fp32 on a
deterministic corpus, at d = 1, at d = 2 under each engine, at t = 2 with and without
sequence parallelism, and at p = 2 with 1f1b and interleaved. A change that alters what is
computed, not only how the code is laid out, fails here. The checkpoint each case ends with
is compared too (``checkpoints_before_one_step_path.json``: files, keys, shapes), so
checkpoints stay readable by the code before the change and after it.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from family_runs import cli, train

REPO = Path(__file__).resolve().parent.parent
RECORDED = REPO / "tests" / "recorded" / "losses_before_one_step_path.json"
RECORDED_FORMAT = REPO / "tests" / "recorded" / "checkpoints_before_one_step_path.json"
TINY_CPU = REPO / "jobs" / "configs" / "tiny-cpu.yaml"

# The tiny preset (4 layers, d_model 128, seq 128) at fp32, 4 steps of 32 sequences.
COMMON = [
    "train.steps=4",
    "train.global_batch_size=32",
    "train.micro_batch_size=8",
    "train.log_interval=1",
    "train.eval_interval=0",
    "train.save_interval=0",
    "train.precision=fp32",
    "run.tensorboard=false",
    "run.resume=none",
]

# name: (ranks, overrides)
CASES: dict[str, tuple[int, list[str]]] = {
    "d1": (1, []),
    "d2-ddp": (2, ["parallel.dp_engine=ddp"]),
    "d2-horovod": (2, ["parallel.dp_engine=horovod"]),
    "d2-ps": (2, ["parallel.dp_engine=ps"]),
    "t2": (2, ["parallel.tp=2"]),
    "t2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "p2-1f1b": (2, ["parallel.pp=2", "parallel.schedule=1f1b"]),
    "p2-interleaved": (2, ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.vpp=2"]),
    # Mixed precision: the scaler's skip and back-off path (fp16) and bf16 autocast.
    "d1-bf16": (1, ["train.precision=bf16"]),
    "d1-fp16": (1, ["train.precision=fp16"]),
    "d2-ps-fp16": (2, ["parallel.dp_engine=ps", "train.precision=fp16"]),
    # Dropout: the default and tensor-parallel random streams, replayed by zb-h1's W.
    "t2-sp-dropout": (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "model.dropout=0.1"]),
    "p2-zb-h1-dropout": (2, ["parallel.pp=2", "parallel.schedule=zb-h1", "model.dropout=0.1"]),
}

# The LR moves with the step; how AdamW runs (fused since the bad-step skip, foreach before)
# is reset on load, not restored (hpcllm.train.optim.load_optimizer_state).
IGNORED_GROUP_KEYS = ("lr", "fused", "foreach", "capturable", "differentiable")
# RNG states added since, which a reader without them ignores (checkpoint.set_rng_state reads
# the states it knows by name) and a reader with them does without (a fresh seed): each tp
# rank's tensor-parallel dropout stream.
ADDED_RNG_KEYS = ("tp_stream",)

_WORDS = "def return import class self lambda yield with as for in if else while try".split()


def write_corpus(folder: Path) -> None:
    """Write 64 deterministic text documents (about 160 KB) into ``folder``."""
    rng = random.Random(0)
    folder.mkdir(parents=True)
    for i in range(64):
        words = [rng.choice(_WORDS) + rng.choice(["", "_x", "(y)", ":", "\n"]) for _ in range(400)]
        (folder / f"doc{i:02d}.txt").write_text(" ".join(words))


def prepare_data(scratch: Path) -> Path:
    """Write the corpus and its byte-level shards under ``scratch``; return the data folder."""
    write_corpus(scratch / "corpus")
    out = scratch / "data"
    cli("prepare", "--input", str(scratch / "corpus"), "--out", str(out), "--tokenizer", "byte",
        "--val-fraction", "0.1", "--quiet", check=True)  # fmt: skip
    return out


def train_case(ranks: int, data: Path, run_dir: Path, overrides: list[str], timeout: float) -> None:
    """Train one case (the tiny preset, :data:`COMMON`, ``overrides``) on ``ranks`` ranks."""
    train(ranks, data, run_dir, *COMMON, *overrides, config=TINY_CPU, timeout=timeout).check()


def checkpoint_format(run_dir: Path) -> dict[str, Any]:
    """Return what a reader of the run's last checkpoint relies on: files, keys and shapes.

    Per shard file: the model's keys and shapes, the optimizer state's parameter indices with
    their tensors' shapes, the parameter groups' indices and settings, the scaler's and RNG
    states' keys; and the keys of meta.json.
    """
    folder = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    shards = {}
    for path in sorted(folder.glob("*.pt")):
        shard = torch.load(path, map_location="cpu", weights_only=True)
        optimizer = shard["optimizer"]
        shards[path.name] = {
            "keys": sorted(shard),
            "model": {k: list(v.shape) for k, v in shard["model"].items()},
            "optimizer_state": {
                str(index): {k: list(torch.as_tensor(v).shape) for k, v in state.items()}
                for index, state in optimizer["state"].items()
            },
            "param_groups": [
                {k: v for k, v in group.items() if k not in IGNORED_GROUP_KEYS}
                for group in optimizer["param_groups"]
            ],
            "scaler": sorted(shard["scaler"]),
            "rng": sorted(k for k in shard["rng"] if k not in ADDED_RNG_KEYS),
        }
    found = {"meta": sorted(json.loads((folder / "meta.json").read_text())), "shards": shards}
    return json.loads(json.dumps(found))  # as the recorded file reads back: tuples as lists


def read_losses(run_dir: Path) -> dict[str, list[float]]:
    """Return a run folder's training losses in step order, and its validation losses."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return {
        "loss": [r["loss"] for r in records],
        "val_loss": [r["val_loss"] for r in records if "val_loss" in r],
    }


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_data(tmp_path_factory.mktemp("one-step-path"))


@pytest.mark.mpi
@pytest.mark.parametrize("case", sorted(CASES))
def test_losses_equal_the_recorded_ones(case: str, data: Path, tmp_path: Path) -> None:
    ranks, overrides = CASES[case]
    run_dir = tmp_path / case
    train_case(ranks, data, run_dir, overrides, timeout=300)
    recorded = json.loads(RECORDED.read_text())[case]
    got = read_losses(run_dir)
    assert len(got["loss"]) == len(recorded["loss"]) == 4
    assert len(got["val_loss"]) == len(recorded["val_loss"]) == 1
    # Under autocast the biases are now added inside the half-precision matmul (addmm, as
    # plain PyTorch does), not in fp32 after it: a few parts in a million after 4 steps.
    mixed = any(o in ("train.precision=bf16", "train.precision=fp16") for o in overrides)
    tol = 1e-5 if mixed else 1e-6
    for key in ("loss", "val_loss"):
        for new, old in zip(got[key], recorded[key], strict=True):
            assert math.isclose(new, old, rel_tol=tol), (key, got[key], recorded[key])
    # The checkpoint it ends with has the same files, keys and shapes as before: each version
    # of the code reads the other's.
    expected = json.loads(RECORDED_FORMAT.read_text())[case]
    for shard in expected["shards"].values():
        shard["param_groups"] = [
            {k: v for k, v in group.items() if k not in IGNORED_GROUP_KEYS}
            for group in shard["param_groups"]
        ]
    assert checkpoint_format(run_dir) == expected
