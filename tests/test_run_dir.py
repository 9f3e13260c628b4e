"""Run-folder safety: one run per folder, nothing of an earlier run deleted, rejected runs touch
nothing, file-system errors in one line."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from family_runs import SMALLEST, cli, train_args
from mpirun import REPO

from hpcllm.errors import UserError
from hpcllm.train import run_dir
from hpcllm.train.run_dir import EXCLUSIVE_LOCK, LOCK

SMALL = [
    *SMALLEST,
    "train.micro_batch_size=4",
    "train.global_batch_size=4",
    "train.log_interval=1",
    "train.eval_interval=0",
    "train.save_interval=1",
    "run.tensorboard=false",
]


def _train(stdlib: Path, folder: Path, *extra: str) -> subprocess.CompletedProcess:
    args = train_args(stdlib, folder, *SMALL, *extra)
    return cli(*args, env={"OMP_NUM_THREADS": "1"}, timeout=180)


def _tree(folder: Path) -> dict[str, str]:
    """Return every file under ``folder`` (relative path) with its content's hash."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def trained(stdlib: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder with two checkpoints and its metrics."""
    folder = tmp_path_factory.mktemp("runs") / "run"
    result = _train(stdlib, folder, "train.steps=2")
    assert result.returncode == 0, result.stderr
    return folder


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_rejected_run_leaves_the_folder_byte_for_byte(stdlib, trained, tmp_path):
    folder = _copy(trained, tmp_path / "run")
    before = _tree(folder)
    # A global batch the micro-batch does not divide, over checkpoints, with resume none and
    # with resume auto: both rejected before anything is written.
    for resume in ("none", "auto"):
        result = _train(stdlib, folder, "train.global_batch_size=6", f"run.resume={resume}")
        assert result.returncode == 2, result.stderr
        assert "global_batch_size" in result.stderr and "Traceback" not in result.stderr
        assert _tree(folder) == before


def test_a_rejected_run_creates_no_folder(stdlib, tmp_path):
    result = _train(stdlib, tmp_path / "new", "train.global_batch_size=6")
    assert result.returncode == 2 and not (tmp_path / "new").exists()


@pytest.mark.slow
def test_resume_none_over_checkpoints_refuses_then_moves_the_run_aside(stdlib, trained, tmp_path):
    folder = _copy(trained, tmp_path / "run")
    before = _tree(folder)
    result = _train(stdlib, folder, "train.steps=1", "run.resume=none")
    assert result.returncode == 2 and "run.overwrite=true" in result.stderr
    assert result.stderr.count("\n") == 1 and _tree(folder) == before
    result = _train(stdlib, folder, "train.steps=1", "run.resume=none", "run.overwrite=true")
    assert result.returncode == 0, result.stderr
    (aside,) = tmp_path.glob("run.old-*")
    assert _tree(aside) == before  # the earlier run, whole
    assert f"aside to {aside}" in result.stderr
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == ["latest", "step_00000001"]
    assert not (folder / LOCK).exists() and not (aside / LOCK).exists()


@pytest.mark.slow
def test_a_second_run_on_a_locked_folder_exits_2_naming_the_first(stdlib, trained, tmp_path):
    folder = _copy(trained, tmp_path / "run")
    held = run_dir.lock(folder, print)  # this test process plays the first job
    try:
        before = _tree(folder)
        result = _train(stdlib, folder, "train.steps=3")
        assert result.returncode == 2, result.stderr
        assert f"in use by another run (pid {os.getpid()} on " in result.stderr
        assert _tree(folder) == before
    finally:
        held.release()
    assert not (folder / LOCK).exists()
    result = _train(stdlib, folder, "train.steps=3")  # free again: it resumes
    assert result.returncode == 0, result.stderr


def test_a_stale_lock_of_a_dead_job_is_taken_over_with_a_warning(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / LOCK).write_text(json.dumps({"host": "n1", "pid": 1, "since": 0}))
    warnings: list[str] = []
    held = run_dir.lock(folder, warnings.append)
    assert len(warnings) == 1 and "pid 1 on n1" in warnings[0]
    held.release()


def test_the_lock_is_exclusive_across_processes_and_shared_within_one(tmp_path):
    folder = tmp_path / "run"
    first = run_dir.lock(folder, print)
    again = run_dir.lock(folder, print)  # a second trainer of this process shares it
    assert again is first and first.users == 2
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from hpcllm.train import run_dir; "
            f"run_dir.lock(__import__('pathlib').Path({str(folder)!r}), print)",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert other.returncode != 0 and "in use by another run" in other.stderr
    again.release()
    assert (folder / LOCK).exists()
    first.release()
    assert not (folder / LOCK).exists()


def test_without_fcntl_locks_an_exclusive_file_locks(tmp_path, monkeypatch):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    folder = tmp_path / "run"
    held = run_dir.lock(folder, print)
    assert (folder / EXCLUSIVE_LOCK).exists() and not (folder / LOCK).exists()
    run_dir._HELD.clear()  # as another process would see it
    with pytest.raises(UserError, match="in use by another run"):
        run_dir.lock(folder, print)
    # One left by a dead job on this host is taken over; one from another host is not.
    (folder / EXCLUSIVE_LOCK).write_text(
        json.dumps({"host": os.uname().nodename, "pid": 2**22 + 7, "since": 0})
    )
    warnings: list[str] = []
    run_dir.lock(folder, warnings.append).release()
    assert warnings and not (folder / EXCLUSIVE_LOCK).exists()
    (folder / EXCLUSIVE_LOCK).write_text(json.dumps({"host": "elsewhere", "pid": 5, "since": 0}))
    with pytest.raises(UserError, match=f"remove {folder / EXCLUSIVE_LOCK}"):
        run_dir.lock(folder, print)
    held.users = 0


def test_file_system_errors_are_one_line(stdlib, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    result = _train(stdlib, blocker / "run", "train.steps=1")
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and str(blocker) in result.stderr
    assert "Traceback" not in result.stderr

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(
        UserError, match=r"^cannot create the run folder .*: Read-only file system$"
    ):
        run_dir.lock(tmp_path / "run", print)


def test_metrics_without_checkpoints_are_an_earlier_run_too(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    for resume in ("auto", "none"):
        with pytest.raises(UserError, match="metrics of an earlier run but no checkpoint"):
            run_dir.claim(folder, resume, False, print)
    assert (folder / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'


def test_metrics_beside_only_an_unfinished_checkpoint_are_kept_not_overwritten(tmp_path):
    # A save killed mid-way leaves .step_N.partial: nothing to resume from, so a resumed run
    # would start over; the earlier run's metrics must not be rewritten by it.
    folder = tmp_path / "run"
    (folder / "checkpoints" / ".step_00000002.partial").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    assert not run_dir.has_checkpoints(folder)
    with pytest.raises(UserError, match=r"no checkpoint to continue from \(only \.step_00000002"):
        run_dir.claim(folder, "auto", False, print)
    assert (folder / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'
    # run.overwrite moves the whole earlier run aside, metrics and all, rather than delete it.
    held = run_dir.claim(folder, "auto", True, print)
    held.release()
    (moved,) = tmp_path.glob("run.old-*")
    assert (moved / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'


def test_inspect_names_an_unfinished_save_and_the_lock_and_exits_1(tmp_path, capsys):
    from hpcllm.cli import main
    from hpcllm.train.inspect_run import verify_run

    folder = tmp_path / "run"
    partial = folder / "checkpoints" / ".step_00000002.partial"
    partial.mkdir(parents=True)
    (partial / "model_tp00_pp00.pt").write_bytes(b"\0" * 2_000_000)
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    ended = subprocess.Popen(["true"])
    ended.wait()
    dead = {"host": socket.gethostname(), "pid": ended.pid, "since": 0}
    (folder / LOCK).write_text(json.dumps(dead))
    assert main(["inspect", str(folder)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{folder}: no checkpoints"
    assert out[1].startswith("unfinished: .step_00000002.partial (2 MB), a save of step 2")
    assert out[2].startswith(f"lock: {folder / LOCK} held by pid {dead['pid']} on ")
    assert out[2].endswith("(not running: the next run takes the lock over)")
    assert main(["inspect", "--json", str(folder)]) == 1
    said = json.loads(capsys.readouterr().out)
    assert said["unfinished"] == [{"folder": partial.name, "step": 2, "bytes": 2_000_000}]
    # Once a later save finishes, the earlier unfinished one is named but is no failure.
    done = folder / "checkpoints" / "step_00000003"
    done.mkdir()
    check = verify_run(folder)
    assert check.unfinished and not check.newest_unfinished


def test_a_run_that_fails_to_start_puts_the_run_it_moved_aside_back(tmp_path):
    folder = tmp_path / "run"
    (folder / "checkpoints" / "step_00000001").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("{}\n")
    held = run_dir.claim(folder, "none", True, print)
    (aside,) = tmp_path.glob("run.old-*")
    assert held.moved_aside == aside and not (folder / "metrics.jsonl").exists()
    held.release()  # set-up failed: the new, empty folder goes
    held.undo_move()  # and the earlier run comes back
    assert (folder / "metrics.jsonl").read_text() == "{}\n" and not aside.exists()
