"""The ``hpcllm`` command's verbs, one module each (``bench`` a package of its targets).

Each module has ``add_parser(verbs)``, which adds its parser and sets ``run`` as its handler,
and ``run(args) -> int``, the exit status. A module imports nothing heavy at its top (no torch,
no MPI): :func:`hpcllm.cli.build_parser` imports every one, and ``hpcllm --help`` stays fast;
``run`` imports what the command needs.
"""

from __future__ import annotations

import argparse
import importlib

# In the order `hpcllm --help` lists them.
COMMANDS = (
    "topo",
    "prepare",
    "inspect",
    "train",
    "generate",
    "evaluate",
    "convert",
    "plan",
    "bench",
    "timeline",
)


def add_parsers(verbs: argparse._SubParsersAction) -> None:
    """Add every command's parser to ``verbs``."""
    for name in COMMANDS:
        importlib.import_module(f"hpcllm.commands.{name}").add_parser(verbs)
