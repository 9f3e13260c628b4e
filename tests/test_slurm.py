import json
import os
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
