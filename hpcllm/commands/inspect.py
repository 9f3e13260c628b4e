"""``hpcllm inspect``: summarise, verify or dump prepared shards; verify a run's checkpoints."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def add_parser(verbs: argparse._SubParsersAction) -> None:
    """Add the command's parser to ``verbs``."""
    insp = verbs.add_parser(
        "inspect",
        help="summarise, verify or dump prepared shards; verify a run's checkpoints",
        description="Summarise a folder written by `hpcllm prepare`: shards, documents, "
        "tokens, tokenizer. --verify reads every shard and checks its checksums and counts; "
        "--dump writes a split's documents back as text. Given a run folder (run.dir), "
        "verify every checkpoint against its manifest and print one row per checkpoint "
        "(step, files, bytes, status, reason); exit 1 if any is bad.",
    )
    insp.add_argument(
        "dir", type=Path, metavar="DIR", help="the folder given to prepare --out, or a run.dir"
    )
    insp.add_argument("--json", action="store_true", help="print the summary as JSON")
    insp.add_argument(
        "--verify",
        action="store_true",
        help="read every chunk of every shard (fletcher32 checksums), check "
        "counts and document offsets; exit 2 naming the first bad file",
    )
    insp.add_argument(
        "--dump",
        choices=["train", "val"],
        metavar="train|val",
        help="write the decoded documents of a split to stdout in corpus order, "
        "each followed by '\\n<|endoftext|>\\n'",
    )
    insp.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Summarise, verify or dump DIR; exit 1 if a run folder holds a bad checkpoint."""
    from hpcllm.datasets import inspection
    from hpcllm.datasets.shards import load_manifest
    from hpcllm.errors import UserError
    from hpcllm.train import inspect_run

    if inspect_run.is_run_folder(args.dir):
        if args.dump:
            raise UserError(f"{args.dir} is a run folder; --dump reads a prepared data folder")
        check = inspect_run.verify_run(args.dir)
        if args.json:
            rows = [{**vars(v), "folder": str(v.folder)} for v in check.verdicts]
            unfinished = [
                {"folder": name, "step": step, "bytes": size}
                for name, step, size in check.unfinished
            ]
            print(
                json.dumps(
                    {
                        "checkpoints": rows,
                        "latest": check.latest_problem or check.latest,
                        "unfinished": unfinished,
                        "lock": check.lock,
                    }
                )
            )
        else:
            print(inspect_run.render_run(check))
        return 0 if check.ok else 1
    manifest = load_manifest(args.dir)
    if args.verify:
        count = inspection.verify(manifest)
        print(f"ok: {count} shards verified (checksums, counts, document offsets)", file=sys.stderr)
    if args.dump:
        try:
            inspection.dump(manifest, args.dump, sys.stdout.buffer)
        except BrokenPipeError:  # `| head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    info = inspection.summary(manifest)
    print(json.dumps(info, indent=2) if args.json else inspection.render_summary(info))
    return 0
