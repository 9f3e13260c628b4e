"""Every option of every ``hpcllm`` command and bench target, as argparse holds them.

``python tests/cli_options.py`` re-records tests/recorded/cli_options.json; test_cli compares
the parser with the recording, so a command split or moved keeps every option it had.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RECORDED = Path(__file__).parent / "recorded" / "cli_options.json"


def _options(parser: argparse.ArgumentParser) -> dict[str, object]:
    """Return a parser's options: flags with their choices, nargs and default; positionals."""
    found: dict[str, object] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        found[name] = {
            "choices": None if action.choices is None else list(action.choices),
            "nargs": None if action.nargs is None else str(action.nargs),
            "default": None if action.default is None else repr(action.default),
            "required": bool(action.required),
        }
    return found


def _commands(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, object]:
    """Return ``{"verb [target]": options}`` for ``parser`` and its sub-commands."""
    found = {prefix.strip() or "hpcllm": _options(parser)}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(_commands(sub, f"{prefix} {name}"))
    return found


def current() -> dict[str, object]:
    """Return the option sets of the command line as it is now."""
    from hpcllm.bench import collectives, device, kernels
    from hpcllm.cli import build_parser

    found = _commands(build_parser())
    # These hand every word to their own parser.
    found["bench kernels"] = _options(kernels.build_parser())
    found["bench device"] = _options(device.build_parser())
    found["bench collectives"] = _options(collectives.build_parser())
    return found


if __name__ == "__main__":
    RECORDED.write_text(json.dumps(current(), indent=1, sort_keys=True) + "\n")
    sys.exit(0)
