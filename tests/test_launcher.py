import os

import pytest

from hpcllm.errors import UserError
from hpcllm.launcher import (
    Launch,
    detect_launcher,
    launch_rank,
    mpirun_command,
    mpirun_env,
)


def test_no_launcher_is_a_single_process():
    assert detect_launcher({}) == Launch("single", 0, 1, 0, 1)


def test_open_mpi():
    env = {
        "OMPI_COMM_WORLD_RANK": "5",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    }
    assert detect_launcher(env) == Launch("openmpi", 5, 8, 1, 4)


def test_open_mpi_inside_an_sbatch_allocation_wins_over_slurm():
    env = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "3",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "4",
        "SLURM_JOB_ID": "17",
    }
    assert detect_launcher(env) == Launch("openmpi", 3, 4, 3, 4)


def test_mpich_hydra():
    env = {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"}
    assert detect_launcher(env) == Launch("hydra", 2, 3, 0, 1)


def test_srun_with_pmix():
    env = {
        "SLURM_PROCID": "6",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_NTASKS": "16",
        "SLURM_LOCALID": "2",
        "SLURM_STEP_TASKS_PER_NODE": "4",
        "PMIX_RANK": "6",
    }
    assert detect_launcher(env) == Launch("slurm", 6, 8, 2, 4)


def test_srun_without_pmi_names_the_fix():
    env = {
        "SLURM_PROCID": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_LOCALID": "1",
    }
    with pytest.raises(UserError, match="--mpi=pmix"):
        detect_launcher(env)
    # The tasks still know their ranks, so that only rank 0 prints the error.
    assert launch_rank(env) == 1


def test_single_process_in_an_sbatch_script_is_not_mistaken_for_srun():
    # The batch step has SLURM_PROCID and the allocation's task count but is not an srun step.
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "17"}
    assert detect_launcher(env).launcher == "single"


def test_one_task_srun_without_pmi_runs_as_a_single_process():
    env = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "3", "SLURM_STEP_NUM_TASKS": "1"}
    assert detect_launcher(env).launcher == "single"


def test_launch_rank_follows_detect_launchers_precedence():
    # mpirun inside an sbatch allocation: Open MPI's rank, not the batch step's SLURM_PROCID.
    env = {"OMPI_COMM_WORLD_RANK": "3", "SLURM_PROCID": "0", "PMIX_RANK": "0"}
    assert launch_rank(env) == detect_launcher(env).rank == 3
    env = {"SLURM_PROCID": "6", "SLURM_STEP_ID": "0", "PMIX_RANK": "6", "PMI_RANK": "1"}
    assert launch_rank(env) == detect_launcher(env).rank == 6
    assert launch_rank({"PMI_RANK": "2", "PMI_SIZE": "3"}) == 2
    assert launch_rank({}) == 0


def test_mpirun_command_oversubscribes_and_exports(monkeypatch, tmp_path):
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    cmd = mpirun_command(
        3, ["python", "x.py"], export=["OMP_NUM_THREADS"], options=["--output-filename", "d"]
    )
    assert cmd == [
        str(fake),
        "-np",
        "3",
        "--oversubscribe",
        "--bind-to",
        "none",
        "-x",
        "OMP_NUM_THREADS",
        "--output-filename",
        "d",
        "python",
        "x.py",
    ]


def test_missing_mpirun_names_make_setup(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UserError, match="make setup"):
        mpirun_command(2, ["true"])


def test_mpirun_env_lets_root_run_mpirun(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    env = mpirun_env({"OMP_NUM_THREADS": "2"})
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert env["OMP_NUM_THREADS"] == "2"
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.delenv("OMPI_ALLOW_RUN_AS_ROOT", raising=False)
    assert "OMPI_ALLOW_RUN_AS_ROOT" not in mpirun_env()
