"""The ``hpcllm`` command: parses arguments, then hands each verb to its module."""

from __future__ import annotations

import argparse
import json
import sys

from hpcllm import __version__
from hpcllm.errors import run_reporting_errors


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcllm",
        description="Train GPT-style models with tensor, pipeline and data parallelism, "
        "started by mpirun or srun.",
    )
    parser.add_argument("--version", action="version", version=f"hpcllm {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    topo = verbs.add_parser(
        "topo",
        help="show every rank's place in the tp x pp x dp grid",
        description="Start the grid as a training job would (MPI, then torch.distributed) and "
        "print, on rank 0, each world rank's tensor/pipeline/data coordinates, the members of "
        "its groups, its host, local rank and device. Rank order is Megatron's: tp varies "
        "fastest, then dp, then pp. Run it under the launcher you train with, e.g. "
        "`mpirun -np 8 hpcllm topo --tp 2 --pp 2` or `srun --mpi=pmix -n 8 hpcllm topo --tp 2`.",
    )
    topo.add_argument("--tp", type=_positive, default=1,
                      help="tensor-parallel size t (ranks that split each layer; keep within "
                      "a node) [default: 1]")
    topo.add_argument("--pp", type=_positive, default=1,
                      help="pipeline-parallel size p (stages) [default: 1]")
    topo.add_argument("--dp", type=_positive, default=None,
                      help="data-parallel size d [default: world size / (t*p)]; "
                      "t*p*d must equal the world size")
    topo.add_argument("--vpp", type=_positive, default=1,
                      help="virtual pipeline stages per rank for the interleaved schedule "
                      "[default: 1]")
    topo.add_argument("--json", action="store_true",
                      help="print one JSON object instead of the table")
    topo.set_defaults(run=_run_topo)
    return parser


def _run_topo(args: argparse.Namespace) -> int:
    from hpcllm import topology

    grid = topology.init(tp=args.tp, pp=args.pp, dp=args.dp, vpp=args.vpp)
    report = topology.describe_grid(grid)
    if grid.rank == 0:
        print(json.dumps(report) if args.json else topology.render_grid(report), flush=True)
    topology.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the ``hpcllm`` command line and return its exit code."""
    args = _build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return run_reporting_errors(lambda: args.run(args))
