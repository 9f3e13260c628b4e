"""What every command's parser shares: number types that refuse bad values in one line, the
``--config``/``--set`` pair, ``--step N`` and the parser class whose errors are UserErrors."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def at_least(convert: type, low: float, what: str) -> Any:
    """Return an argparse type: ``convert`` of the text, refused below ``low`` as not ``what``."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    return parse


positive = at_least(int, 1, "a positive integer")
non_negative_int = at_least(int, 0, "an integer >= 0")
non_negative = at_least(float, 0.0, "a number >= 0")


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--config FILE`` and the repeatable ``--set SECTION.KEY=VALUE``."""
    parser.add_argument("--config", type=Path, metavar="FILE", help="YAML config")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one key (repeatable)",
    )


def step_arg(parser: argparse.ArgumentParser, what: str) -> None:
    """Add ``--step N``: which checkpoint the command ``what`` (reads, samples from...)."""
    parser.add_argument(
        "--step",
        type=non_negative_int,
        metavar="N",
        help=f"{what} the checkpoint of step N [default: the newest that verifies]",
    )


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are UserErrors: one line, rank 0, exit 2 on every rank."""

    def error(self, message: str) -> None:  # type: ignore[override]
        from hpcllm.errors import UserError

        raise UserError(f"{message} (see `{self.prog} --help`)")
