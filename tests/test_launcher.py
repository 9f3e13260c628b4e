import pytest

from hpcllm.errors import UserError
from hpcllm.topology import Launch, detect_launcher


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


def test_single_process_in_an_sbatch_script_is_not_mistaken_for_srun():
    # The batch step has SLURM_PROCID and the allocation's task count but is not an srun step.
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "17"}
    assert detect_launcher(env).launcher == "single"


def test_one_task_srun_without_pmi_runs_as_a_single_process():
    env = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "3", "SLURM_STEP_NUM_TASKS": "1"}
    assert detect_launcher(env).launcher == "single"
