"""Losses of short runs of the tiny config, recorded once and compared by the tests.

``tests/recorded/losses_before_one_step_path.json`` holds the losses that the trainer gave before
it ran every layout through the pipeline runtime (two step paths then: pipelined and not).
The test re-runs the same cases and asserts the same training and validation losses, so a restructuring that changes
what is computed, not only how the code is laid out, fails.

Run as a script to record the file again from the code importable as ``hpcllm``:
``python tests/loss_record.py OUT.json``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECORDED = REPO / "tests" / "recorded" / "losses_before_one_step_path.json"

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
}

_WORDS = "def return import class self lambda yield with as for in if else while try".split()


def write_corpus(folder: Path) -> None:
    """Write 64 deterministic text documents (about 160 KB) into ``folder``."""
    rng = random.Random(0)
    folder.mkdir(parents=True)
    for i in range(64):
        words = [rng.choice(_WORDS) + rng.choice(["", "_x", "(y)", ":", "\n"]) for _ in range(400)]
        (folder / f"doc{i:02d}.txt").write_text(" ".join(words))


def prepare_data(scratch: Path, python: str = sys.executable) -> Path:
    """Write the corpus and its byte-level shards under ``scratch``; return the data folder."""
    write_corpus(scratch / "corpus")
    out = scratch / "data"
    subprocess.run(
        [
            python,
            "-m",
            "hpcllm",
            "prepare",
            "--input",
            str(scratch / "corpus"),
            "--out",
            str(out),
            "--tokenizer",
            "byte",
            "--val-fraction",
            "0.1",
            "--quiet",
        ],
        check=True,
    )
    return out


def train_command(data: Path, run_dir: Path, overrides: list[str]) -> list[str]:
    """Return the ``hpcllm train`` arguments of one case."""
    sets = [*COMMON, f"data.path={data}", f"run.dir={run_dir}", *overrides]
    args = ["train", "--config", str(REPO / "jobs" / "configs" / "tiny-cpu.yaml"), "--no-progress"]
    for item in sets:
        args += ["--set", item]
    return args


def read_losses(run_dir: Path) -> dict[str, list[float]]:
    """Return a run folder's training losses in step order, and its validation losses."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return {
        "loss": [r["loss"] for r in records],
        "val_loss": [r["val_loss"] for r in records if "val_loss" in r],
    }


def _record(out: Path) -> None:
    mpirun = shutil.which("mpirun")
    env = dict(
        os.environ,
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMP_NUM_THREADS="1",
        HOROVOD_CPU_OPERATIONS="MPI",
        OMPI_MCA_btl_vader_single_copy_mechanism="none",
    )
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        data = prepare_data(scratch)
        losses = {}
        for name, (ranks, overrides) in CASES.items():
            run_dir = scratch / name
            cmd = [
                mpirun,
                "-np",
                str(ranks),
                "--oversubscribe",
                "--bind-to",
                "none",
                sys.executable,
                "-m",
                "hpcllm",
                *train_command(data, run_dir, overrides),
            ]
            subprocess.run(cmd, check=True, env=env)
            losses[name] = read_losses(run_dir)
            print(name, losses[name], flush=True)
    out.write_text(json.dumps(losses, indent=2) + "\n")


if __name__ == "__main__":
    _record(Path(sys.argv[1]) if len(sys.argv) > 1 else RECORDED)
