"""Starting hpcllm from a test: the tiny configs (each family's tiny model, the smallest
shape any family runs, the trainer tests' GPT-2), training under mpirun (one launch a run, or
several runs in one launch), and any command in a subprocess.

A family registered in :mod:`hpcllm.families` joins every test that takes its family from
:func:`registered` or :func:`rotate` as soon as :data:`TINY` holds its tiny model. A family
that only a subprocess registers (the test family, through ``HPCLLM_FAMILIES``) passes its
own sets and its environment to the same calls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

from mpirun import REPO, MpiResult, python, run_mpi

from hpcllm import families
from hpcllm.config import load_config
from hpcllm.observe import read_metrics

Case = TypeVar("Case")

# The keys every family shares, at their smallest: one layer of two 16-wide heads, for the
# tests of what surrounds the model (run folders, checkpoints, messages, faults).
SMALLEST = [
    "model.preset=null",
    "model.n_layer=1",
    "model.n_head=2",
    "model.d_model=32",
    "model.seq_len=32",
]

# Each built-in family's tiny model: four layers, so that p = 2 interleaves v = 2 chunks and
# p = 4 holds a layer a stage; heads that t = 2 splits; 32-token sequences.
TINY: dict[str, list[str]] = {
    "gpt2": [
        "model.preset=null",
        "model.n_layer=4",
        "model.n_head=4",
        "model.d_model=64",
        "model.seq_len=32",
    ],
    # 2 key/value heads for 4 query heads, Llama 3.1's rotary scaling, an untied output layer.
    "llama": ["model.preset=llama-tiny", "model.seq_len=32"],
}

# Four fp32 steps of 8 sequences (4 micro-batches at d = 1), every step logged, no dropout:
# the short run whose losses the family tests compare across layouts.
SHORT_RUN = [
    "model.dropout=0",
    "train.steps=4",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.lr=3e-3",
    "train.warmup_steps=2",
    "train.lr_decay_steps=6",
    "train.log_interval=1",
    "train.eval_interval=0",
    "train.precision=fp32",
    "run.tensorboard=false",
]

# The trainer and engine tests' GPT-2 (2 layers, d_model 64, 64 tokens) and its training. The
# fp16 overflow recording (tests/overflow_record.py) replays runs of it: change it only with
# a new recording.
SMALL = [
    "model.preset=null",
    "model.n_layer=2",
    "model.n_head=2",
    "model.d_model=64",
    "model.seq_len=64",
    "train.micro_batch_size=4",
    "train.lr=3e-3",
    "train.min_lr=3e-4",
    "train.warmup_steps=5",
    "train.log_interval=1",
    "train.eval_iters=4",
    "run.tensorboard=false",
]

# Each family's tiny MoE settings (4 experts, top-2, dropless, a z-loss; on Llama Qwen-MoE's
# shape: every other block MoE, a gated shared expert, renormalised weights), which the MoE
# and expert-parallel tests train.
MOE = {
    "gpt2": ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_z_loss=0.001"],
    # Qwen-MoE's shape: every other block MoE, a gated shared expert, renormalised weights.
    "llama": [
        "model.moe_experts=4",
        "model.moe_top_k=2",
        "model.moe_every=2",
        "model.moe_ffn_size=64",
        "model.moe_shared_ffn_size=32",
        "model.moe_shared_gate=true",
        "model.moe_renormalize=true",
        "model.moe_z_loss=0.001",
    ],
}


# Horovod reduces over MPI: under mpirun its gloo transport crashes on these machines.
HOROVOD_OVER_MPI = {"HOROVOD_CPU_OPERATIONS": "MPI"}


def tiny(arch: str) -> list[str]:
    """Return the ``--set`` items of a short run (:data:`SHORT_RUN`) of family ``arch``'s tiny
    model (:data:`TINY`)."""
    assert arch in TINY, f"family {arch} has no tiny model: add one to TINY in {__file__}"
    return [f"model.arch={arch}", *TINY[arch], *SHORT_RUN]


def registered() -> list[str]:
    """Return the registered families' names, the default first (the family of a test that
    names none), then the others in order."""
    default = load_config(None, []).model.arch
    return sorted(families.names(), key=lambda name: (name != default, name))


def rotate(cases: Iterable[Case]) -> list[tuple[Case, str]]:
    """Return each case with the family that runs it: the registered families in turn, so
    that each family runs some of the cases and the cases cost what they cost for one."""
    names = registered()
    return [(case, names[i % len(names)]) for i, case in enumerate(cases)]


def sets(*items: str) -> list[str]:
    """Return ``items`` as ``hpcllm`` arguments: ``--set ITEM`` each."""
    return [word for item in items for word in ("--set", item)]


def train_args(data: Path | None, run: Path, *items: str, config: Path | None = None) -> list[str]:
    """Return the arguments of ``hpcllm train`` into the run folder ``run`` on the prepared
    data ``data`` (None: the items say where the data is), with no progress bar; the items
    are ``--set`` over the YAML file ``config`` where one is given."""
    where = [f"data.path={data}"] if data is not None else []
    given = ["--config", str(config)] if config is not None else []
    return ["train", *given, "--no-progress", *sets(*where, f"run.dir={run}", *items)]


def cli(
    *args: str,
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
    timeout: float = 300,
    umask: int | None = None,
    check: bool = False,
) -> subprocess.CompletedProcess:
    """Return the finished ``hpcllm ARGS`` of one process (this interpreter, output captured);
    with ``check``, fail with its stderr unless it exited 0.

    It runs as one process whatever started pytest (no launcher's variables), with Triton's
    interpreter only where ``env`` asks for it, ``env`` added, and files made under ``umask``.
    """
    inherited = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_")) and k != "TRITON_INTERPRET"
    }
    done = subprocess.run(
        [sys.executable, "-m", "hpcllm", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env={**inherited, **(env or {})},
        preexec_fn=None if umask is None else lambda: os.umask(umask),
    )
    assert not check or done.returncode == 0, f"hpcllm {' '.join(args)}\n{done.stderr}"
    return done


def train(
    np: int,
    data: Path | None,
    run: Path,
    *items: str,
    config: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> MpiResult:
    """Return the result of ``hpcllm train`` (:func:`train_args`) on ``np`` ranks under
    mpirun, ``env`` added to the ranks' environment; unchecked, as :func:`run_mpi`'s."""
    command = python("-m", "hpcllm", *train_args(data, run, *items, config=config))
    return run_mpi(np, command, env={**HOROVOD_OVER_MPI, **(env or {})}, timeout=timeout)


def losses(run: Path) -> list[float]:
    """Return the training losses a run folder logged, in step order."""
    return [record["loss"] for record in read_metrics(run)]


def train_together(
    np: int,
    data: Path,
    scratch: Path,
    runs: dict[str, list[str]],
    timeout: float = 400,
) -> dict[str, dict[str, Any]]:
    """Return each run's metrics records and summary (``{"records": ..., "summary": ...}``),
    by name: ``runs`` (name: ``--set`` items) trained one after another in ``scratch/NAME``,
    all in one launch of ``np`` ranks, which pays mpirun's and torch's start-up once."""
    script = python("tests/mpi_scripts/train_in_one_launch.py", str(data), str(scratch))
    command = [*script, json.dumps(runs)]
    result = run_mpi(np, command, env=HOROVOD_OVER_MPI, timeout=timeout).check()
    return json.loads(result.rank_stdout[0].splitlines()[-1])
