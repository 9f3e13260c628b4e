"""Start-up under a watcher: MPI's start, the torch rendezvous, set-up and the first step.

The hang watchdog (:mod:`hpcllm.watchdog`) is armed after the first step (which compiles and
autotunes), and a thread could not watch MPI's start anyway: ``from mpi4py import MPI`` holds
the GIL until every rank has joined. So ``hpcllm train`` forks, before MPI starts, a watcher
process per rank (:func:`begin`), which needs no GIL of its rank's. The rank tells it each
phase it enters (:func:`phase`); the watcher writes its rank's phase and process state
(running, waiting, stopped) to heartbeat files beside the run folder
(``.RUN_NAME.startup/``, shared like the run folder), every half second. If the rank has not
finished its first step ``run.startup_timeout_s`` after start, its watcher reads every rank's
heartbeat, names the phase and the ranks not heard from (stopped, gone, or behind the others),
in one line from the first watcher to give up, and kills its rank, which ends the job. Until
the first step is done the trainer gives torch's process groups this allowance's backstop as
their timeout (``run.timeout_s``'s after it), so that a stall inside step 1 ends with this
line, never first with a collective's own timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import time
from pathlib import Path
from typing import Any

PHASES = ("MPI start", "torch rendezvous", "set-up", "step 1")
BEAT_S = 0.5
# A rank whose watcher wrote nothing for this long is gone (its node, or both processes).
GONE_S = 5.0
# A fault-injection hook for tests: "PHASE:RANK" stops that rank (SIGSTOP) as it enters PHASE.
STOP_AT = "HPCLLM_STOP_AT"

_watch: dict[str, Any] = {}  # this rank's: the pipe to its watcher, its files


def _job_key() -> str:
    """Return what tells this job's heartbeats from an earlier job's in the same folder."""
    env = os.environ
    for name in ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "SLURM_JOB_ID", "PMI_ID"):
        if env.get(name):
            return f"{env[name]}.{env.get('SLURM_STEP_ID', '')}"
    return str(os.getppid())


def folder_of(run_dir: str | Path) -> Path:
    """Return the heartbeat folder of a run folder: beside it, hidden."""
    run = Path(run_dir).absolute()
    return run.parent / f".{run.name}.startup"


def begin(run_dir: str | Path, allowance_s: float, rank: int, world_size: int) -> None:
    """Fork this rank's watcher (before MPI starts); no watcher for one process or
    ``allowance_s`` 0."""
    if world_size < 2 or allowance_s <= 0 or _watch:
        return
    folder = folder_of(run_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return  # the run folder's own checks say what is wrong with its place
    key = _job_key()
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    if os.fork() == 0:  # the watcher
        os.close(write)
        code = 1
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the rank, not this
            code = _watcher(read, parent, folder, key, allowance_s, rank, world_size)
        finally:
            os._exit(code)
    os.close(read)
    _watch.update(pipe=write, folder=folder, key=key, rank=rank)
    phase(PHASES[0])


def phase(name: str) -> None:
    """Tell this rank's watcher (if any) that the rank enters ``name``."""
    if not _watch:
        return
    with contextlib.suppress(OSError):
        os.write(_watch["pipe"], (name + "\n").encode())
    if os.environ.get(STOP_AT) == f"{name}:{_watch['rank']}":
        time.sleep(2 * BEAT_S)  # the watcher writes the phase first
        os.kill(os.getpid(), signal.SIGSTOP)


def done() -> None:
    """Release this rank's watcher: the first step is done (the hang watchdog takes over)."""
    if not _watch:
        return
    with contextlib.suppress(OSError):
        os.close(_watch.pop("pipe"))
    _watch.clear()


def _state(pid: int) -> str:
    """Return a process's state letter from /proc (R, S, D, T, Z...), "gone" without one."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def _beat(folder: Path, rank: int, record: dict[str, Any]) -> None:
    path = folder / f"rank-{rank}.json"
    partial = folder / f".rank-{rank}.json.tmp"
    with contextlib.suppress(OSError):
        partial.write_text(json.dumps(record))
        os.replace(partial, path)


def _others(folder: Path, key: str, world_size: int) -> dict[int, dict[str, Any] | None]:
    found: dict[int, dict[str, Any] | None] = {}
    for rank in range(world_size):
        try:
            record = json.loads((folder / f"rank-{rank}.json").read_text())
        except (OSError, ValueError):
            record = None
        found[rank] = record if record and record.get("job") == key else None
    return found


def verdict(records: dict[int, dict[str, Any] | None], now: float) -> tuple[str, list[str]]:
    """Return (the phase the furthest rank is in, the ranks not heard from, each with why):
    stopped, gone (no heartbeat for GONE_S, or none at all), or behind in an earlier phase."""
    phases = [PHASES.index(r["phase"]) for r in records.values() if r and r["phase"] in PHASES]
    furthest = max(phases, default=0)
    missing = []
    for rank, record in sorted(records.items()):
        if record is None:
            missing.append(f"{rank} (no heartbeat)")
        elif record["state"] in ("T", "t"):
            missing.append(f"{rank} (stopped in {record['phase']})")
        elif record["state"] in ("gone", "Z", "X") or now - record["at"] > GONE_S:
            missing.append(f"{rank} (gone in {record['phase']})")
        elif record["phase"] in PHASES and PHASES.index(record["phase"]) < furthest:
            missing.append(f"{rank} (still in {record['phase']})")
    return PHASES[furthest], missing


def _watcher(
    read: int, parent: int, folder: Path, key: str, allowance_s: float, rank: int, world: int
) -> int:
    """Watch the rank ``parent`` until it closes the pipe (done), dies, or overstays."""
    started, current, pending = time.monotonic(), PHASES[0], b""
    while True:
        ready, _, _ = select.select([read], [], [], BEAT_S)
        if ready:
            chunk = os.read(read, 4096)
            if not chunk:  # released (or the rank exited): nothing to watch
                with contextlib.suppress(OSError):
                    (folder / f"rank-{rank}.json").unlink()
                    folder.rmdir()  # the last rank's watcher leaves no folder behind
                return 0
            pending += chunk
            *names, rest = pending.split(b"\n")
            pending = rest
            current = names[-1].decode() if names else current
        state = _state(parent)
        if state == "gone":
            return 0
        _beat(folder, rank, {"job": key, "phase": current, "state": state, "at": time.time()})
        if time.monotonic() - started < allowance_s:
            continue
        furthest, missing = verdict(_others(folder, key, world), time.time())
        try:  # the first watcher to give up says why; the others end their ranks quietly
            os.close(os.open(folder / f"verdict-{key}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            first = True
        except OSError:
            first = False
        if first:
            who = ", ".join(missing) if missing else f"none: every rank waits in {furthest}"
            print(
                f"hpcllm: error: start-up stalled: rank {rank} has waited {allowance_s:.0f} s "
                f"(run.startup_timeout_s) and is in {current}; ranks not heard from: {who}; "
                "ending the job",
                file=sys.stderr,
                flush=True,
            )
        with contextlib.suppress(OSError):
            os.kill(parent, signal.SIGKILL)
        return 1
