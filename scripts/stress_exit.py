"""Stress the end of a run: does every rank of a short run that succeeded exit 0?

Usage: .venv/bin/python scripts/stress_exit.py [--repeats 20] [--engines ddp ps-async ...]
[--budget-s SECONDS] [--log-dir DIR]

Each repeat trains every data-parallel engine once: ``mpirun -np 2 python -m hpcllm train``
of the smallest model (one layer, d_model 32, 32 tokens) on synthetic data, for 2 steps, with
its final checkpoint. A run is *aborted* when mpirun's exit status or its output shows a rank
ended by SIGABRT (exit 134, "signal 6", "Aborted", "terminate called"), *failed* when it
exited non-zero otherwise, ran past ``--timeout-s`` or never said it trained its 2 steps. The
table gives, per engine, the runs, the aborts and the other failures; the script exits 1 if
any run aborted or failed, 0 if none did. With ``--budget-s`` it starts no repeat after that
many seconds and says how many it ran. Not part of ``make test``: 20 repeats of the 7 engines
take about 13 minutes on 2 cores. The output of every run that did not end cleanly is kept
under ``--log-dir``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hpcllm.launcher import mpirun_command, mpirun_env  # noqa: E402

# Each engine's keys; ZeRO-1 is the distributed optimizer over ddp's and Horovod's reduction.
ENGINES: dict[str, list[str]] = {
    "ddp": ["parallel.dp_engine=ddp"],
    "horovod": ["parallel.dp_engine=horovod"],
    "ps": ["parallel.dp_engine=ps"],
    "ps-async": ["parallel.dp_engine=ps-async"],
    "local-sgd": ["parallel.dp_engine=local-sgd", "parallel.local_sgd_steps=2"],
    "zero1-ddp": ["parallel.dp_engine=ddp", "parallel.distributed_optimizer=true"],
    "zero1-horovod": ["parallel.dp_engine=horovod", "parallel.distributed_optimizer=true"],
}

# The smallest run that still builds an optimizer, steps and saves.
SMALLEST_RUN = [
    "model.preset=null",
    "model.n_layer=1",
    "model.n_head=2",
    "model.d_model=32",
    "model.seq_len=32",
    "model.vocab_size=512",
    "data.synthetic=true",
    "train.steps=2",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.log_interval=1",
    "train.eval_interval=0",
    "train.save_interval=2",
    "train.precision=fp32",
    "run.tensorboard=false",
]

ABORT = re.compile(r"terminate called|signal 6\b|\(Aborted\)|SIGABRT|core dumped")


@dataclass
class Tally:
    """One engine's runs so far."""

    runs: int = 0
    aborts: int = 0
    failures: int = 0
    seconds: list[float] = field(default_factory=list)


def verdict(code: int, output: str) -> str:
    """Return ``"ok"``, ``"abort"`` or ``"failed"`` for a finished run's exit status and
    output (mpirun's own and every rank's); ok needs rank 0's "trained 2 steps" too."""
    if code in (134, -signal.SIGABRT) or ABORT.search(output):
        return "abort"
    return "ok" if code == 0 and "trained 2 steps" in output else "failed"


def run_once(engine: str, scratch: Path, timeout_s: float) -> tuple[str, int, str, float]:
    """Train ``engine`` once in a new folder under ``scratch``; return (verdict, exit code,
    output, seconds)."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"{engine}-", dir=scratch)) / "run"
    sets = [*SMALLEST_RUN, *ENGINES[engine], f"run.dir={run_dir}"]
    argv = [sys.executable, "-m", "hpcllm", "train", "--no-progress"]
    argv += [word for item in sets for word in ("--set", item)]
    env = mpirun_env(
        {
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
            "HOROVOD_CPU_OPERATIONS": "MPI",  # Horovod's gloo path crashes under mpirun
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
    )
    started = time.monotonic()
    proc = subprocess.Popen(
        mpirun_command(2, argv),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\nstress_exit: killed after {timeout_s:.0f} s\n"
        code = -signal.SIGKILL
    took = time.monotonic() - started
    shutil.rmtree(run_dir.parent, ignore_errors=True)
    return verdict(code, output), code, output, took


def table(tallies: dict[str, Tally]) -> str:
    """Return the per-engine table, Markdown."""
    lines = [
        "| engine | runs | aborts | other failures | median s/run |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for engine, t in tallies.items():
        median = sorted(t.seconds)[len(t.seconds) // 2] if t.seconds else float("nan")
        lines.append(f"| {engine} | {t.runs} | {t.aborts} | {t.failures} | {median:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the repeats, print the table; return 1 if any run aborted or failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="runs of each engine")
    parser.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES))
    parser.add_argument("--timeout-s", type=float, default=300, help="one run's limit")
    parser.add_argument("--budget-s", type=float, default=None, help="start no repeat after")
    parser.add_argument("--log-dir", type=Path, default=None, help="bad runs' output")
    args = parser.parse_args(argv)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="stress-exit-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    tallies = {engine: Tally() for engine in args.engines}
    started = time.monotonic()
    done = 0
    with tempfile.TemporaryDirectory(prefix="stress-exit-") as scratch:
        for repeat in range(args.repeats):
            if args.budget_s is not None and time.monotonic() - started > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent after {done} repeats", flush=True)
                break
            for engine in args.engines:
                outcome, code, output, took = run_once(engine, Path(scratch), args.timeout_s)
                tally = tallies[engine]
                tally.runs += 1
                tally.seconds.append(took)
                if outcome != "ok":
                    tally.aborts += outcome == "abort"
                    tally.failures += outcome == "failed"
                    log = log_dir / f"{engine}-{repeat:03d}.log"
                    log.write_text(f"exit {code}\n{output}")
                    print(f"{engine} repeat {repeat}: {outcome} (exit {code}), {log}", flush=True)
                else:
                    print(f"{engine} repeat {repeat}: ok in {took:.1f} s", flush=True)
            done += 1
    total = time.monotonic() - started
    print(f"\n{done} repeats in {total / 60:.1f} min; logs of bad runs in {log_dir}\n")
    print(table(tallies), flush=True)
    bad = sum(t.aborts + t.failures for t in tallies.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
