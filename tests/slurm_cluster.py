"""A throw-away one-node Slurm cluster (munged, slurmctld, slurmd) in a temporary folder.

It uses its own munge key, socket, state and ports, so it neither needs nor touches a system
Slurm. :func:`start` raises :class:`SlurmUnavailable` with the reason when the daemons cannot
run here; the test turns that into a skip that says why.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sinfo")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be started on this machine; the message says why."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _which(name: str) -> str:
    for folder in (None, "/usr/sbin", "/sbin"):
        path = shutil.which(name, path=folder)
        if path:
            return path
    raise SlurmUnavailable(
        f"{name} not found (Debian packages slurm-wlm and munge; `make setup` installs them)"
    )


def _conf(root: Path, node: str, cpus: int) -> str:
    return f"""\
ClusterName=hpcllm-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket,cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} Sockets=1 CoresPerSocket={cpus} \
ThreadsPerCore=1 RealMemory=1024 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


def _tail(path: Path, lines: int = 15) -> str:
    if not path.exists():
        return f"({path.name} not written)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def start(root: Path, cpus: int = 8, timeout: float = 60) -> Iterator[dict[str, str]]:
    """Start the cluster under ``root`` and yield the environment that points srun at it."""
    if os.geteuid() != 0:
        raise SlurmUnavailable("the test cluster runs its daemons as root, and this is not root")
    paths = {name: _which(name) for name in DAEMONS}
    node = socket.gethostname().split(".")[0]
    for sub in ("state", "spool"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(_conf(root, node, cpus))
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    env = dict(os.environ, SLURM_CONF=str(conf))
    procs: list[subprocess.Popen] = []

    def spawn(*argv: str) -> None:
        procs.append(
            subprocess.Popen(
                argv,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )

    try:
        spawn(
            paths["munged"],
            "--foreground",
            "--force",
            f"--key-file={key}",
            f"--socket={root}/munge.socket",
            f"--pid-file={root}/munged.pid",
            f"--log-file={root}/munged.log",
            f"--seed-file={root}/munged.seed",
        )
        spawn(paths["slurmctld"], "-D", "-i", "-f", str(conf))
        spawn(paths["slurmd"], "-D", "-N", node, "-f", str(conf))
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            dead = [p.args[0] for p in procs if p.poll() is not None]
            if dead:
                raise SlurmUnavailable(
                    f"{os.path.basename(dead[0])} exited at start-up:\n"
                    f"{_tail(root / 'munged.log')}\n{_tail(root / 'slurmctld.log')}\n"
                    f"{_tail(root / 'slurmd.log')}"
                )
            probe = subprocess.run(
                [paths["sinfo"], "-h", "-o", "%T"], env=env, capture_output=True, text=True
            )
            state = probe.stdout.strip()
            if state.startswith("idle"):
                break
            time.sleep(0.5)
        else:
            raise SlurmUnavailable(
                f"node not idle after {timeout} s (state {state!r}):\n"
                f"{_tail(root / 'slurmctld.log')}\n{_tail(root / 'slurmd.log')}"
            )
        yield env
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
