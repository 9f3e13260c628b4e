"""``hpcllm timeline``: draw a pipelined run's measured per-rank timeline."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(verbs: argparse._SubParsersAction) -> None:
    """Add the command's parser to ``verbs``."""
    tl = verbs.add_parser(
        "timeline",
        help="draw a pipelined run's measured per-rank timeline",
        description="Read RUN_DIR/timeline/rank*.json (the last pipeline step each rank "
        "recorded) and draw one pipeline's stages as a PNG, like the Megatron paper's "
        "figures, plus a Chrome-trace JSON (chrome://tracing, Perfetto).",
    )
    tl.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    tl.add_argument(
        "--out",
        type=Path,
        default=None,
        help="PNG to write [default: RUN_DIR/timeline.png; the trace beside it]",
    )
    tl.add_argument("--dp-rank", type=int, default=0, help="which replica's pipeline")
    tl.add_argument("--tp-rank", type=int, default=0, help="which tp rank's pipeline")
    tl.add_argument("--cp-rank", type=int, default=0, help="which context-parallel rank's pipeline")
    tl.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Draw the PNG and the Chrome trace of one pipeline's last recorded step."""
    from hpcllm.errors import UserError
    from hpcllm.parallel.pipeline.timeline import chrome_trace, draw

    records = []
    for path in sorted((args.run_dir / "timeline").glob("rank*.json")):
        record = json.loads(path.read_text())
        mine = (record["dp_rank"], record["tp_rank"], record.get("cp_rank", 0))
        if mine == (args.dp_rank, args.tp_rank, args.cp_rank):
            records.append(record)
    if not records:
        raise UserError(
            f"{args.run_dir / 'timeline'} holds no timeline of dp rank "
            f"{args.dp_rank}, tp rank {args.tp_rank}, cp rank {args.cp_rank}; a run with "
            "parallel.pp > 1 "
            "writes one when it ends"
        )
    records.sort(key=lambda r: r["pp_rank"])
    ranks = [
        [
            dict(zip(("kind", "microbatch", "chunk", "start", "end"), i, strict=True))
            for i in r["intervals"]
        ]
        for r in records
    ]
    first = records[0]
    title = (
        f"{first['schedule']}: p={first['pp']}, m={first['microbatches']}"
        + (f", v={first['vpp']}" if first["vpp"] > 1 else "")
        + f" (measured, step {first['step']})"
    )
    png = args.out or args.run_dir / "timeline.png"
    draw(ranks, png, title)
    trace = chrome_trace(ranks, png.with_suffix(".json"))
    print(f"wrote {png} and {trace}")
    return 0
