"""The job scripts as a user runs them: jobs/mpirun.sh's placement and environment (DRY_RUN),
jobs/nsys.sh's Nsight Systems line (a fake nsys records it)."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import REPO

from hpcllm.topology import Layout

MPIRUN_SH = REPO / "jobs" / "mpirun.sh"


def _dry_run(tmp_path, args, **env):
    # A fake mpirun first on the PATH: a dry run must not start it.
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "mpirun").write_text(f"#!/bin/sh\ntouch {tmp_path / 'started'}\n")
    (fake / "mpirun").chmod(0o755)
    environ = {
        k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "HOROVOD_", "TORCH_"))
    }
    environ.update(PATH=f"{fake}{os.pathsep}{environ['PATH']}", DRY_RUN="1", **env)
    done = subprocess.run(
        [str(MPIRUN_SH), *args], env=environ, capture_output=True, text=True, timeout=60
    )
    assert not (tmp_path / "started").exists(), "DRY_RUN started mpirun"
    return done


def _table(stdout: str) -> dict[int, tuple[str, int, int]]:
    lines = stdout.splitlines()
    start = lines.index("rank  host  local_rank  gpu") + 1
    rows = {}
    for line in lines[start:]:
        rank, host, local, gpu = line.split()
        rows[int(rank)] = (host, int(local), int(gpu))
    return rows


def test_dry_run_places_tensor_parallel_groups_inside_hosts(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two DGX nodes\nnode-a slots=8\nnode-b slots=8\n")
    done = _dry_run(
        tmp_path,
        ["train", "--set", "parallel.tp=8", "--set", "parallel.pp=2"],
        NP="16",
        GPUS_PER_NODE="8",
        HOSTFILE=str(hostfile),
    )
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stderr
    command = shlex.split(done.stdout.splitlines()[0])
    assert command[:3] == ["mpirun", "-np", "16"] and "ppr:8:node" in command
    assert command[command.index("--hostfile") + 1] == str(hostfile)
    rows = _table(done.stdout)
    assert sorted(rows) == list(range(16))
    layout = Layout(8, 2, 1)
    for rank, (host, local, gpu) in rows.items():
        assert host == ("node-a" if rank < 8 else "node-b")
        assert local == gpu == rank % 8
        assert {rows[r][0] for r in layout.tp_group(rank)} == {host}, rank


def test_dry_run_reads_hostfiles_as_open_mpi_does(tmp_path):
    hostfile = tmp_path / "hosts"
    # A host listed twice is one host; the last line has no newline.
    hostfile.write_text("node-a slots=4\n\n# spare\nnode-a\nnode-b slots=4")
    done = _dry_run(tmp_path, ["topo"], NP="8", GPUS_PER_NODE="4", HOSTFILE=str(hostfile))
    assert done.returncode == 0, done.stderr
    hosts = [host for host, _, _ in _table(done.stdout).values()]
    assert hosts == ["node-a"] * 4 + ["node-b"] * 4


def test_dry_run_forwards_every_setting_the_ranks_read(tmp_path):
    read = {
        "NCCL_IB_HCA": "mlx5_0",
        "NCCL_DEBUG": "INFO",
        "HOROVOD_FUSION_THRESHOLD": "67108864",
        "HOROVOD_CYCLE_TIME": "5",
        "HOROVOD_AUTOTUNE": "1",
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "MASTER_ADDR": "node-a",
        "MASTER_PORT": "29500",
        "TRITON_INTERPRET": "1",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "HPCLLM_CACHE": "/tmp/cache",
        # A model family registered as a plugin (docs/models.md, "Adding a family").
        "HPCLLM_FAMILIES": "my_family",
        "PYTHONPATH": "/opt/families",
        "UNRELATED_SETTING": "x",
    }
    done = _dry_run(tmp_path, ["topo", "--tp", "2"], NP="4", **read)
    assert done.returncode == 0, done.stderr
    command = shlex.split(done.stdout.splitlines()[0])
    forwarded = {command[i + 1] for i, word in enumerate(command) if word == "-x"}
    expected = set(read) - {"UNRELATED_SETTING"}
    # And what the script sets itself: threads, Horovod's CPU path, the PATH.
    expected |= {"OMP_NUM_THREADS", "HOROVOD_CPU_OPERATIONS", "PATH"}
    assert expected <= forwarded, expected - forwarded
    assert "UNRELATED_SETTING" not in forwarded


def test_dry_run_warns_of_groups_across_nodes_and_refuses_too_few_hosts(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a\nnode-b\n")
    across = _dry_run(
        tmp_path, ["topo", "--tp", "4"], NP="12", GPUS_PER_NODE="6", HOSTFILE=str(hostfile)
    )
    assert across.returncode == 0
    assert "tensor-parallel groups will span nodes" in across.stderr
    assert "all-to-alls" not in across.stderr
    # t·ep past a node: the expert-parallel all-to-all crosses nodes (both spellings).
    for args in (["topo", "--tp", "2", "--ep", "8"], ["train", "--set", "parallel.ep=8",
                 "--set", "parallel.tp=2"]):  # fmt: skip
        wide = _dry_run(tmp_path, args, NP="16", GPUS_PER_NODE="8", HOSTFILE=str(hostfile))
        assert wide.returncode == 0 and "tp*ep = 16 exceeds GPUS_PER_NODE=8" in wide.stderr, args
    # t·cp past a node: the context-parallel gathers cross nodes (both spellings).
    for args in (["topo", "--tp", "4", "--cp", "4"], ["train", "--set", "parallel.cp=4",
                 "--set", "parallel.tp=4"]):  # fmt: skip
        wide = _dry_run(tmp_path, args, NP="16", GPUS_PER_NODE="8", HOSTFILE=str(hostfile))
        assert wide.returncode == 0 and "tp*cp = 16 exceeds GPUS_PER_NODE=8" in wide.stderr, args
        assert "key/value gathers will cross nodes" in wide.stderr
    short = _dry_run(tmp_path, ["topo"], NP="24", GPUS_PER_NODE="8", HOSTFILE=str(hostfile))
    assert short.returncode == 2
    assert short.stderr.strip() == (
        "hpcllm: error: NP=24 at GPUS_PER_NODE=8 needs 3 hosts; the hostfile lists 2"
    )


NSYS_SH = REPO / "jobs" / "nsys.sh"

# Records its arguments per rank; with FAKE_NSYS_EXEC set, runs the application it was given
# (the first word after the options), as nsys does.
FAKE_NSYS = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$FAKE_NSYS_LOG/rank${OMPI_COMM_WORLD_RANK:-0}.args"
[ -n "${FAKE_NSYS_EXEC:-}" ] || exit 0
shift  # profile
while [ "${1:0:1}" = "-" ]; do shift; done
exec "$@"
"""


def _fake_nsys(tmp_path, **env) -> dict[str, str]:
    fake = tmp_path / "fake-bin"
    fake.mkdir(exist_ok=True)
    (fake / "nsys").write_text(FAKE_NSYS)
    (fake / "nsys").chmod(0o755)
    log = tmp_path / "nsys-log"
    log.mkdir(exist_ok=True)
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_", "NSYS_", "PROFILE_STEPS"))
    }
    environ.update(
        PATH=f"{fake}{os.pathsep}{environ['PATH']}",
        FAKE_NSYS_LOG=str(log),
        NSYS_DIR=str(tmp_path / "reports"),
        HPCLLM_BIN="hpcllm-under-test",
    )
    environ.update(env)
    return environ


def _recorded(tmp_path, rank: int = 0) -> list[str]:
    return (tmp_path / "nsys-log" / f"rank{rank}.args").read_text().splitlines()


def test_nsys_wrapper_captures_the_profile_steps_of_train(tmp_path):
    for extra, env, steps in (
        ([], {}, ["--profile-steps", "5:8"]),
        ([], {"PROFILE_STEPS": "20:22"}, ["--profile-steps", "20:22"]),
        (["--profile-steps", "3:4"], {}, []),
    ):
        done = subprocess.run(
            [str(NSYS_SH), "train", "--config", "run.yaml", *extra],
            env=_fake_nsys(tmp_path, **env),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        args = _recorded(tmp_path)
        assert args[0] == "profile"
        assert "--trace=cuda,nvtx,osrt" in args  # no MPI launcher: OS runtime calls instead
        assert "--capture-range=cudaProfilerApi" in args
        assert "--capture-range-end=stop" in args
        assert f"--output={tmp_path / 'reports'}/hpcllm-rank0" in args
        app = args.index("hpcllm-under-test")
        assert args[app + 1 :] == ["train", "--config", "run.yaml", *extra, *steps]
    assert (tmp_path / "reports").is_dir()


@pytest.mark.mpi
def test_nsys_wrapper_writes_one_report_per_rank_under_mpirun(tmp_path):
    env = _fake_nsys(
        tmp_path,
        FAKE_NSYS_EXEC="1",
        HPCLLM=str(NSYS_SH),
        HPCLLM_BIN=str(Path(sys.executable).parent / "hpcllm"),
        NP="2",
    )
    done = subprocess.run(
        [str(MPIRUN_SH), "topo", "--json"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["world_size"] == 2  # the ranks ran
    for rank in (0, 1):
        args = _recorded(tmp_path, rank)
        assert "--trace=cuda,nvtx,mpi" in args and "--mpi-impl=openmpi" in args
        assert f"--output={tmp_path / 'reports'}/hpcllm-rank{rank}" in args
        assert not any(a.startswith("--capture-range") for a in args)  # not train: whole run


COLLECTIVES_SH = REPO / "jobs" / "collectives.sh"


def test_collectives_between_nodes_place_a_rank_on_every_gpu_then_merge(tmp_path):
    # jobs/collectives.sh: NODES x GPUS_PER_NODE ranks through jobs/mpirun.sh's placement (or
    # srun's), the benchmark's JSON in the report's raw/, then bench report --merge of it.
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb slots=2\nc slots=2\n")
    fake = tmp_path / "bin"
    fake.mkdir()
    for tool in ("mpirun", "srun"):
        (fake / tool).write_text(f"#!/bin/sh\ntouch {tmp_path / 'started'}\n")
        (fake / tool).chmod(0o755)
    environ = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "DRY_RUN": "1"}
    report = tmp_path / "report"

    def run(**env):
        return subprocess.run(
            [str(COLLECTIVES_SH), str(report), "--max-bytes", "64M"],
            env={**environ, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )

    done = run(NODES="2", GPUS_PER_NODE="2", HOSTFILE=str(hostfile))
    assert done.returncode == 0, done.stderr
    command = shlex.split(done.stdout.splitlines()[0])
    assert command[command.index("-np") + 1] == "4"
    assert command[command.index("--map-by") + 1] == "ppr:2:node"
    result = str(report / "raw" / "collectives-2-nodes.json")
    assert command[-6:] == ["collectives", "--json", result, "--no-progress", "--max-bytes", "64M"]
    assert _table(done.stdout.split("\n\nthen:")[0]) == {
        0: ("a", 0, 0), 1: ("a", 1, 1), 2: ("b", 0, 0), 3: ("b", 1, 1)
    }  # fmt: skip
    merge = shlex.split(done.stdout.split("then:")[1])
    assert merge[1:] == ["bench", "report", "--out", str(report), "--merge", result]
    srun = run(LAUNCHER="srun", NODES="3", GPUS_PER_NODE="8")
    assert srun.returncode == 0, srun.stderr
    line = shlex.split(srun.stdout.splitlines()[0])
    assert line[:4] == ["srun", "--mpi=pmix", "--nodes=3", "--ntasks-per-node=8"]
    assert not (tmp_path / "started").exists(), "DRY_RUN started a launcher"
    # One node measures no link between nodes; without a report there is nothing to add to.
    assert run(NODES="1").returncode == 2
    missing = subprocess.run(
        [str(COLLECTIVES_SH), str(report)], env={**environ, "DRY_RUN": "0"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert missing.returncode == 2 and "has no report.json" in missing.stderr
    assert not (tmp_path / "started").exists()


@pytest.mark.mpi
def test_sigterm_to_the_launcher_returns_after_every_rank_saved(tmp_path):
    # A TERM to jobs/mpirun.sh (kill, a scheduler) stops the job as SIGUSR1 does: the ranks
    # save, exit 75, and the script returns after that. mpirun alone would kill the ranks 2 s
    # after forwarding a TERM, in the middle of this model's save (about 0.7 GB of weights and
    # Adam moments).
    import signal
    import time

    from hpcllm.train import checkpoint

    run = tmp_path / "run"
    sets = ["model.preset=null", "model.n_layer=8", "model.n_head=12", "model.d_model=768",
            "model.seq_len=32", "model.vocab_size=512", "data.synthetic=true",
            "train.micro_batch_size=1", "train.steps=100000", "train.log_interval=1",
            "train.eval_interval=0", "train.save_interval=0", "run.tensorboard=false",
            f"run.dir={run}"]  # fmt: skip
    args = [arg for item in sets for arg in ("--set", item)]
    environ = {**os.environ, "NP": "2", "HPCLLM": str(Path(sys.executable).parent / "hpcllm")}
    proc = subprocess.Popen(
        [str(MPIRUN_SH), "train", "--no-progress", *args], env=environ,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, err[-3000:]  # stopped after saving: resume me
    assert "non-zero" not in err, err[-3000:]  # no Open MPI notice after the clean stop
    alive = subprocess.run(["pgrep", "-f", str(run)], capture_output=True, text=True)
    assert alive.stdout.strip() == "", "a rank outlived the launcher"
    newest = checkpoint.latest(run)
    assert newest is not None and checkpoint.verify(newest).status == "ok"
    assert not list((run / "checkpoints").glob(".*partial*"))


# Rank 1 ends as told, with an exit code or (segv) by SIGSEGV; rank 0 with it too after a
# clean stop (every rank exits 75), else it waits until mpirun ends the job.
FAKE_RANK = """#!/bin/sh
if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then
  [ "$1" = segv ] && kill -SEGV $$
  exit "$1"
fi
[ "$1" = 75 ] && exit 75
exec sleep 60
"""


@pytest.mark.mpi
def test_the_launcher_ends_said_exits_without_open_mpis_notices(tmp_path):
    # After a user error said in one line (2) or a clean stop (75) Open MPI's notices that "1
    # process returned a non-zero exit code" point the wrong way: jobs/mpirun.sh leaves them
    # out, keeping the code. After a crash's exit code or a signal they are shown. (Which
    # notices Open MPI prints varies from run to run; a fake mpirun checks each below.)
    fake = tmp_path / "rank"
    fake.write_text(FAKE_RANK)
    fake.chmod(0o755)
    environ = {**os.environ, "NP": "2", "OMPI_MCA_btl_vader_single_copy_mechanism": "none"}

    def launch(program, *args):
        return subprocess.run(
            [str(MPIRUN_SH), *args], env={**environ, "HPCLLM": str(program)}, cwd=tmp_path,
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip

    hpcllm = Path(sys.executable).parent / "hpcllm"
    said = launch(hpcllm, "train", "--set", "train.steps=-1", "--set", "data.synthetic=true")
    assert said.returncode == 2
    assert said.stderr.splitlines() == ["hpcllm: error: train.steps must be positive, got -1"]
    stopped = launch(fake, "75")
    assert (stopped.returncode, stopped.stderr) == (75, "")
    for code, status in (("3", 3), ("segv", 128 + 11)):
        ended = launch(fake, code)
        assert ended.returncode == status and "non-zero exit code" in ended.stderr, ended.stderr


RULE = "-" * 74
PRIMARY = [
    RULE,
    "Primary job  terminated normally, but 1 process returned",
    "a non-zero exit code. Per user-direction, the job has been aborted.",
    RULE,
]


def _detected(code: int) -> list[str]:
    return [
        RULE,
        "mpirun detected that one or more processes exited with non-zero status, thus causing",
        "the job to be terminated. The first process to do so was:",
        "",
        "  Process name: [[28524,1],0]",
        f"  Exit code:    {code}",
        RULE,
    ]


SIGNALLED = [
    RULE,
    "mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 11 (Segmentation "
    "fault).",
    RULE,
]
ABORTED = [
    RULE,
    "MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD",
    "with errorcode 2.",
    "",
    "NOTE: invoking MPI_ABORT causes Open MPI to kill all MPI processes.",
    "You may or may not see output from other processes, depending on",
    "exactly when Open MPI kills them.",
    RULE,
    "[vm:04787] 1 more process has sent help message help-mpi-api.txt / mpi-abort",
    '[vm:04787] Set MCA parameter "orte_base_help_aggregate" to 0 to see all help / error messages',
]
UNLAUNCHED = [
    RULE,
    "mpirun was unable to launch the specified application as it could not access",
    "or execute an executable:",
    RULE,
]


@pytest.mark.parametrize(
    ("written", "status", "shown"),
    [
        # A user error (rank 0's line; another rank's between the notices) and a clean stop.
        (["hpcllm: error: bad", *PRIMARY, "rank 1", *_detected(2)], 2,
         ["hpcllm: error: bad", "rank 1"]),
        (PRIMARY, 75, []),
        (["hpcllm: error (rank 1): bad", *ABORTED], 2, ["hpcllm: error (rank 1): bad"]),
        # A crash, a signal, a code the notice alone gives, a failed launch: all shown.
        (["Traceback", *PRIMARY, *_detected(1)], 1, None),
        ([*PRIMARY, *SIGNALLED], 139, None),
        (PRIMARY, 3, None),
        (["hpcllm: error (rank 1): bad", *ABORTED[:2], "with errorcode 1.", *ABORTED[3:]], 1, None),
        (UNLAUNCHED, 134, None),
        # A rank's own lines of dashes, a clean end.
        (["table", RULE, RULE, "row", RULE, "last"], 0, None),
    ],
    ids=["user-error", "stop", "abort-2", "crash", "signal", "code-3", "abort-1", "launch",
         "dashes"],
)  # fmt: skip
def test_the_launcher_shows_every_notice_but_those_after_a_said_exit(
    tmp_path, written, status, shown
):
    # A fake mpirun writes what Open MPI 4.1 writes (recorded) on stderr and exits so.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "mpirun").write_text('#!/bin/sh\ncat "$FAKE_STDERR" >&2\nexit "$FAKE_STATUS"\n')
    (fake / "mpirun").chmod(0o755)
    (tmp_path / "stderr").write_text("".join(line + "\n" for line in written))
    done = subprocess.run(
        [str(MPIRUN_SH), "topo"],
        env={**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "NP": "2",
             "FAKE_STDERR": str(tmp_path / "stderr"), "FAKE_STATUS": str(status)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == status
    assert done.stderr.splitlines() == (written if shown is None else shown)
