"""``hpcllm topo``: every rank's place in the tp x pp x dp grid."""

from __future__ import annotations

import argparse
import json

from hpcllm.commands.args import positive


def add_parser(verbs: argparse._SubParsersAction) -> None:
    """Add the command's parser to ``verbs``."""
    topo = verbs.add_parser(
        "topo",
        help="show every rank's place in the tp x pp x dp grid",
        description="Start the grid as a training job would (MPI, then torch.distributed) and "
        "print, on rank 0, each world rank's tensor/pipeline/data coordinates, the members of "
        "its groups, its host, local rank and device. Rank order is Megatron's: tp varies "
        "fastest, then dp, then pp. Run it under the launcher you train with, e.g. "
        "`mpirun -np 8 hpcllm topo --tp 2 --pp 2` or `srun --mpi=pmix -n 8 hpcllm topo --tp 2`.",
    )
    topo.add_argument(
        "--tp",
        type=positive,
        default=1,
        help="tensor-parallel size t (ranks that split each layer; keep within "
        "a node) [default: 1]",
    )
    topo.add_argument(
        "--pp", type=positive, default=1, help="pipeline-parallel size p (stages) [default: 1]"
    )
    topo.add_argument(
        "--dp",
        type=positive,
        default=None,
        help="data-parallel size d [default: world size / (t*cp*p)]; t*cp*p*d must equal the "
        "world size",
    )
    topo.add_argument(
        "--vpp",
        type=positive,
        default=1,
        help="virtual pipeline stages per rank for the interleaved schedule [default: 1]",
    )
    topo.add_argument(
        "--ep",
        type=positive,
        default=1,
        help="expert-parallel size: ranks of d that split each MoE layer's experts (the "
        "fast-varying part of the dp rank); must divide d [default: 1]",
    )
    topo.add_argument(
        "--cp",
        type=positive,
        default=1,
        help="context-parallel size: ranks that split each sequence, next to t in the rank "
        "order [default: 1]",
    )
    topo.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the table"
    )
    topo.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Start the grid as a job would and print it on rank 0."""
    from hpcllm import topology

    grid = topology.init(tp=args.tp, pp=args.pp, dp=args.dp, vpp=args.vpp, ep=args.ep, cp=args.cp)
    report = topology.describe_grid(grid)
    if grid.rank == 0:
        print(json.dumps(report) if args.json else topology.render_grid(report), flush=True)
    topology.shutdown()
    return 0
