"""``hpcllm bench generate``: sampling with and without the KV cache."""

from __future__ import annotations

import argparse
from pathlib import Path

from hpcllm.commands.args import positive


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Add the target's parser to ``targets``."""
    gen = targets.add_parser(
        "generate",
        help="sampling with and without the KV cache: the same tokens, the time of each",
        description="For each model (a preset of either family, random weights, on the CPU or "
        "wherever torch runs), sample --tokens tokens after a --prompt-token prompt at "
        "temperature 0 with the KV cache and without, in alternating runs; check the tokens "
        "agree and print the median times and the speed-up.",
    )
    gen.add_argument(
        "--models",
        nargs="+",
        default=["tiny", "llama-tiny"],
        metavar="PRESET",
        help="model presets [default: tiny llama-tiny]",
    )
    gen.add_argument("--prompt", type=positive, default=20, help="prompt tokens [default: 20]")
    gen.add_argument("--tokens", type=positive, default=100, help="new tokens [default: 100]")
    gen.add_argument(
        "--seq-len", type=positive, default=128, help="the models' seq_len [default: 128]"
    )
    gen.add_argument("--repeats", type=positive, default=5, help="runs of each [default: 5]")
    gen.add_argument("--threads", type=positive, default=2, help="torch threads [default: 2]")
    gen.add_argument(
        "--device",
        default="cpu",
        help="where the models run: cpu, cuda, cuda:N [default: cpu]",
    )
    gen.add_argument("--json-out", type=Path, default=None, help="also write JSON here")
    gen.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Time each model and print the table (and write JSON)."""
    from hpcllm.bench import generate

    result = generate.run(
        args.models,
        args.prompt,
        args.tokens,
        args.seq_len,
        args.repeats,
        args.threads,
        args.device,
    )
    print(generate.render(result))
    if args.json_out is not None:
        generate.write_json(result, args.json_out)
    return 0
