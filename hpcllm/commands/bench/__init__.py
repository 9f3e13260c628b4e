"""``hpcllm bench TARGET``: one module per target, each with ``add_parser`` and ``run``.

``kernels``, ``device`` and ``collectives`` hand every word after their name to the
benchmark's own parser (:func:`own_parser`), which argparse's sub-commands could not do for
words that start with ``-``.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

# In the order `hpcllm bench --help` lists them.
TARGETS = (
    "data",
    "prepare",
    "step",
    "dp",
    "sync",
    "allreduce",
    "collectives",
    "pipeline",
    "kernels",
    "device",
    "moe",
    "cp",
    "generate",
    "report",
)


def add_parser(verbs: argparse._SubParsersAction) -> None:
    """Add ``bench`` and its targets' parsers to ``verbs``."""
    bench = verbs.add_parser("bench", help="measure one part of the system")
    targets = bench.add_subparsers(dest="target", required=True, metavar="TARGET")
    for name in TARGETS:
        importlib.import_module(f"hpcllm.commands.bench.{name}").add_parser(targets)


def own_parser(words: list[str]) -> Callable[[list[str]], int] | None:
    """Return the ``main(argv)`` that takes ``words[2:]`` when ``words`` run a target that
    parses its own arguments (``bench kernels``, ``bench device``, ``bench collectives``),
    else None."""
    if words[:1] != ["bench"] or words[1:2] not in (["kernels"], ["device"], ["collectives"]):
        return None
    module = importlib.import_module(f"hpcllm.bench.{words[1]}")
    return module.main
