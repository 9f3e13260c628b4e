import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import slurm_cluster

from hpcllm.topology import Layout

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm")
    try:
        with slurm_cluster.start(root) as env:
            env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
            env["OMP_NUM_THREADS"] = "1"
            yield env
    except slurm_cluster.SlurmUnavailable as why:
        pytest.skip(f"Slurm cannot start on this machine: {why}")


def _srun(env, *args, timeout=180):
    return subprocess.run(["srun", *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_srun_pmix_starts_the_grid(slurm):
    run = _srun(slurm, "--mpi=pmix", "-n", "4", "hpcllm", "topo", "--tp", "2", "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["launcher"] == "slurm"
    assert (report["world_size"], report["tp"], report["pp"], report["dp"]) == (4, 2, 1, 2)
    layout = Layout(2, 1, 2)
    for rank, row in enumerate(report["ranks"]):
        assert [row["tp_rank"], row["pp_rank"], row["dp_rank"]] == list(layout.coords(rank))
        assert row["tp_group"] == layout.tp_group(rank)
        assert row["dp_group"] == layout.dp_group(rank)
        assert row["local_rank"] == rank  # one node: SLURM_LOCALID equals the rank


def test_srun_without_pmi_says_to_add_mpi_pmix(slurm):
    run = _srun(slurm, "--mpi=none", "-n", "2", "hpcllm", "topo", timeout=60)
    assert run.returncode == 2
    ours = [line for line in run.stderr.splitlines() if line.startswith("hpcllm:")]
    assert len(ours) == 1 and "--mpi=pmix" in ours[0], run.stderr
    assert "Traceback" not in run.stderr


def test_sbatch_job_script(slurm, tmp_path):
    # The script asks for 2 nodes of 4 GPUs; the test cluster is one node without GPUs.
    run = subprocess.run(
        [
            "sbatch",
            "--wait",
            "--nodes=1",
            "--ntasks-per-node=4",
            "--gpus-per-node=0",
            "--cpus-per-task=1",
            f"--output={tmp_path}/job.out",
            "--chdir",
            str(tmp_path),
            "--export=ALL,HPCLLM=" + str(Path(sys.executable).parent / "hpcllm"),
            str(Path(__file__).parent.parent / "jobs" / "slurm.sbatch"),
            "topo",
            "--pp",
            "2",
            "--json",
        ],
        env=slurm,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr + (tmp_path / "job.out").read_text()
    # srun may warn first (no cpu binding on the test cluster); the report is the last line.
    report = json.loads((tmp_path / "job.out").read_text().splitlines()[-1])
    assert (report["world_size"], report["pp"], report["dp"]) == (4, 2, 2)
    assert report["launcher"] == "slurm"


def _job_gone(env, job: str, out: str) -> bool:
    """Return whether the requeued run has finished: its output shows the resumed run ended
    (a summary after "resumes from step") and the job's record (`scontrol show job`) is in a
    final state. Neither alone: `squeue` can list nothing between a job's end and its
    requeue, and the first run passes through final states (CANCELLED "due to job requeue",
    even COMPLETED with the restart already counted) on its way back to PENDING."""
    resumed = out.find("resumes from step")
    if resumed < 0 or "\ntrained " not in out[resumed:]:
        return False
    shown = subprocess.run(
        ["scontrol", "-o", "show", "job", job], env=env, capture_output=True, text=True
    )
    if shown.returncode != 0:
        return "Invalid job id" in shown.stderr  # purged: long gone
    state = re.search(r"\bJobState=(\S+)", shown.stdout)
    return state is not None and state.group(1) in ("COMPLETED", "FAILED")


def test_a_preempted_job_saves_requeues_itself_and_resumes_to_the_same_losses(slurm, tmp_path):
    import time

    from hpcllm.observe import read_metrics

    hpcllm = str(Path(sys.executable).parent / "hpcllm")
    data = tmp_path / "data"
    prepared = subprocess.run(
        [hpcllm, "prepare", "--corpus", "python-stdlib", "--tokenizer", "byte", "--out", str(data)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert prepared.returncode == 0, prepared.stderr
    sets = [
        "model.preset=null", "model.n_layer=2", "model.n_head=2", "model.d_model=64",
        "model.seq_len=64", "train.micro_batch_size=4", "train.log_interval=1",
        "train.eval_interval=0", "run.tensorboard=false", f"data.path={data}", "train.steps=40",
    ]  # fmt: skip
    # Slow steps (a straggler's sleep, which changes no loss), so that the signal lands
    # mid-run: at 10 ms a step the run could end before the poll below saw 3 steps. The
    # reference runs at full speed.
    slow = ["train.straggler_rank=1", "train.straggler_factor=20"]

    def train_args(run, extra=()):
        args = ["train", "--no-progress"]
        for item in [*sets, *extra, f"run.dir={run}"]:
            args += ["--set", item]
        return args

    job = subprocess.run(
        [
            "sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0",
            "--cpus-per-task=1", f"--output={tmp_path}/job.out", "--chdir", str(tmp_path),
            "--export=ALL,HPCLLM=" + hpcllm,
            str(Path(__file__).parent.parent / "jobs" / "slurm.sbatch"),
            *train_args(tmp_path / "run", slow),
        ],
        env=slurm, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert job.returncode == 0, job.stderr
    job_id = job.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # the preemption signal once a few steps are logged
        metrics = tmp_path / "run" / "metrics.jsonl"
        if metrics.exists() and len(read_metrics(tmp_path / "run")) >= 3:
            break
        time.sleep(0.5)
    signalled = subprocess.run(
        ["scancel", "--signal=USR1", job_id], env=slurm, capture_output=True, text=True
    )
    assert signalled.returncode == 0, signalled.stderr

    def output() -> str:
        return (tmp_path / "job.out").read_text()

    # A requeued job waits out its old credential before it starts again (Slurm's default
    # 120 s; the test cluster sets cred_expire=10 and schedules every 2 s): forcing an earlier
    # start makes the node kill it ("Job credential revoked").
    while time.monotonic() < deadline and not _job_gone(slurm, job_id, output()):
        time.sleep(1)
    out = output()
    record = subprocess.run(
        ["scontrol", "-o", "show", "job", job_id], env=slurm, capture_output=True, text=True
    )
    assert _job_gone(slurm, job_id, out), out + record.stdout + record.stderr
    assert f"requeueing job {job_id}" in out and "stopped by SIGUSR1" in out, out
    assert "resumes from step" in out, out  # the requeued job continued the run
    resumed = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "run")}
    assert sorted(resumed) == list(range(1, 41)), out

    reference = _srun(
        slurm, "--mpi=pmix", "-n", "2", hpcllm, *train_args(tmp_path / "reference"), timeout=240
    )
    assert reference.returncode == 0, reference.stderr
    for record in read_metrics(tmp_path / "reference"):
        assert resumed[record["step"]] == pytest.approx(record["loss"], rel=1e-5), record["step"]
