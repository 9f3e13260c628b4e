"""Where each process sits: the tp × pp × dp grid, its MPI communicators and torch groups.

Rank order follows Megatron-LM: tensor-parallel rank varies fastest, then data-parallel, then
pipeline-parallel,

    world_rank = tp_rank + tp * (dp_rank + dp * pp_rank)

so the t ranks of a tensor-parallel group are consecutive and, with t ≤ GPUs per node, share a
node and its NVLink, while pipeline stages are the furthest apart (across nodes).

Expert parallelism (``ep``) is carved out of d, as Megatron-Core orders its axes (tp, cp, ep,
dp, pp): the ep ranks are the fast-varying part of the data-parallel rank,

    dp_rank = ep_rank + ep * expert_dp_rank

so an expert-parallel group is ep consecutive dp ranks (the t·ep ranks nearest each other), and
the d/ep ranks of an expert-data-parallel group hold the same experts. With ep = 1 nothing
moves: every rank keeps its place and its groups.

Context parallelism (``cp``) splits each sequence over cp ranks and sits next to t, as in
Megatron-Core's order, so that a cp group shares a node where t·cp fits in one:

    world_rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

With cp = 1 this is the formula above. The cp ranks of a group read the same samples and hold
the same weights, so gradients are averaged over the d·cp ranks of ``dp_cp``: the
:meth:`Layout.replicas` layout (t, p, d·cp), whose data-parallel index is
``cp_rank + cp * dp_rank``, names the same world ranks and is what the data-parallel engines
and checkpoints see (:attr:`Grid.replicas`). Expert parallelism is not carved out of d·cp:
cp > 1 with ep > 1 is refused.

Two layers, each usable alone, on top of :mod:`hpcllm.launcher` (who started the process):

* :class:`Layout` is pure arithmetic (coordinates, group members), tested without MPI or torch;
* :func:`init` starts MPI and torch.distributed and returns a :class:`Grid` holding this
  rank's coordinates, its mpi4py sub-communicators and the matching torch process groups.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from hpcllm import startup
from hpcllm.errors import UserError
from hpcllm.launcher import Launch, detect_launcher, start_mpi

# ---------------------------------------------------------------------------------------------
# The grid as arithmetic


@dataclass(frozen=True)
class Layout:
    """Sizes of the parallel axes, plus v virtual pipeline stages per pipeline rank, the ep
    expert-parallel ranks carved out of d and the cp context-parallel ranks beside t."""

    tp: int
    pp: int
    dp: int
    vpp: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "vpp", "ep", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"parallel.{name} must be a positive integer, got {value!r}")
        if self.vpp > 1 and self.pp < 2:
            raise UserError(
                f"parallel.vpp={self.vpp} (interleaved virtual stages) needs parallel.pp >= 2, "
                f"got pp={self.pp}"
            )
        if self.dp % self.ep:
            raise UserError(
                f"parallel.ep {self.ep} must divide the data-parallel size d = {self.dp} "
                "(the expert-parallel ranks are carved out of d)"
            )
        if self.cp > 1 and self.ep > 1:
            raise UserError(
                f"parallel.cp {self.cp} with parallel.ep {self.ep}: expert parallelism is not "
                "carved out of d x cp; set one of them to 1"
            )

    @classmethod
    def for_world(
        cls,
        world_size: int,
        tp: int = 1,
        pp: int = 1,
        dp: int | None = None,
        vpp: int = 1,
        ep: int = 1,
        cp: int = 1,
    ) -> Layout:
        """Return the layout for ``world_size`` ranks; ``dp`` defaults to world/(tp·cp·pp)."""
        for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("vpp", vpp), ("cp", cp)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise UserError(f"parallel.{name} must be a positive integer, got {value!r}")
        model = tp * pp * cp
        sizes = f"tp*cp*pp = {tp}*{cp}*{pp}" if cp > 1 else f"tp*pp = {tp}*{pp}"
        if dp is None:
            if world_size % model != 0:
                raise UserError(
                    f"world size {world_size} is not divisible by {sizes} = {model}; "
                    f"choose {'tp, cp' if cp > 1 else 'tp'} and pp whose product divides "
                    f"{world_size}"
                )
            dp = world_size // model
        elif model * dp != world_size:
            raise UserError(
                f"{sizes.split(' = ')[0]}*dp = {sizes.split(' = ')[1]}*{dp} = {model * dp} does "
                f"not equal the world size {world_size}; launch {model * dp} ranks or change "
                "the sizes"
            )
        return cls(tp=tp, pp=pp, dp=dp, vpp=vpp, ep=ep, cp=cp)

    @property
    def world_size(self) -> int:
        """Return t·cp·p·d, the number of ranks this layout needs."""
        return self.tp * self.cp * self.pp * self.dp

    def replicas(self) -> Layout:
        """Return the layout (t, p, d·cp) whose data-parallel ranks are the d·cp ranks that
        hold the same weights (index ``cp_rank + cp * dp_rank``): the same world ranks, as the
        data-parallel engines and checkpoints see them. This layout itself at cp = 1."""
        if self.cp == 1:
            return self
        return Layout(tp=self.tp, pp=self.pp, dp=self.dp * self.cp, vpp=self.vpp, ep=self.ep)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """Return ``(tp_rank, pp_rank, dp_rank)`` of a world rank (its cp rank:
        :meth:`cp_rank`)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        tp_rank = rank % self.tp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        pp_rank = rank // (self.tp * self.cp * self.dp)
        return tp_rank, pp_rank, dp_rank

    def cp_rank(self, rank: int) -> int:
        """Return the context-parallel rank of a world rank (which chunks of a sequence)."""
        return (rank // self.tp) % self.cp

    def rank(self, tp_rank: int, pp_rank: int, dp_rank: int, cp_rank: int = 0) -> int:
        """Return the world rank at grid coordinates ``(tp_rank, pp_rank, dp_rank, cp_rank)``."""
        return tp_rank + self.tp * (cp_rank + self.cp * (dp_rank + self.dp * pp_rank))

    def tp_group(self, rank: int) -> list[int]:
        """Return the world ranks of ``rank``'s tensor-parallel group, by tp rank."""
        _, pp_rank, dp_rank = self.coords(rank)
        c = self.cp_rank(rank)
        return [self.rank(t, pp_rank, dp_rank, c) for t in range(self.tp)]

    def pp_group(self, rank: int) -> list[int]:
        """Return the world ranks of ``rank``'s pipeline, first stage first."""
        tp_rank, _, dp_rank = self.coords(rank)
        c = self.cp_rank(rank)
        return [self.rank(tp_rank, p, dp_rank, c) for p in range(self.pp)]

    def dp_group(self, rank: int) -> list[int]:
        """Return the world ranks that read other samples with the same weights as ``rank``
        (at cp = 1, every replica of its model shard; :meth:`dp_cp_group` adds the cp ranks)."""
        tp_rank, pp_rank, _ = self.coords(rank)
        c = self.cp_rank(rank)
        return [self.rank(tp_rank, pp_rank, d, c) for d in range(self.dp)]

    def cp_group(self, rank: int) -> list[int]:
        """Return the world ranks that split ``rank``'s sequences (its context-parallel group),
        by cp rank."""
        tp_rank, pp_rank, dp_rank = self.coords(rank)
        return [self.rank(tp_rank, pp_rank, dp_rank, c) for c in range(self.cp)]

    def dp_cp_group(self, rank: int) -> list[int]:
        """Return the d·cp world ranks holding the same weights as ``rank``, which average
        their gradients (the dp group at cp = 1)."""
        return self.replicas().dp_group(rank)

    def ep_group(self, rank: int) -> list[int]:
        """Return the world ranks of ``rank``'s expert-parallel group (its ep consecutive dp
        ranks, which hold different experts), by ep rank."""
        tp_rank, pp_rank, dp_rank = self.coords(rank)
        first, c = dp_rank - dp_rank % self.ep, self.cp_rank(rank)
        return [self.rank(tp_rank, pp_rank, first + e, c) for e in range(self.ep)]

    def expert_dp_group(self, rank: int) -> list[int]:
        """Return the world ranks holding the same experts as ``rank`` (its d/ep expert-data-
        parallel replicas), by expert-dp rank."""
        tp_rank, pp_rank, dp_rank = self.coords(rank)
        e, c = dp_rank % self.ep, self.cp_rank(rank)
        return [self.rank(tp_rank, pp_rank, e + self.ep * j, c) for j in range(self.dp // self.ep)]

    def mp_group(self, rank: int) -> list[int]:
        """Return the world ranks of ``rank``'s model-parallel group (its tp×pp block)."""
        _, _, dp_rank = self.coords(rank)
        c = self.cp_rank(rank)
        return sorted(self.rank(t, p, dp_rank, c) for p in range(self.pp) for t in range(self.tp))

    def embedding_group(self, rank: int) -> list[int]:
        """Return the world ranks of the first and last stage of ``rank``'s pipeline, which
        hold the two copies of the tied embedding (one rank when p = 1)."""
        stages = self.pp_group(rank)
        return sorted({stages[0], stages[-1]})

    def groups(self, axis: str) -> list[list[int]]:
        """Return every group along ``axis`` (``tp``, ``pp``, ``dp``, ``cp``, ``dp_cp``,
        ``ep``, ``expert_dp``, ``mp`` or ``embedding``), each once."""
        member_of = {
            "tp": self.tp_group,
            "pp": self.pp_group,
            "dp": self.dp_group,
            "cp": self.cp_group,
            "dp_cp": self.dp_cp_group,
            "ep": self.ep_group,
            "expert_dp": self.expert_dp_group,
            "mp": self.mp_group,
            "embedding": self.embedding_group,
        }[axis]
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.world_size):
            seen.setdefault(tuple(member_of(rank)), None)
        return [list(group) for group in seen]


# ---------------------------------------------------------------------------------------------
# The running grid


@dataclass(frozen=True)
class ProcessGroups:
    """Every process group of this rank, as torch groups and as mpi4py communicators.

    One bundle is handed around instead of loose groups (Megatron-Core's ``ProcessGroupCollection``
    plays this part): ``tp``, ``pp``, ``dp`` and ``mp`` (the tp×pp block) are torch groups of
    the members :class:`Layout` names, one rank included (a group of one); ``embedding`` joins
    the first and last pipeline stage, which hold the two copies of the tied embedding (None
    when p = 1: nothing is tied across ranks). ``*_comm`` are the matching mpi4py
    communicators (None in a single process started without a launcher, where MPI is never
    imported). ``ep`` and ``expert_dp`` are the expert-parallel group (the ranks whose experts
    together make the whole layer; their all-to-all moves the tokens) and the expert-data-parallel
    group (the ranks holding the same experts, which average their gradients); both are groups of
    one rank at ep = 1 (``ep`` None, ``expert_dp`` the dp group), and their communicators
    None when MPI was not started. ``cp`` is the context-parallel group (the ranks that split a
    sequence; None at cp = 1) and ``dp_cp`` the d·cp ranks holding the same weights (the dp
    group at cp = 1); :attr:`Grid.replicas` hands the engines a bundle whose ``dp`` is it.
    """

    tp: Any
    pp: Any
    dp: Any
    mp: Any
    embedding: Any = None
    world_comm: Any = None
    tp_comm: Any = None
    pp_comm: Any = None
    dp_comm: Any = None
    mp_comm: Any = None
    embedding_comm: Any = None
    cp: Any = None
    ep: Any = None
    expert_dp: Any = None
    ep_comm: Any = None
    expert_dp_comm: Any = None
    dp_cp: Any = None
    cp_comm: Any = None
    dp_cp_comm: Any = None


@dataclass
class Grid:
    """This rank's place in the grid, with its MPI communicators and torch process groups.

    ``groups`` holds its torch groups and mpi4py communicators (:class:`ProcessGroups`).
    ``pp_prev``/``pp_next`` are the world ranks of the neighbouring pipeline
    stages, wrapping around as the interleaved schedule needs. ``timeout_s`` is the torch
    groups' timeout, :func:`init`'s or :func:`set_timeout`'s since (None: torch's defaults),
    for engines that start collectives of their own (Horovod).
    """

    layout: Layout
    launch: Launch
    rank: int
    host: str
    device: Any  # torch.device
    backend: str
    tp_rank: int
    pp_rank: int
    dp_rank: int
    groups: ProcessGroups
    timeout_s: float | None = None
    cp_rank: int = 0
    cp: int = 1  # the context-parallel size (kept by the :attr:`replicas` view)

    @property
    def world_size(self) -> int:
        """Return the number of ranks in the job."""
        return self.layout.world_size

    @property
    def local_rank(self) -> int:
        """Return this rank's index among the ranks of its node."""
        return self.launch.local_rank

    @property
    def tp(self) -> int:
        """Return the tensor-parallel size t."""
        return self.layout.tp

    @property
    def pp(self) -> int:
        """Return the pipeline-parallel size p."""
        return self.layout.pp

    @property
    def dp(self) -> int:
        """Return the data-parallel size d."""
        return self.layout.dp

    @property
    def vpp(self) -> int:
        """Return the number of virtual pipeline stages per rank v."""
        return self.layout.vpp

    @property
    def ep(self) -> int:
        """Return the expert-parallel size (ranks of d that split the experts)."""
        return self.layout.ep

    @property
    def ep_rank(self) -> int:
        """Return this rank's place in its expert-parallel group (which experts it holds)."""
        return self.dp_rank % self.layout.ep

    @property
    def expert_dp_rank(self) -> int:
        """Return this rank's place among the ranks holding the same experts."""
        return self.dp_rank // self.layout.ep

    @property
    def replicas(self) -> Grid:
        """Return the grid as the data-parallel engines and checkpoints see it: its d·cp ranks
        holding the same weights are its data-parallel axis (layout :meth:`Layout.replicas`,
        ``dp_rank`` = cp_rank + cp·dp_rank, ``groups.dp`` the dp_cp group). This grid at cp = 1.
        """
        if self.cp == 1:
            return self
        g = self.groups
        return dataclasses.replace(
            self,
            layout=self.layout.replicas(),
            dp_rank=self.cp_rank + self.cp * self.dp_rank,
            groups=dataclasses.replace(
                g,
                dp=g.dp_cp,
                dp_comm=g.dp_cp_comm,
                expert_dp=g.dp_cp,
                expert_dp_comm=g.dp_cp_comm,
            ),
        )

    @property
    def pp_prev(self) -> int:
        """Return the world rank of the previous pipeline stage (the last, from the first)."""
        return self.layout.rank(
            self.tp_rank, (self.pp_rank - 1) % self.pp, self.dp_rank, self.layout.cp_rank(self.rank)
        )

    @property
    def pp_next(self) -> int:
        """Return the world rank of the next pipeline stage (the first, from the last)."""
        return self.layout.rank(
            self.tp_rank, (self.pp_rank + 1) % self.pp, self.dp_rank, self.layout.cp_rank(self.rank)
        )

    @property
    def is_first_stage(self) -> bool:
        """Return whether this rank holds the first pipeline stage."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Return whether this rank holds the last pipeline stage."""
        return self.pp_rank == self.pp - 1

    def describe(self) -> dict[str, Any]:
        """Return this rank's coordinates and group members as a JSON-ready dict."""
        return {
            "rank": self.rank,
            "tp_rank": self.tp_rank,
            "pp_rank": self.pp_rank,
            "dp_rank": self.dp_rank,
            "tp_group": self.layout.tp_group(self.rank),
            "pp_group": self.layout.pp_group(self.rank),
            "dp_group": self.layout.dp_group(self.rank),
            "ep_rank": self.ep_rank,
            "ep_group": self.layout.ep_group(self.rank),
            "expert_dp_group": self.layout.expert_dp_group(self.rank),
            "embedding_group": self.layout.embedding_group(self.rank) if self.pp > 1 else None,
            "cp_rank": self.cp_rank,
            "cp_group": self.layout.cp_group(self.rank),
            "dp_cp_group": self.layout.dp_cp_group(self.rank),
            "host": self.host,
            "local_rank": self.local_rank,
            "device": str(self.device),
        }


def _rendezvous(world: Any, launch: Launch, timeout: timedelta) -> tuple[str, int, Any]:
    """Return (address, port, store) of a TCPStore that rank 0 serves, agreed over MPI.

    Rank 0 opens the store on a free port (or MASTER_PORT) and broadcasts where it is, so no
    two jobs on a node race for a fixed port. Address: MASTER_ADDR if set, loopback when all
    ranks share a host, else rank 0's hostname as the other nodes resolve it. ``timeout``
    bounds how long a rank waits for the others in the store.
    """
    import torch.distributed as dist

    hosts = world.allgather(socket.gethostname())
    if launch.rank == 0:
        addr = os.environ.get("MASTER_ADDR") or (
            "127.0.0.1" if len(set(hosts)) == 1 else socket.getfqdn(hosts[0])
        )
        port = int(os.environ.get("MASTER_PORT", "0"))
        try:
            store = dist.TCPStore(
                addr,
                port,
                launch.world_size,
                is_master=True,
                timeout=timeout,
                wait_for_workers=False,
            )
            found = (addr, store.port, "")
        except Exception as err:  # reported on every rank below, not only here
            store, found = None, (addr, port, f"{type(err).__name__}: {err}")
    else:
        found = None
    addr, port, error = world.bcast(found, root=0)
    if error:
        raise UserError(f"cannot open the torch.distributed rendezvous on {addr}:{port}: {error}")
    if launch.rank != 0:
        store = dist.TCPStore(addr, port, launch.world_size, is_master=False, timeout=timeout)
    return addr, port, store


def _torch_groups(
    layout: Layout, rank: int, backend: str, timeout: timedelta | None
) -> dict[str, Any]:
    """Create every tp/pp/dp/mp torch group, the cp and dp_cp groups when cp > 1, the ep and
    expert_dp groups when ep > 1, and the embedding groups when p > 1 (all ranks must take
    part), and keep ours. At cp = 1 the cp group is None (a group of one to
    :func:`~hpcllm.parallel.tensor.mappings.group_size`) and dp_cp is the dp group; at ep = 1
    ep is None and expert_dp is the dp_cp group: no group is made for either.

        A new group does not inherit the world group's timeout; each is given ``timeout``.
    """
    import torch.distributed as dist

    mine: dict[str, Any] = {"embedding": None}
    for axis in ("tp", "pp", "dp", "mp", "embedding", "cp", "dp_cp", "ep", "expert_dp"):
        if axis == "embedding" and layout.pp == 1:
            continue
        if axis in ("cp", "dp_cp") and layout.cp == 1:
            # At cp = 1 the ranks holding the same weights are the dp group.
            mine["cp"], mine["dp_cp"] = None, mine["dp"]
            continue
        if axis in ("ep", "expert_dp") and layout.ep == 1:
            # Nothing changes at ep = 1: every rank of dp holds every expert.
            mine["ep"], mine["expert_dp"] = None, mine["dp_cp"]
            continue
        # Every rank creates every group in the same order, as torch.distributed requires.
        for members in layout.groups(axis):
            group = dist.new_group(members, backend=backend, timeout=timeout)
            if rank in members:
                mine[axis] = group
    return mine


def _mpi_comms(world: Any, layout: Layout, rank: int) -> dict[str, Any]:
    """Split the MPI world into this rank's tp/pp/dp/mp communicators, ordered as the grid,
    its cp and dp_cp communicators (None and the dp one at cp = 1), its ep and expert-dp
    communicators (None and the dp_cp one at ep = 1), and, when p > 1, the embedding
    communicator of its first and last stage.

    Each split's colour is the index of this rank's group among :meth:`Layout.groups` of the
    axis and its key the rank's place in that group, so every communicator orders its ranks
    as the matching torch group does.
    """
    from mpi4py import MPI

    def split(axis: str) -> Any:
        for color, members in enumerate(layout.groups(axis)):
            if rank in members:
                return world.Split(color, members.index(rank))
        raise AssertionError(f"rank {rank} in no {axis} group")  # every rank is in one

    comms = {axis: split(axis) for axis in ("tp", "pp", "dp", "mp")}
    comms["cp"], comms["dp_cp"] = None, comms["dp"]
    if layout.cp > 1:
        comms["cp"], comms["dp_cp"] = split("cp"), split("dp_cp")
    comms["ep"], comms["expert_dp"] = None, comms["dp_cp"]
    if layout.ep > 1:
        comms["ep"], comms["expert_dp"] = split("ep"), split("expert_dp")
    comms["embedding"] = None
    if layout.pp > 1:
        # Every rank takes part in the split; the middle stages keep no communicator.
        tied = rank in layout.embedding_group(rank)
        groups = layout.groups("embedding")
        color = next(i for i, g in enumerate(groups) if rank in g) if tied else MPI.UNDEFINED
        comm = world.Split(color, layout.coords(rank)[1])
        comms["embedding"] = comm if tied else None
    return comms


# Open MPI settings hpcllm gives CPU ranks unless the environment sets them. A rank waiting in
# an MPI call polls by default, keeping its core busy; on CPU ranks that core is the one the
# forward and backward (and Horovod's background thread, whose every cycle waits in MPI)
# need. Yielding while idle raised Horovod's d = 2 scaling efficiency on a 2-core machine from
# 0.79-0.82 to 0.89-0.90 (docs/benchmarks.md); DDP (gloo) is unaffected. GPU ranks keep
# polling: their host has cores to spare and latency matters more.
MPI_CPU_DEFAULTS = {"OMPI_MCA_mpi_yield_when_idle": "1"}


def mpi_settings(gpu: bool, environ: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Return the Open MPI settings of :data:`MPI_CPU_DEFAULTS` as ``{variable: (value,
    source)}``: the environment's where set, else hpcllm's on CPU (none on GPUs)."""
    settings = {}
    for variable, value in MPI_CPU_DEFAULTS.items():
        if variable in environ:
            settings[variable] = (environ[variable], "environment")
        elif not gpu:
            settings[variable] = (value, "hpcllm default on CPU")
    return settings


# What init gave MPI (and where each value came from), once it has started MPI.
_APPLIED_MPI: dict[str, tuple[str, str]] = {}
# Whether init has started torch.distributed in this process (it stays True after shutdown).
_STARTED: list[bool] = []


def was_started() -> bool:
    """Return whether :func:`init` started torch.distributed in this process, at any time."""
    return bool(_STARTED)


def applied_mpi_settings(gpu: bool) -> dict[str, tuple[str, str]]:
    """Return the settings :func:`init` gave MPI, or what it would give (MPI not started)."""
    return dict(_APPLIED_MPI) if _APPLIED_MPI else mpi_settings(gpu, os.environ)


def init(
    tp: int = 1,
    pp: int = 1,
    dp: int | None = None,
    vpp: int = 1,
    backend: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    ep: int = 1,
    cp: int = 1,
) -> Grid:
    """Return this rank's Grid, starting MPI and torch.distributed if not yet started.

    Sizes are checked before any collective, from the launcher's world size, so a bad layout is
    a UserError on every rank at once and never a hang. Calling ``init`` again with another
    layout reuses the world process group and builds new groups.

    ``timeout_s`` bounds every torch.distributed collective and receive of the new groups and
    of the world group: past it gloo raises and NCCL's watchdog tears the process down. The
    trainer passes the start-up allowance's backstop, and ``run.timeout_s``'s through
    :func:`set_timeout` once the first step is done. None keeps torch's
    defaults (30 min for gloo, 10 for NCCL) and a 600 s rendezvous.
    """
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    launch = detect_launcher(env)
    layout = Layout.for_world(launch.world_size, tp=tp, pp=pp, dp=dp, vpp=vpp, ep=ep, cp=cp)

    import torch
    import torch.distributed as dist

    world_comm = None
    if launch.launcher != "single":
        if not _APPLIED_MPI:
            settings = mpi_settings(torch.cuda.is_available(), os.environ)
            for variable, (value, _) in settings.items():
                os.environ.setdefault(variable, value)  # read by MPI_Init, which comes next
            _APPLIED_MPI.update(settings)
        startup.phase("MPI start")
        MPI = start_mpi()
        world_comm = MPI.COMM_WORLD
        if world_comm.Get_size() != launch.world_size or world_comm.Get_rank() != launch.rank:
            raise UserError(
                f"MPI sees rank {world_comm.Get_rank()} of {world_comm.Get_size()} but the "
                f"{launch.launcher} launcher said {launch.rank} of {launch.world_size}; "
                "is mpi4py built against the MPI that launched the job?"
            )

    if torch.cuda.is_available():
        device = torch.device("cuda", launch.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")

    if not dist.is_initialized():
        if world_comm is None:
            store = dist.HashStore()
        else:
            startup.phase("torch rendezvous")
            _, _, store = _rendezvous(world_comm, launch, timeout or timedelta(seconds=600))
        _STARTED.append(True)
        dist.init_process_group(
            backend,
            store=store,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )

    groups = _torch_groups(layout, launch.rank, backend, timeout)
    startup.phase("set-up")
    comms = _mpi_comms(world_comm, layout, launch.rank) if world_comm is not None else {}
    tp_rank, pp_rank, dp_rank = layout.coords(launch.rank)
    grid = Grid(
        layout=layout,
        launch=launch,
        rank=launch.rank,
        host=socket.gethostname(),
        device=device,
        backend=backend,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        dp_rank=dp_rank,
        groups=ProcessGroups(
            tp=groups["tp"],
            pp=groups["pp"],
            dp=groups["dp"],
            mp=groups["mp"],
            embedding=groups["embedding"],
            world_comm=world_comm,
            tp_comm=comms.get("tp"),
            pp_comm=comms.get("pp"),
            dp_comm=comms.get("dp"),
            mp_comm=comms.get("mp"),
            embedding_comm=comms.get("embedding"),
            ep=groups["ep"],
            expert_dp=groups["expert_dp"],
            ep_comm=comms.get("ep"),
            expert_dp_comm=comms.get("expert_dp"),
            cp=groups["cp"],
            dp_cp=groups["dp_cp"],
            cp_comm=comms.get("cp"),
            dp_cp_comm=comms.get("dp_cp"),
        ),
        timeout_s=timeout_s,
        cp_rank=layout.cp_rank(launch.rank),
        cp=layout.cp,
    )
    if timeout_s is not None:  # a world group made by an earlier call takes it too
        set_timeout(grid, timeout_s)
    return grid


def describe_grid(grid: Grid) -> dict[str, Any]:
    """Return the whole job's grid as one dict (a collective: every rank must call it).

    The shape is what ``hpcllm topo --json`` prints: sizes, then one entry per world rank.
    """
    import torch.distributed as dist

    rows: list[Any] = [None] * grid.world_size
    dist.all_gather_object(rows, grid.describe())
    return {
        "world_size": grid.world_size,
        "tp": grid.tp,
        "pp": grid.pp,
        "dp": grid.dp,
        "vpp": grid.vpp,
        "ep": grid.ep,
        "cp": grid.cp,
        "launcher": grid.launch.launcher,
        "backend": grid.backend,
        "ranks": rows,
    }


def render_grid(report: dict[str, Any]) -> str:
    """Return a human-readable table and picture of a :func:`describe_grid` report."""
    head = (
        "rank",
        "host",
        "local",
        "device",
        "tp",
        "pp",
        "dp",
        "tp_group",
        "pp_group",
        "dp_group",
        "embedding_group",
    )
    rows = [
        (
            str(r["rank"]),
            r["host"],
            str(r["local_rank"]),
            r["device"],
            str(r["tp_rank"]),
            str(r["pp_rank"]),
            str(r["dp_rank"]),
            _members(r["tp_group"]),
            _members(r["pp_group"]),
            _members(r["dp_group"]),
            _members(r["embedding_group"]) if r.get("embedding_group") else "-",
        )
        for r in report["ranks"]
    ]
    if report.get("cp", 1) > 1:
        head = (*head, "cp", "cp_group", "dp_cp_group")
        rows = [
            (*row, str(r["cp_rank"]), _members(r["cp_group"]), _members(r["dp_cp_group"]))
            for row, r in zip(rows, report["ranks"], strict=True)
        ]
    if report.get("ep", 1) > 1:
        head = (*head, "ep", "ep_group", "expert_dp_group")
        rows = [
            (*row, str(r["ep_rank"]), _members(r["ep_group"]), _members(r["expert_dp_group"]))
            for row, r in zip(rows, report["ranks"], strict=True)
        ]
    widths = [max(len(cell) for cell in column) for column in zip(head, *rows, strict=True)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))
    vpp = f", {report['vpp']} virtual stages per rank" if report["vpp"] > 1 else ""
    if report.get("ep", 1) > 1:
        vpp += f", ep {report['ep']} inside dp"
    cp = f"cp {report['cp']} x " if report.get("cp", 1) > 1 else ""
    out = [
        f"world {report['world_size']} = tp {report['tp']} x {cp}pp {report['pp']} x "
        f"dp {report['dp']}{vpp}  (launcher {report['launcher']}, backend {report['backend']})",
        "",
        line(head).rstrip(),
        *(line(row).rstrip() for row in rows),
        "",
        "pipeline stages (rows) x data-parallel replicas; [..] is one tensor-parallel group"
        + (", cp 0's of each context-parallel group:" if cp else ":"),
    ]
    by_rank = {r["rank"]: r for r in report["ranks"]}
    for stage in range(report["pp"]):
        cells = []
        for replica in range(report["dp"]):
            first = next(
                r
                for r in by_rank.values()
                if r["pp_rank"] == stage and r["dp_rank"] == replica and r.get("cp_rank", 0) == 0
            )
            cells.append(f"dp {replica}: {_members(first['tp_group'])}")
        out.append(f"  stage {stage}:  " + "   ".join(cells))
    out += [
        "",
        "process groups of each rank (torch group and MPI communicator each): tp, pp, dp, mp "
        "(its tp x pp block), embedding (first and last stage, when p > 1), cp and dp_cp (the "
        "ranks that split a sequence, and the d x cp ranks that average gradients, when cp > 1), "
        "ep and expert_dp (the ranks that split the experts, and those holding the same ones, "
        "when ep > 1)",
    ]
    return "\n".join(out)


def _members(ranks: list[int]) -> str:
    return "[" + " ".join(str(r) for r in ranks) + "]"


def set_timeout(grid: Grid, timeout_s: float) -> None:
    """Give the world group and every torch group of ``grid`` the timeout ``timeout_s``, from
    their next collective on, and record it as ``grid.timeout_s``.

    The trainer starts the groups with the start-up allowance (the first step compiles, and a
    stall in it is the start-up watcher's to name) and gives them ``run.timeout_s``'s here
    once the first step is done. Horovod, which read its stall check when it started, keeps
    the first.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s)
    axes = ("tp", "pp", "dp", "mp", "embedding", "cp", "dp_cp", "ep", "expert_dp")
    groups = [distributed_c10d._get_default_group(), *(getattr(grid.groups, a) for a in axes)]
    seen: set[int] = set()
    for group in groups:
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER or id(group) in seen:
            continue  # no embedding group (p = 1); a group given twice
        seen.add(id(group))
        distributed_c10d._set_pg_timeout(timeout, group)
    grid.timeout_s = timeout_s


def shutdown() -> None:
    """Tear down torch.distributed if it was started (MPI is finalised at exit: by mpi4py, or
    by the ``hpcllm`` command's own exit, ``hpcllm.errors.exit_process``)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
