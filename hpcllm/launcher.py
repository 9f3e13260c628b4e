"""Who started this process, and how to start more: launcher detection, MPI start-up, mpirun.

Next to the bottom of the package: it imports only :class:`~hpcllm.user_error.UserError`, so
every layer above it (errors included) reads the launcher's environment through the one
reader here, in one precedence.

* :func:`detect_launcher` reads the environment that mpirun, Hydra or srun set, without
  importing mpi4py, so a plain ``python`` run needs no MPI and ``srun`` without PMI is caught
  before MPI would abort;
* :func:`start_mpi` initialises MPI the way torch and Horovod need it;
* :func:`mpirun_command` and :func:`mpirun_env` are how hpcllm itself (``bench dp``,
  ``bench prepare``) and the test suite start ``mpirun -np N`` on one machine.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpcllm.user_error import UserError


@dataclass(frozen=True)
class Launch:
    """What the launcher's environment says about this process, read before MPI starts."""

    launcher: str  # "openmpi" | "hydra" | "slurm" | "single"
    rank: int
    world_size: int
    local_rank: int
    local_size: int


# What _read_launch calls srun tasks that have no PMI: never returned by detect_launcher.
_SRUN_WITHOUT_PMI = "srun-without-pmi"


def _int_env(env: Mapping[str, str], *keys: str) -> int | None:
    for key in keys:
        value = env.get(key)
        if value is not None and value.strip().isdigit():
            return int(value)
    return None


def _read_launch(env: Mapping[str, str]) -> Launch:
    """Return what the environment says, srun without PMI included; never raises.

    Open MPI is checked first because mpirun inside an sbatch allocation also inherits Slurm
    variables.
    """
    rank = _int_env(env, "OMPI_COMM_WORLD_RANK")
    if rank is not None:
        return Launch(
            launcher="openmpi",
            rank=rank,
            world_size=_int_env(env, "OMPI_COMM_WORLD_SIZE") or 1,
            local_rank=_int_env(env, "OMPI_COMM_WORLD_LOCAL_RANK") or 0,
            local_size=_int_env(env, "OMPI_COMM_WORLD_LOCAL_SIZE") or 1,
        )
    slurm_rank = _int_env(env, "SLURM_PROCID")
    in_srun_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    slurm_tasks = _int_env(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") or 1
    slurm_local = (
        _int_env(env, "SLURM_LOCALID") or 0,
        _int_env(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE") or 1,
    )
    if slurm_rank is not None and in_srun_step and "PMIX_RANK" in env:
        return Launch("slurm", slurm_rank, slurm_tasks, *slurm_local)
    rank = _int_env(env, "PMI_RANK")
    if rank is not None:
        return Launch(
            launcher="hydra",
            rank=rank,
            world_size=_int_env(env, "PMI_SIZE") or 1,
            local_rank=_int_env(env, "MPI_LOCALRANKID", "SLURM_LOCALID") or 0,
            local_size=_int_env(env, "MPI_LOCALNRANKS") or 1,
        )
    if slurm_rank is not None and in_srun_step and slurm_tasks > 1:
        return Launch(_SRUN_WITHOUT_PMI, slurm_rank, slurm_tasks, *slurm_local)
    return Launch(launcher="single", rank=0, world_size=1, local_rank=0, local_size=1)


def detect_launcher(env: Mapping[str, str] | None = None) -> Launch:
    """Return how this process was started, from the launcher's environment variables.

    Open MPI's mpirun sets ``OMPI_COMM_WORLD_*``; MPICH/Intel MPI's Hydra sets ``PMI_RANK`` and
    ``PMI_SIZE``; ``srun --mpi=pmix`` sets ``SLURM_PROCID`` with ``PMIX_RANK``. Open MPI is
    checked first because mpirun inside an sbatch allocation also inherits Slurm variables.
    ``srun`` with several tasks and no PMI raises a UserError here, before mpi4py is imported:
    MPI_Init would otherwise either abort or start every task as its own world of one.
    """
    launch = _read_launch(os.environ if env is None else env)
    if launch.launcher == _SRUN_WITHOUT_PMI:
        raise UserError(
            f"srun started {launch.world_size} tasks without PMI, so MPI cannot connect them; "
            "run `srun --mpi=pmix ...` (see `srun --mpi=list`)"
        )
    return launch


def launch_rank(env: Mapping[str, str] | None = None) -> int:
    """Return this process's world rank as the launcher's environment gives it (0 if none).

    Unlike :func:`detect_launcher` it never raises: the tasks of an srun without PMI still
    know their rank, so that only rank 0 prints the error that stops them.
    """
    return _read_launch(os.environ if env is None else env).rank


_ERROR_COMM: list[Any] = []


def start_mpi() -> Any:
    """Return the mpi4py.MPI module, initialising MPI with settings that suit torch and Horovod."""
    import mpi4py

    # Horovod's background thread calls MPI while the main thread may too, and Horovod expects
    # MPI_THREAD_MULTIPLE when it finds MPI already initialised.
    mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    if not _ERROR_COMM:
        # Made here, where every rank passes together, so that the error path never needs a
        # collective of its own and its barrier cannot match one of the program's.
        _ERROR_COMM.append(MPI.COMM_WORLD.Dup())
    return MPI


def error_comm() -> Any:
    """Return the communicator reserved for agreeing on errors (MPI started first)."""
    start_mpi()
    return _ERROR_COMM[0]


def mpirun_command(
    np: int,
    argv: Sequence[str],
    *,
    export: Iterable[str] = (),
    options: Sequence[str] = (),
) -> list[str]:
    """Return the Open MPI command line that starts ``argv`` on ``np`` ranks of this machine.

    ``--oversubscribe``: ranks may outnumber cores (CPU runs, CI). ``--bind-to none``: each
    caller sets its ranks' threads itself, and Open MPI's default binding would pin a rank's
    threads to one core. ``export`` names variables passed on with ``-x`` (so that they reach
    ranks on other nodes too); ``options`` are further mpirun options.
    """
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise UserError("mpirun not found; `make setup` installs Open MPI")
    exported = [flag for name in export for flag in ("-x", name)]
    return [
        mpirun,
        "-np",
        str(np),
        "--oversubscribe",
        "--bind-to",
        "none",
        *exported,
        *options,
        *argv,
    ]


def mpirun_env(settings: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return this process's environment plus ``settings``, as mpirun needs it to start ranks.

    Open MPI refuses to run as root unless told twice; containers and CI often run as root.
    """
    env = dict(os.environ)
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.update(settings or {})
    return env
