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
    alive = subprocess.run(["pgrep", "-f", str(run)], capture_output=True, text=True)
    assert alive.stdout.strip() == "", "a rank outlived the launcher"
    newest = checkpoint.latest(run)
    assert newest is not None and checkpoint.verify(newest).status == "ok"
    assert not list((run / "checkpoints").glob(".*partial*"))
