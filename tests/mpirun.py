"""Run a command under ``mpirun -np N`` and return each rank's output.

Every multi-rank test goes through :func:`run_mpi`: it starts mpirun as hpcllm does
(:func:`hpcllm.launcher.mpirun_command`: root-safe, oversubscribing the two cores of a CI
machine), pins one torch thread per rank, and kills the whole process group when the timeout
passes, so a hung collective fails the test instead of hanging CI.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hpcllm.launcher import mpirun_command, mpirun_env

REPO = Path(__file__).resolve().parent.parent
_RANK_DIR = re.compile(r"^rank\.(\d+)$")


@dataclass
class MpiResult:
    """What an mpirun job gave back: exit code, raw streams, and lines split by rank."""

    returncode: int
    stdout: str
    stderr: str
    rank_stdout: dict[int, str] = field(default_factory=dict)
    rank_stderr: dict[int, str] = field(default_factory=dict)

    def check(self) -> MpiResult:
        """Return self, or fail with every rank's output if the job did not exit 0."""
        if self.returncode != 0:
            raise AssertionError(f"mpirun exited {self.returncode}\n{self.stdout}\n{self.stderr}")
        return self


class MpiTimeout(AssertionError):
    """The job ran past its timeout and was killed."""


def mpi_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Return an environment for mpirun on a small shared machine, as root or not."""
    return mpirun_env(
        {
            # Ranks outnumber cores: one thread each keeps them from fighting.
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            # Containers often forbid the cross-memory-attach syscalls the shared-memory BTL uses.
            "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
            **(extra or {}),
        }
    )


def run_mpi(
    np: int,
    command: list[str],
    timeout: float = 180,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
) -> MpiResult:
    """Run ``command`` on ``np`` ranks and return the result; kill the job after ``timeout`` s."""
    with tempfile.TemporaryDirectory(prefix="hpcllm-mpi-") as outdir:
        # Per-rank files, because --tag-output interleaves tags mid-line in Open MPI 4.1.
        argv = mpirun_command(np, command, options=["--output-filename", outdir])
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=mpi_env(env),
            cwd=cwd or REPO,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise MpiTimeout(
                f"mpirun -np {np} {' '.join(command)} ran past {timeout} s and "
                f"was killed\n{out}\n{err}"
            ) from None
        result = MpiResult(proc.returncode, out, err)
        for rank_dir in Path(outdir).glob("*/rank.*"):
            rank = int(_RANK_DIR.match(rank_dir.name)[1])
            for stream, target in (("stdout", result.rank_stdout), ("stderr", result.rank_stderr)):
                path = rank_dir / stream
                if path.exists() and path.stat().st_size:
                    target[rank] = path.read_text()
    return result


# Every script runs through this, which ends its process as the hpcllm command does.
SCRIPT_RUNNER = REPO / "tests" / "script_runner.py"


def python(*args: str) -> list[str]:
    """Return a command that runs this interpreter (the venv's) with ``args``; a script
    (``args`` opening with a ``.py`` path) runs through :data:`SCRIPT_RUNNER`, so that a
    process that started torch.distributed never finalises (docs/reliability.md, "A clean
    end")."""
    if args and args[0].endswith(".py"):
        return [sys.executable, str(SCRIPT_RUNNER), *args]
    return [sys.executable, *args]
