"""Structural changes leave the numbers alone: the losses and a checkpoint recorded before them.

The structural issues (trainer components, one data-parallel package, config rules, one module
per command, the model-family seam) move code, not arithmetic. Before the first of them,
commit 33efe5c ran the cases below and recorded what each logged
(``tests/recorded/losses_before_components.json``): the training loss of every step and the
validation loss at the end, at fp32 (the t·p bf16 case at bf16). Each engine and step path
takes part: ddp, ddp and horovod under the distributed optimizer, ps-async synchronous
(``max_staleness: 0``) and stale in a fixed order, local SGD, tensor parallelism with sequence
parallelism, the interleaved pipeline, and t = 2 × p = 2 in bf16.

The same commit also wrote a checkpoint halfway through the ``fixture`` case
(``tests/recorded/checkpoint_before_components/``, d = 2 under the distributed optimizer, so
that per-rank optimizer files and meta.json's keys take part); the test trains
on from it (in the same test) and must log the uninterrupted run's last two losses.

Before checkpoint files were named by their axes (format 3), commit cfa3f4b recorded a
t = 2 × p = 2 checkpoint at fp32 halfway through its run
(``tests/recorded/checkpoint_before_axes/``, with ``losses_before_axes.json``): it resumes as
it was cut, and re-cut to t = 1 × p = 4 (``run.reshard``), with the uninterrupted losses.

Two launches hold every case (``tests/mpi_scripts/train_in_one_launch.py``): one of two ranks
for the eight two-rank cases and the resume, one of four ranks for t·p. Re-record (after a
change that is meant to alter the numbers, and said so) with
``python tests/test_structural_losses.py --record`` (the t2 × p2 checkpoint:
``--record-axes``).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from family_runs import train_together  # noqa: E402
from test_one_step_path import prepare_data  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RECORDED = REPO / "tests" / "recorded" / "losses_before_components.json"
FIXTURE = REPO / "tests" / "recorded" / "checkpoint_before_components"
# Recorded before checkpoints were named by their axes (format 3): t = 2 x p = 2 at fp32, saved
# at step 2 of 4, and the losses of the uninterrupted run.
AXES_FIXTURE = REPO / "tests" / "recorded" / "checkpoint_before_axes"
AXES_RECORDED = REPO / "tests" / "recorded" / "losses_before_axes.json"
AXES_CASE = ["parallel.tp=2", "parallel.pp=2", "train.save_interval=2"]

# Four layers so that p = 2 interleaves v = 2 chunks; small enough for seconds per case.
COMMON = [
    "model.preset=null",
    "model.n_layer=4",
    "model.n_head=2",
    "model.d_model=64",
    "model.seq_len=64",
    "model.dropout=0.0",
    "train.steps=4",
    "train.global_batch_size=16",
    "train.micro_batch_size=4",
    "train.lr=3e-3",
    "train.min_lr=3e-4",
    "train.warmup_steps=2",
    "train.log_interval=1",
    "train.eval_interval=0",
    "train.eval_iters=2",
    "train.save_interval=0",
    "train.precision=fp32",
    "run.tensorboard=false",
    "run.resume=none",
]

# name: (ranks, overrides)
CASES: dict[str, tuple[int, list[str]]] = {
    "ddp-d2": (2, ["parallel.dp_engine=ddp"]),
    "ddp-zero1-d2": (2, ["parallel.dp_engine=ddp", "parallel.distributed_optimizer=true"]),
    "horovod-zero1-d2": (2, ["parallel.dp_engine=horovod", "parallel.distributed_optimizer=true"]),
    "ps-async-k0": (2, ["parallel.dp_engine=ps-async", "parallel.max_staleness=0"]),
    "ps-async-k2-round-robin": (
        2,
        [
            "parallel.dp_engine=ps-async",
            "parallel.max_staleness=2",
            "parallel.ps_async_order=round-robin",
        ],
    ),
    "local-sgd-h2": (2, ["parallel.dp_engine=local-sgd", "parallel.local_sgd_steps=2"]),
    "t2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "p2-interleaved-v2": (
        2,
        ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.vpp=2"],
    ),
    "t2-p2-bf16": (4, ["parallel.tp=2", "parallel.pp=2", "train.precision=bf16"]),
}
# bf16 CPU kernels differ by about 1e-5 between machines at the same commit.
TOLERANCE = {"t2-p2-bf16": 1e-4}
DEFAULT_TOLERANCE = 1e-6

# The checkpoint fixture: its run saved at step 2 of 4; the resume trains steps 3 and 4.
FIXTURE_CASE = [
    "parallel.dp_engine=ddp",
    "parallel.distributed_optimizer=true",
    "train.save_interval=2",
]


def _launch(ranks: int, data: Path, scratch: Path, runs: dict[str, list[str]]) -> dict[str, Any]:
    """Train ``runs`` one after another in one launch of ``ranks``; return their metrics."""
    runs = {name: [*COMMON, *overrides] for name, overrides in runs.items()}
    return {
        name: run["records"] for name, run in train_together(ranks, data, scratch, runs).items()
    }


def _losses(records: list[dict[str, Any]]) -> dict[str, list[float]]:
    return {
        "loss": [r["loss"] for r in records],
        "steps": [r["step"] for r in records],
        "val_loss": [r["val_loss"] for r in records if "val_loss" in r],
    }


def _close(got: list[float], expected: list[float], tol: float) -> bool:
    return len(got) == len(expected) and all(
        math.isclose(a, b, rel_tol=tol) for a, b in zip(got, expected, strict=True)
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_data(tmp_path_factory.mktemp("structural"))


@pytest.mark.mpi
def test_every_engine_and_layout_logs_the_recorded_losses_and_the_old_checkpoint_resumes(
    data: Path, tmp_path: Path
) -> None:
    recorded = json.loads(RECORDED.read_text())
    # The checkpoint main wrote before the change, copied where the resuming run trains.
    shutil.copytree(FIXTURE, tmp_path / "resumed")
    two = {name: o for name, (ranks, o) in CASES.items() if ranks == 2}
    two["resumed"] = [*FIXTURE_CASE, "run.resume=auto"]
    metrics = _launch(2, data, tmp_path, two)
    four = {name: o for name, (ranks, o) in CASES.items() if ranks == 4}
    # The t2 x p2 checkpoint of format 2 resumes as it was cut and re-cut to t1 x p4.
    for name in ("axes-resumed", "axes-recut"):
        shutil.copytree(AXES_FIXTURE, tmp_path / name)
    four["axes-resumed"] = [*AXES_CASE, "run.resume=auto"]
    four["axes-recut"] = [
        *AXES_CASE,
        "parallel.tp=1",
        "parallel.pp=4",
        "run.reshard=true",
        "run.resume=auto",
    ]
    metrics |= _launch(4, data, tmp_path, four)
    failures = []
    for name in CASES:
        got, expected = _losses(metrics[name]), recorded[name]
        tol = TOLERANCE.get(name, DEFAULT_TOLERANCE)
        assert len(expected["loss"]) == 4 and len(expected["val_loss"]) == 1
        if got["steps"] != expected["steps"] or not all(
            _close(got[k], expected[k], tol) for k in ("loss", "val_loss")
        ):
            failures.append((name, got, expected))
    assert not failures, failures
    # The resumed run starts at the fixture's step 2 and logs what the uninterrupted run did.
    resumed, whole = _losses(metrics["resumed"]), recorded["fixture"]
    assert resumed["steps"] == [3, 4]
    assert _close(resumed["loss"], whole["loss"][2:], DEFAULT_TOLERANCE), (resumed, whole)
    assert _close(resumed["val_loss"], whole["val_loss"], DEFAULT_TOLERANCE), (resumed, whole)
    whole = json.loads(AXES_RECORDED.read_text())
    for name in ("axes-resumed", "axes-recut"):
        resumed = _losses(metrics[name])
        assert resumed["steps"] == [3, 4], name
        assert _close(resumed["loss"], whole["loss"][2:], DEFAULT_TOLERANCE), (name, resumed, whole)
        assert _close(resumed["val_loss"], whole["val_loss"], DEFAULT_TOLERANCE), (name, resumed)
    # What the resumed runs wrote is format 3: the layout and the parts in the manifest.
    newest = tmp_path / "axes-recut" / "checkpoints" / "step_00000004" / "manifest.json"
    manifest = json.loads(newest.read_text())
    assert manifest["format_version"] == 3
    assert manifest["layout"]["axes"] | {"dp": 1} == {"tp": 1, "pp": 4, "dp": 1}
    assert manifest["parts"] == ["model", "optimizer", "scaler", "rng"]


def _keep_step_2(run: Path, fixture: Path) -> None:
    """Copy only the step-2 checkpoint of ``run`` to ``fixture``, named newest."""
    shutil.rmtree(fixture, ignore_errors=True)
    source = run / "checkpoints"
    (fixture / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "step_00000002", fixture / "checkpoints" / "step_00000002")
    (fixture / "checkpoints" / "latest").write_text("step_00000002\n")
    shutil.copy(run / "tokenizer.json", fixture / "tokenizer.json")


def record_axes() -> None:
    """Run the t2 x p2 fixture case on this commit; write its losses and its checkpoint."""
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        data = prepare_data(scratch / "prepared")
        metrics = _launch(4, data, scratch, {"axes": AXES_CASE})
        AXES_RECORDED.write_text(json.dumps(_losses(metrics["axes"]), indent=1) + "\n")
        _keep_step_2(scratch / "axes", AXES_FIXTURE)


def record() -> None:
    """Run every case on this commit; write the recorded losses and the checkpoint fixture."""
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        data = prepare_data(scratch / "prepared")
        two = {name: o for name, (ranks, o) in CASES.items() if ranks == 2}
        two["fixture"] = FIXTURE_CASE
        metrics = _launch(2, data, scratch, two)
        four = {name: o for name, (ranks, o) in CASES.items() if ranks == 4}
        metrics |= _launch(4, data, scratch, four)
        RECORDED.write_text(
            json.dumps({name: _losses(records) for name, records in metrics.items()}, indent=1)
            + "\n"
        )
        # Only the step-2 checkpoint, named newest, as if the run had stopped there.
        shutil.rmtree(FIXTURE, ignore_errors=True)
        source = scratch / "fixture" / "checkpoints"
        (FIXTURE / "checkpoints").mkdir(parents=True)
        shutil.copytree(source / "step_00000002", FIXTURE / "checkpoints" / "step_00000002")
        (FIXTURE / "checkpoints" / "latest").write_text("step_00000002\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--record"]:
        record()
    elif sys.argv[1:] == ["--record-axes"]:
        record_axes()
    else:
        sys.exit("usage: python tests/test_structural_losses.py --record | --record-axes")
