"""The watchdog turns a stalled phase into one abort that names it; an mpirun job never hangs."""

import json
import signal
import subprocess
import threading
import time

import pytest
from family_runs import SMALLEST, train
from mpirun import python, run_mpi

from hpcllm import watchdog


class Aborts:
    """An injected abort: records each call and lets the test wait for the first."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.called = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.called.set()


@pytest.fixture
def aborts():
    record = Aborts()
    yield record
    for dog in list(watchdog._ACTIVE):
        dog.stop()


def test_a_phase_past_the_timeout_aborts_once_naming_it(aborts, tmp_path, capsys):
    dog = watchdog.start(0.3, rank=3, report_dir=tmp_path / "report", abort=aborts)
    with watchdog.waiting("gradient all-reduce", axis="dp", step=12):
        assert aborts.called.wait(5)
        time.sleep(0.5)  # several more checks: still one abort
    dog.stop()
    assert aborts.codes == [1]
    line = (
        "hpcllm: error (rank 3): no progress for 0 s while waiting on gradient all-reduce "
        "(axis=dp, step=12); aborting the job"
    )
    assert capsys.readouterr().err.strip() == line
    assert dog.fired == line
    report = (tmp_path / "report" / "hang-rank00003.txt").read_text()
    assert line in report
    assert "gradient all-reduce {'axis': 'dp', 'step': 12} entered" in report
    assert "test_a_phase_past_the_timeout_aborts_once_naming_it" in report  # the traceback


@pytest.mark.slow
def test_a_phase_that_ends_in_time_does_not_abort(aborts):
    dog = watchdog.start(0.3, rank=0, abort=aborts)
    for _ in range(8):  # 0.8 s in phases, none of them 0.3 s long, and time outside any
        with watchdog.waiting("recv activation", axis="pp", peer=1):
            time.sleep(0.05)
        time.sleep(0.05)
    time.sleep(0.5)  # outside every phase nothing counts
    dog.stop()
    assert aborts.codes == []


def test_nested_phases_name_the_innermost_with_every_field(aborts, tmp_path, capsys):
    watchdog.start(0.3, rank=1, report_dir=tmp_path, abort=aborts)
    with watchdog.waiting("pipeline schedule", step=7, axis="none"):
        for microbatch in range(4):  # progress inside the outer phase: no abort
            with watchdog.waiting("recv gradient", axis="pp", peer=2, microbatch=microbatch):
                time.sleep(0.1)
        assert not aborts.called.is_set()
        with watchdog.waiting("recv activation", axis="pp", peer=0, microbatch=4):
            assert aborts.called.wait(5)
    assert aborts.codes == [1]
    err = capsys.readouterr().err
    assert "waiting on recv activation (axis=pp, peer=0, microbatch=4, step=7)" in err
    phases = (tmp_path / "hang-rank00001.txt").read_text().split("marks:\n")[1]
    assert phases.index("pipeline schedule") < phases.index("recv activation")  # outer first


def test_at_adds_fields_and_time_in_it_is_not_a_wait(aborts, capsys):
    watchdog.start(0.2, rank=0, abort=aborts)
    with watchdog.at(step=5):
        time.sleep(0.5)  # computing: no wait, however long
        assert not aborts.called.is_set()
        with watchdog.waiting("loss all-reduce", axis="pp"):
            assert aborts.called.wait(5)
    assert "waiting on loss all-reduce (axis=pp, step=5);" in capsys.readouterr().err


@pytest.mark.slow
def test_time_the_process_spent_stopped_does_not_count():
    # A suspended job (SIGSTOP to every rank, later SIGCONT) must go on when resumed.
    child = subprocess.Popen(
        python(
            "-c",
            "import sys, time\n"
            "from hpcllm import watchdog\n"
            "watchdog.start(1.0, rank=0, abort=lambda code: sys.exit(f'fired {code}'))\n"
            "with watchdog.waiting('recv activation'):\n"
            "    print('waiting', flush=True)\n"
            "    time.sleep(0.8)\n"
            "print('went on', flush=True)\n",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline() == "waiting\n"
        child.send_signal(signal.SIGSTOP)
        time.sleep(2.5)
        child.send_signal(signal.SIGCONT)
        out, err = child.communicate(timeout=30)
    finally:
        child.kill()
    assert "went on" in out and "no progress" not in err, err


def test_the_backstop_comes_after_the_watchdog():
    assert watchdog.backstop_s(3) == 8 and watchdog.backstop_s(600) == 660


def test_an_unwritable_report_folder_still_aborts(aborts, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    watchdog.start(0.2, rank=0, report_dir=blocker / "below", abort=aborts)
    with watchdog.waiting("save"):
        assert aborts.called.wait(5)
    assert aborts.codes == [1]


def test_stop_ends_the_thread_and_waiting_becomes_a_no_op(aborts):
    dog = watchdog.start(0.2, rank=0, abort=aborts)
    assert dog._thread.is_alive()
    dog.stop()
    assert not dog._thread.is_alive()
    with watchdog.waiting("evaluation"):
        time.sleep(0.4)
    assert aborts.codes == []
    assert dog._stack == []


def test_without_a_watchdog_waiting_does_nothing():
    assert not watchdog._ACTIVE
    mark = watchdog.waiting("gradient all-reduce", axis="dp")
    assert mark is watchdog.waiting("optimizer step")  # one shared no-op
    with mark:
        pass


def test_start_replaces_the_running_watchdog(aborts):
    first = watchdog.start(60, rank=0, abort=aborts)
    second = watchdog.start(60, rank=0, abort=aborts)
    assert not first._thread.is_alive()
    assert watchdog._ACTIVE == [second]


def test_the_timeout_must_be_positive():
    with pytest.raises(ValueError, match="above 0"):
        watchdog.start(0, rank=0)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "mode, phase",
    [
        ("allreduce", "gradient all-reduce (axis=dp, step=12)"),
        ("pipeline", "recv gradient (axis=pp, peer=1, microbatch=0, chunk=0, step=1)"),
    ],
)
def test_a_stopped_rank_ends_the_job_instead_of_hanging(tmp_path, mode, phase):
    script = python("tests/mpi_scripts/watchdog_stalled_peer.py", mode, "3", str(tmp_path))
    result = run_mpi(2, script, timeout=90)
    assert result.returncode != 0
    # Timed from the wait, not from mpirun: starting torch takes long on a busy machine.
    entered = float(result.rank_stdout[0].split("entered at ")[1].split()[0])
    assert time.time() - entered < 20, f"the job ended {time.time() - entered:.0f} s after"
    line = f"hpcllm: error (rank 0): no progress for 3 s while waiting on {phase}; aborting the job"
    assert line in result.rank_stderr.get(0, ""), result.stderr
    assert "hpcllm: error (rank 1)" not in result.stderr  # resumed to be killed: not its wait
    # (Open MPI resumes the stopped rank to kill it, so the two may still finish their
    # all-reduce and print before the kill lands: what ends the job is the line above.)
    assert line in (tmp_path / "hang-rank00000.txt").read_text()


@pytest.mark.mpi
@pytest.mark.parametrize("given", [[], ["60"]], ids=["by-init", "set-after-a-longer-init"])
def test_init_timeout_bounds_torch_collectives(given):
    # set-after-a-longer-init: the trainer's groups wait the start-up allowance until the first
    # step is done, then run.timeout_s's backstop (topology.set_timeout).
    script = python("tests/mpi_scripts/watchdog_dist_timeout.py", "2", "10", *given)
    result = run_mpi(2, script, timeout=90)
    result.check()
    rows = [json.loads(line) for line in result.rank_stdout[0].splitlines()]
    assert [row["group"] for row in rows] == ["world", "dp"]
    for row in rows:
        assert row["error"], row
        assert 1.5 < row["waited_s"] < 6, row


@pytest.mark.parametrize(
    "timeout_s, preset, expected",
    [
        (600.0, {}, ("60", "600")),
        (3.0, {}, ("1", "3")),
        (1.0, {}, ("1", "2")),  # Horovod ignores a shutdown time not above the warning's
        (600.0, {"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "0"}, ("60", "0")),  # the user's wins
        (None, {}, (None, None)),
    ],
)
def test_horovod_stall_check_follows_the_grid_timeout(monkeypatch, timeout_s, preset, expected):
    import os
    import sys
    from types import SimpleNamespace

    from hpcllm.parallel.data.horovod import HOROVOD_KEYS, HorovodEngine

    names = ("HOROVOD_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")
    # Every variable the engine sets, so that they are restored after the test.
    settings = [variable for variable, _ in HOROVOD_KEYS.values()]
    for name in (*names, *settings, "HOROVOD_CPU_OPERATIONS"):
        # Set, then deleted: monkeypatch restores only what it saw, and the engine sets these.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name, value in preset.items():
        monkeypatch.setenv(name, value)
    seen = {}
    fake = SimpleNamespace(
        init=lambda comm: seen.update({n: os.environ.get(n) for n in names}),
        size=lambda: 2,
        Compression=SimpleNamespace(none="none", fp16="fp16"),
    )
    monkeypatch.setitem(sys.modules, "horovod.torch", fake)
    if "horovod" in sys.modules:  # `import horovod.torch` takes the package's attribute first
        monkeypatch.setattr(sys.modules["horovod"], "torch", fake, raising=False)
    HorovodEngine(
        SimpleNamespace(groups=SimpleNamespace(dp_comm=object()), dp=2, ep=1, timeout_s=timeout_s)
    )
    assert (seen[names[0]], seen[names[1]]) == expected


@pytest.mark.slow
def test_a_phase_that_computes_too_gets_its_allowance_and_progress_resets_the_clock(aborts):
    dog = watchdog.start(0.3, rank=0, abort=aborts)
    with watchdog.waiting("train step", allow_s=1.0, step=4):
        time.sleep(0.9)  # past the timeout, inside the allowance
        assert not aborts.called.is_set()
    with watchdog.waiting("checkpoint save", step=4):
        for _ in range(8):  # 0.8 s of writing, each chunk a sign of progress
            time.sleep(0.1)
            watchdog.progress()
        assert not aborts.called.is_set()
    with watchdog.waiting("train step", allow_s=0.5, step=5):
        assert aborts.called.wait(5)  # past timeout plus allowance: stuck
    dog.stop()
    assert aborts.codes == [1] and "train step (step=5)" in dog.fired


@pytest.mark.mpi
@pytest.mark.parametrize("phase", ["MPI start", "torch rendezvous"])
def test_a_rank_stopped_during_start_up_ends_the_job_naming_the_phase(tmp_path, phase):
    # MPI's start holds the GIL until every rank joins, so no thread can watch it: the watcher
    # process forked before it does. Rank 1 stops itself (SIGSTOP) as it enters the phase.
    import time

    allowance = 10
    sets = ["data.synthetic=true", "model.vocab_size=512", f"run.startup_timeout_s={allowance}"]
    started = time.monotonic()
    result = train(2, None, tmp_path / "run", *sets, "train.steps=2", timeout=120,
                   env={"HPCLLM_STOP_AT": f"{phase}:1"})  # fmt: skip
    took = time.monotonic() - started
    assert result.returncode != 0 and took < allowance + 10, took
    said = [
        (rank, line)
        for rank, stream in result.rank_stderr.items()
        for line in stream.splitlines()
        if "start-up stalled" in line
    ]
    assert len(said) == 1, said  # the first watcher to give up says it, once
    assert f"is in {phase}; ranks not heard from: 1 (stopped in {phase})" in said[0][1]


@pytest.mark.mpi
def test_a_rank_stopped_in_step_1_ends_the_job_by_the_watcher_before_any_collective_timeout(
    tmp_path,
):
    # The first step may compile for longer than run.timeout_s, so until it is done the
    # groups' own timeout (gloo's) must not end a stall before the start-up watcher's
    # allowance does, with its one line naming the phase and the rank. Rank 1 stops itself as
    # it enters step 1; rank 0 waits for it in the step's gradient all-reduce (ddp), whose
    # gloo timeout at run.timeout_s plus the backstop's 5 s used to end the job first, in a
    # traceback.
    allowance = 20
    sets = [
        *SMALLEST,
        "parallel.dp_engine=ddp",
        "data.synthetic=true",
        "model.vocab_size=512",
        "train.steps=2",
        "run.timeout_s=1",
        f"run.startup_timeout_s={allowance}",
        "run.tensorboard=false",
    ]
    started = time.monotonic()
    stop = {"HPCLLM_STOP_AT": "step 1:1"}
    result = train(2, None, tmp_path / "run", *sets, timeout=120, env=stop)
    took = time.monotonic() - started
    everything = result.stderr + "".join(result.rank_stderr.values())
    assert result.returncode != 0, everything
    # Bounded: the watcher ends the job at the allowance, counted from its start, which
    # comes after the interpreter's own start (seconds, on a busy machine).
    assert took < allowance + 30, (took, everything)
    said = [
        line
        for stream in result.rank_stderr.values()
        for line in stream.splitlines()
        if "start-up stalled" in line
    ]
    assert len(said) == 1, everything  # the first watcher to give up says it, once
    assert "is in step 1; ranks not heard from: 1 (stopped in step 1)" in said[0], said
    assert "(run.startup_timeout_s)" in said[0]
    for backend_word in ("Traceback", "Gloo", "gloo", "timed out", "Timed out"):
        assert backend_word not in everything, everything


def test_a_reader_that_stalls_is_named_not_the_step_around_it(aborts, capsys):
    import torch

    from hpcllm.train.stage_work import MicroBatches

    release = threading.Event()

    def stalled_reader():  # a reader stuck on its files (a blend's, or one folder's)
        release.wait(10)
        yield None

    watchdog.start(0.3, rank=0, abort=aborts)
    batches = MicroBatches(stalled_reader(), 2, torch.device("cpu"))
    with watchdog.waiting("train step", allow_s=60, step=9):
        reader = threading.Thread(target=lambda: aborts.called.wait(5) and release.set())
        reader.start()
        with pytest.raises(AttributeError):  # the stub's None is no micro-batch
            batches[0]
        reader.join()
    assert aborts.codes == [1]
    said = capsys.readouterr().err
    assert "waiting on micro-batch from the data reader (microbatch=0, step=9)" in said, said
