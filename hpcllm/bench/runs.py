"""Running a benchmark's scratch training runs: each in a fresh folder, on its ranks.

``bench dp`` and ``bench sync`` train the same model under several engines, each run a real
``hpcllm train`` launched through mpirun (:func:`launch_ranks`) into a folder of its own
that the next benchmark replaces (:func:`fresh_run_dir`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from hpcllm.errors import UserError
from hpcllm.launcher import mpirun_command, mpirun_env


def launch_ranks(
    np_: int,
    args: list[str],
    timeout: float,
    force_mpirun: bool = False,
    threads: int | None = None,
    env: dict[str, str] | None = None,
    module: str = "hpcllm",
) -> None:
    """Run ``hpcllm ARGS`` (``python -m MODULE ARGS``) on ``np_`` ranks (through mpirun when
    more than one, or forced), with ``env`` added to the environment of every rank."""
    # Horovod's CPU collectives go through MPI under mpirun (its gloo path crashes there).
    settings = {"HOROVOD_CPU_OPERATIONS": os.environ.get("HOROVOD_CPU_OPERATIONS", "MPI")}
    settings.update(env or {})
    if threads is not None:
        settings["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", module, *args]
    if np_ > 1 or force_mpirun:
        cmd = mpirun_command(np_, cmd, export=settings)
    try:
        subprocess.run(
            cmd, check=True, env=mpirun_env(settings), timeout=timeout, stdout=subprocess.DEVNULL
        )
    except subprocess.CalledProcessError as err:
        # Its ranks said why on stderr, above.
        raise UserError(
            f"a benchmark run failed (exit {err.returncode}): hpcllm {' '.join(args)}"
        ) from None
    except subprocess.TimeoutExpired:
        raise UserError(
            f"a benchmark run took more than {timeout:g} s and was stopped: hpcllm {' '.join(args)}"
        ) from None


def train_args(config: Path | None, overrides: list[str], steps: int, *more: str) -> list[str]:
    """Return the ``hpcllm train`` arguments every scratch run of a benchmark shares: the
    config, ``overrides``, ``steps`` steps each logged, no evaluation until the end, no
    checkpoint, the global batch from d, a fresh start, no TensorBoard; then ``more``
    (``--set`` items that win over those)."""
    args = [*(["--config", str(config)] if config else []), "--no-progress"]
    for item in [
        *overrides,
        f"train.steps={steps}",
        "train.log_interval=1",
        "train.eval_interval=0",  # the final evaluation only
        "train.save_interval=0",
        "train.global_batch_size=null",
        "run.resume=none",
        "run.tensorboard=false",
        *more,
    ]:
        args += ["--set", item]
    return args


MARK = ".hpcllm-bench-dp"  # in each run folder bench dp made: its own, to replace


def fresh_run_dir(path: Path, verb: str = "bench dp") -> Path:
    """Return ``path`` empty but for the benchmark's mark, replacing a run an earlier one made
    there (its scratch runs); refuse a folder no hpcllm benchmark made."""
    if path.exists():
        if not (path / MARK).is_file():
            raise UserError(f"{path} exists and is not a run of hpcllm {verb}; give another --out")
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / MARK).write_text(f"a scratch run of hpcllm {verb}, replaced by the next one\n")
    return path


def synthetic_unless_data(config: Path | None, overrides: list[str]) -> list[str]:
    """Return ``overrides`` that train on synthetic data (``data.synthetic``) unless the
    config file or an override sets ``data.path`` or ``data.blend``: a benchmark of training
    needs no corpus.
    The user's own overrides come after, so an explicit ``data.synthetic=false`` wins."""
    from hpcllm.config import is_given

    given = any(is_given(config, overrides, key) for key in ("data.path", "data.blend"))
    return (
        overrides
        if given
        else [
            "data.synthetic=true",
            *overrides,
        ]
    )
