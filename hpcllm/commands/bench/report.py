"""``hpcllm bench report``: measure a GPU node and hpcllm on it, in one command."""

from __future__ import annotations

import argparse
from pathlib import Path

from hpcllm.commands.args import positive

# As hpcllm.bench.report.PARTS, without importing it (and torch) for --help.
PARTS = ("environment", "tests", "device", "kernels", "step", "train", "collectives")


def _parts(text: str) -> list[str]:
    from hpcllm.errors import UserError

    parts = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise UserError(
            f"--parts: unknown part {unknown[0] if unknown else text!r}; parts: {', '.join(PARTS)}"
        )
    return parts


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Add the target's parser to ``targets``."""
    report = targets.add_parser(
        "report",
        help="measure this GPU node and hpcllm on it: one report, one cluster file",
        description="Run every measurement of this node in order, each as its own process, "
        "with a progress line per part (skipped with the reason when what it needs is "
        "absent): the environment, the tests marked gpu, bench device, bench kernels, bench "
        "step (gpt2-124m and gpt2-1.3b; as configured, kernels off, compile none and blocks), "
        "50 steps of hpcllm train, and the collectives over the node's GPUs (mpirun). Writes "
        "report.md (tables and plots), report.json and cluster.yaml (for hpcllm plan "
        "--cluster) into --out. About 20 minutes on one H100.",
    )
    report.add_argument("--out", type=Path, required=True, help="the report's folder")
    report.add_argument(
        "--parts",
        type=_parts,
        default=None,
        help=f"comma-separated parts to run, keeping the others' earlier results in --out "
        f"[default: all: {','.join(PARTS)}]",
    )
    report.add_argument(
        "--timeout",
        type=positive,
        default=1800,
        help="seconds one benchmark process may run [default: 1800]",
    )
    report.add_argument(
        "--quick",
        action="store_true",
        help="repeat each benchmark less: about half the time, noisier ratios",
    )
    report.add_argument(
        "--merge",
        type=Path,
        metavar="FILE",
        help="run nothing: add FILE, hpcllm bench collectives --json measured between nodes "
        "(jobs/collectives.sh), to --out's report and its cluster.yaml as inter_node tables",
    )
    report.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="every part on the CPU at toy sizes, to show each works (minutes)",
    )
    report.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the parts, write the report; non-zero if a part failed."""
    import sys

    from hpcllm.bench import report

    if args.merge is not None:
        from hpcllm.bench import report_files
        from hpcllm.errors import UserError

        if args.parts or args.quick or args.cpu_smoke:
            raise UserError("--merge runs nothing: it takes --out DIR only")
        report_files.merge(args.out, args.merge)
        print(f"merged {args.merge} into {args.out / 'cluster.yaml'} and the report")
        return 0
    report.check_out(args.out)
    result = report.run(args.out, args.parts, args.cpu_smoke, float(args.timeout), args.quick)
    failed = [name for name, part in result["parts"].items() if part["status"] == "failed"]
    print(f"wrote {args.out / 'report.md'}, report.json and cluster.yaml", file=sys.stderr)
    if failed:
        print(f"bench report: failed parts: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
