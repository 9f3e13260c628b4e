"""Faults injected for real into 2-rank mpirun jobs: each ends quickly, says why, loses nothing.

Every case asserts the job's exit status (mpirun's: non-zero when any rank failed), the time
from the fault to the end of the job, the message, and that every checkpoint and metrics line
written before the fault is still there; the recoverable ones then resume and log the losses
an uninterrupted run logs. The times measured here are the ones in docs/reliability.md (each
case prints ``fault: <case> <seconds>``; run with ``-s`` to see them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from family_runs import HOROVOD_OVER_MPI, SMALLEST, rotate, train_args
from mpirun import REPO, mpi_env

from hpcllm.commands.train import STOPPED_EXIT
from hpcllm.launcher import mpirun_command
from hpcllm.observe import read_metrics
from hpcllm.train import checkpoint

pytestmark = pytest.mark.mpi

SMALL = [
    *SMALLEST,
    "train.micro_batch_size=4",
    "train.global_batch_size=16",  # two micro-batches per rank and step
    "train.lr=3e-3",
    "train.warmup_steps=2",
    "train.lr_decay_steps=12",
    "train.log_interval=1",
    "train.eval_interval=0",
    "train.save_interval=2",
    "train.precision=fp32",
    "run.tensorboard=false",
]


# Stands for a blend of the run's data with a copy of it (_command writes it out).
BLEND = "data.blend=<stdlib and a copy>"

# What each faulted kind of run sets: an engine or a layout, and the family that runs it, the
# registered families in turn (family_runs.rotate; any family runs SMALLEST's shared keys).
# Named "<kind>-<family>".
KINDS = {
    f"{kind}-{arch}": [f"model.arch={arch}", *sets]
    for (kind, sets), arch in rotate(
        [
            ("ddp", ["parallel.dp_engine=ddp"]),
            ("t2", ["parallel.tp=2"]),
            ("horovod", ["parallel.dp_engine=horovod"]),
            # Mixture of experts: the sigmoid router's bias resumes with the weights, and a
            # rank stopped mid-step leaves its peer waiting in an MoE step's collectives.
            (
                "moe",
                [
                    "parallel.dp_engine=ddp",
                    "model.moe_experts=4",
                    "model.moe_router=sigmoid",
                    "model.moe_capacity_factor=1.0",
                ],
            ),
            # Expert parallelism: the ranks swap tokens by all-to-all inside every forward
            # and backward, and a checkpoint gathers the experts over them.
            (
                "ep",
                ["parallel.dp_engine=ddp", "model.moe_experts=4", "parallel.ep=2"],
            ),
            # Context parallelism: the two ranks split every sequence and gather each
            # other's keys and values in every layer, forward and backward.
            ("cp", ["parallel.dp_engine=ddp", "parallel.cp=2"]),
            # A blend: its position (each source's samples drawn) resumes with the run.
            ("blend", ["parallel.dp_engine=ddp", BLEND]),
        ]
    )
}
# The default family under the default engine: the kind whose finished run the damaged
# checkpoints and the bad values start from, trained on as a run that names neither.
PLAIN = next(iter(KINDS))


def _command(stdlib: Path, run_dir: Path, *extra: str) -> list[str]:
    data: Path | None = stdlib
    if BLEND in extra:  # the built-in corpus blended with a copy of itself, 0.3 : 0.7
        copy = stdlib.parent / "stdlib-copy"
        if not copy.exists():
            shutil.copytree(stdlib, copy)
        blend = f"data.blend=[[{stdlib}, 0.3, stdlib], [{copy}, 0.7, copy]]"
        data, extra = None, tuple(blend if item == BLEND else item for item in extra)
    args = train_args(data, run_dir, *SMALL, *extra)
    return mpirun_command(2, [sys.executable, "-m", "hpcllm", *args])


def _start(stdlib: Path, run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        _command(stdlib, run_dir, *extra),
        cwd=REPO,
        env=mpi_env(HOROVOD_OVER_MPI),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"the job hung past {timeout} s\n{out}\n{err}") from None
    return proc.returncode, out, err


def _train(stdlib: Path, run_dir: Path, *extra: str) -> tuple[int, str, str]:
    return _finish(_start(stdlib, run_dir, *extra))


def _rank_pid(proc: subprocess.Popen, rank: int) -> int:
    """Return the pid of ``rank`` of the job ``proc`` started (found by its MPI environment)."""
    wanted = f"OMPI_COMM_WORLD_RANK={rank}".encode()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.getsid(int(entry.name)) != proc.pid:
                    continue
                environ = (entry / "environ").read_bytes().split(b"\0")
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if wanted in environ and b"hpcllm" in cmdline:
                return int(entry.name)
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} never started")


def _wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        path = run_dir / "metrics.jsonl"
        if path.exists() and path.read_text().count("\n") >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} never logged")


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


@pytest.fixture(scope="module")
def reference(stdlib: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Uninterrupted 8-step runs, one per kind, each with checkpoints at steps 2, 4, 6, 8."""
    runs = {}
    for engine in KINDS:
        run_dir = tmp_path_factory.mktemp("reference") / engine
        code, _, err = _train(stdlib, run_dir, "train.steps=8", *KINDS[engine])
        assert code == 0, err
        runs[engine] = run_dir
    return runs


def _snapshot(run_dir: Path) -> tuple[list[str], dict[str, str]]:
    """Return the metrics lines and every finished checkpoint's manifest of ``run_dir``."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    manifests = {
        folder.name: (folder / "manifest.json").read_text()
        for folder in (run_dir / "checkpoints").glob("step_*")
    }
    return lines, manifests


def _nothing_lost(run_dir: Path, before: tuple[list[str], dict[str, str]]) -> None:
    lines, manifests = _snapshot(run_dir)
    assert lines[: len(before[0])] == before[0]
    for name, manifest in before[1].items():
        assert manifests.get(name) == manifest, name
        assert checkpoint.verify(run_dir / "checkpoints" / name).status == "ok"


def _fault_rank_1(
    stdlib: Path, run_dir: Path, engine: str, sig: signal.Signals, timeout_s: float
) -> tuple[int, str, float, tuple[list[str], dict[str, str]]]:
    """Start an endless run, send rank 1 ``sig`` once step 3 is logged, wait for the job's
    end; return its exit status, stderr, seconds from the fault, and what was written before."""
    proc = _start(
        stdlib,
        run_dir,
        "train.steps=100000",
        *KINDS.get(engine, [f"parallel.dp_engine={engine}"]),
        f"run.timeout_s={timeout_s}",
    )
    try:
        _wait_for_step(run_dir, proc, 3)
        before = _snapshot(run_dir)
        os.kill(_rank_pid(proc, 1), sig)
        faulted = time.monotonic()
        code, _, err = _finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    took = time.monotonic() - faulted
    print(f"fault: {engine} {sig.name} {took:.1f}")
    return code, err, took, before


@pytest.mark.parametrize("engine", list(KINDS))
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_killed_or_stopped_rank_ends_the_job_and_the_run_resumes_exactly(
    stdlib, tmp_path, reference, engine, sig
):
    run_dir = tmp_path / "run"
    timeout_s = 4
    code, err, took, before = _fault_rank_1(stdlib, run_dir, engine, sig, timeout_s)
    assert code != 0
    if sig == signal.SIGSTOP:
        # The survivor's watchdog names what it waited on, within the timeout plus the time
        # for mpirun to take the job down.
        assert "hpcllm: error (rank 0): no progress for" in err and "aborting the job" in err
        said = next(line for line in err.splitlines() if "no progress for" in line)
        if engine.startswith("cp-"):
            # Stopped mid-step, its peer waits in the keys' gather or their gradients'
            # reduce-scatter (seen: "context-parallel key/value gradient reduce-scatter
            # (axis=cp, step=4)"), or in the gradients' all-reduce over d x cp.
            assert "context-parallel key/value" in said or "axis=dp" in said, said
        assert took < timeout_s + 20
        assert (run_dir / "hang-rank00000.txt").exists()  # what it waited on, its threads
    else:
        assert took < 20
    _nothing_lost(run_dir, before)
    # Resumed, it logs what the uninterrupted run logged from its newest checkpoint on.
    resumed_from = checkpoint.read_meta(checkpoint.resumable(run_dir, print))["step"]
    code, _, err = _train(stdlib, run_dir, "train.steps=8", *KINDS[engine])
    assert code == 0, err
    got, want = _losses(run_dir), _losses(reference[engine])
    assert [got[s] for s in range(resumed_from + 1, 9)] == [
        want[s] for s in range(resumed_from + 1, 9)
    ]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_killed_or_stopped_ps_async_worker_ends_the_job_naming_its_rank(stdlib, tmp_path, sig):
    # The server never waits for one worker inside a segment; at its end it waits for the
    # gradient in progress of each, which a dead or stopped worker never sends.
    code, err, took, _ = _fault_rank_1(stdlib, tmp_path / "run", "ps-async", sig, 4)
    assert code != 0 and took < 25, err
    if sig == signal.SIGSTOP:
        # The survivor's watchdog names its wait: inside a segment, the stopped worker's
        # gradient in progress (by rank); once that came, the segment's end or the next
        # collective, where all ranks meet.
        assert "hpcllm: error (rank 0): no progress for" in err, err
        if "gradient in progress" in err:
            assert "ps-async: the gradient in progress of world rank(s) 1" in err, err
    else:  # mpirun names the rank that died
        assert "process rank 1 with PID" in err and "signal 9" in err, err


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_resumes(
    stdlib, tmp_path, reference, damage
):
    run_dir = tmp_path / "run"
    shutil.copytree(reference[PLAIN], run_dir)
    for late in ("step_00000008", "step_00000006"):  # keep steps 2 and 4
        shutil.rmtree(run_dir / "checkpoints" / late)
    shard = run_dir / "checkpoints" / "step_00000004" / "model_tp00_pp00.pt"
    data = bytearray(shard.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2 : len(data) // 2 + 64] = bytes(
            b ^ 0xFF for b in data[len(data) // 2 : len(data) // 2 + 64]
        )
    shard.write_bytes(bytes(data))
    started = time.monotonic()
    code, _, err = _train(stdlib, run_dir, "train.steps=8")
    print(f"fault: checkpoint {damage} {time.monotonic() - started:.1f}")
    assert code == 0, err
    assert "model_tp00_pp00.pt" in err and "step_00000004" in err  # named, then passed over
    got, want = _losses(run_dir), _losses(reference[PLAIN])
    assert [got[s] for s in range(3, 9)] == [want[s] for s in range(3, 9)]


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_a_damaged_data_shard_is_one_line_on_every_rank(stdlib, tmp_path, damage):
    data = tmp_path / "data"
    shutil.copytree(stdlib, data)
    shard = next(data.glob("train-*.h5"))
    raw = bytearray(shard.read_bytes())
    if damage == "truncated":
        raw = raw[: len(raw) // 2]
    else:
        middle = len(raw) // 2
        raw[middle : middle + 4096] = bytes(4096)
    shard.write_bytes(bytes(raw))
    started = time.monotonic()
    code, out, err = _train(data, tmp_path / "run", "train.steps=50")
    took = time.monotonic() - started
    print(f"fault: data shard {damage} {took:.1f}")
    assert code != 0 and "Traceback" not in err, err
    assert took < 60  # launch to exit, start-up included
    assert shard.name in err, err


def test_a_second_job_on_a_folder_in_use_exits_2_and_the_first_goes_on(stdlib, tmp_path):
    run_dir = tmp_path / "run"
    first = _start(stdlib, run_dir, "train.steps=100000")
    try:
        _wait_for_step(run_dir, first, 2)
        before = (run_dir / "metrics.jsonl").read_text()
        started = time.monotonic()
        code, _, err = _train(stdlib, run_dir, "train.steps=100000")
        took = time.monotonic() - started
        print(f"fault: second job on the folder {took:.1f}")
        assert code == 2, err
        assert took < 60  # launch to exit, start-up included
        assert "is in use by another run (pid" in err
        assert (run_dir / "metrics.jsonl").read_text().startswith(before)
        assert first.poll() is None  # the first run is untouched
        first.send_signal(signal.SIGUSR1)
        code, out, err = _finish(first)
        assert code == STOPPED_EXIT and "stopped by SIGUSR1" in out, err
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_while_saving_every_step_leaves_a_good_checkpoint(stdlib, tmp_path, sig):
    run_dir = tmp_path / "run"
    proc = _start(stdlib, run_dir, "train.steps=100000", "train.save_interval=1")
    try:
        _wait_for_step(run_dir, proc, 3)
        before = _snapshot(run_dir)
        signalled = time.monotonic()
        if sig == signal.SIGUSR1:  # mpirun forwards it to every rank
            proc.send_signal(sig)
        else:  # as Slurm does on preemption: every task gets it
            for rank in (0, 1):
                os.kill(_rank_pid(proc, rank), sig)
        code, out, err = _finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == STOPPED_EXIT, err
    assert time.monotonic() - signalled < 30  # the step in flight, a save, the exit
    _nothing_lost(run_dir, before)
    assert all(
        checkpoint.verify(folder).status == "ok" for folder in checkpoint.checkpoints(run_dir)
    )
    newest = checkpoint.resumable(run_dir, print)
    assert newest == checkpoint.latest(run_dir)
    assert (
        checkpoint.read_meta(newest)["step"]
        == json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    )


# A sample of the config fuzz, end to end: every rank exits 2 at once, the folder unchanged.
BAD = [
    ("train.lr=nan",),
    ("train.lr=.inf",),
    ("model.init_std=-1",),
    ("model.layer_norm_eps=-1",),
    ("parallel.tp=0",),
    ("parallel.tp=3",),
    ("data.seed=-1",),
    ("train.grad_clip=nan",),
    ("train.global_batch_size=20",),
    ("train.profile_steps=9:3",),
    ("model.dropout=1.5",),
    ("run.resume=none",),  # over the checkpoints the folder holds
    ("model.n_head=3",),
    ("parallel.pp=2",),  # one layer cannot make two stages
    ("parallel.pp=2", "model.n_layer=2", "parallel.schedule=zb-h1", "model.compile=blocks"),
    ("run.timeout_s=0",),
    ("train.max_bad_steps=0",),
    ("unknown.key=1",),
    ("train.steps=many",),
    ("model.d_model=64",),  # another model than the folder's checkpoints
    ("model.arch=llama",),  # another family than the folder's checkpoints
    ("model.arch=llama", "model.n_kv_heads=3"),  # 2 query heads cannot share 3 kv heads
    ("model.n_kv_heads=1",),  # a Llama setting on GPT-2
    ("model.moe_experts=4",),  # the folder's dense checkpoints resumed as MoE
    ("model.moe_experts=4", "model.moe_top_k=8"),
    ("model.moe_experts=4", "model.moe_router=topk"),
]


@pytest.fixture(scope="module")
def finished(reference: dict[str, Path]) -> Path:
    return reference[PLAIN]


@pytest.mark.parametrize("bad", BAD, ids=lambda overrides: " ".join(overrides))
def test_a_bad_value_exits_2_on_every_rank_and_changes_nothing(stdlib, tmp_path, finished, bad):
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    before = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    started = time.monotonic()
    code, _, err = _train(stdlib, run_dir, *bad)
    took = time.monotonic() - started
    assert code == 2, err
    assert "Traceback" not in err and err.count("hpcllm: error") == 1, err
    assert took < 60
    after = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    assert after == before
