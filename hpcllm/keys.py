"""How a config key is declared: its default, its one-line description and its rule.

The config sections (:mod:`hpcllm.config`) and a model family's own keys
(``Family.keys``, in the family's spec module) declare their fields with :func:`key` and the
bounds below, so every key shows in ``--help``, ``--print-config``, docs/config.md and the
checks alike. Torch-free and importing nothing of hpcllm: the families and the config both
stand on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Words, or a function that gives them when they are shown: what is registered (a model
# family, a preset) is known only then.
Text = str | Callable[[], str]


def text_of(words: Text) -> str:
    """Return the words of a rule or a form, asking the function where they depend on it."""
    return words() if callable(words) else words


@dataclass(frozen=True, eq=False)
class Rule:
    """A bound a key's value must pass (null always passes), and what it says when it does not."""

    passes: Callable[[Any], bool]
    words: Text

    @property
    def says(self) -> str:
        """Return what the rule says of a value that fails it: ``must be positive``."""
        return text_of(self.words)


# The bounds, in the order the check tries them (each key's rules are tried in this order).
POSITIVE = Rule(lambda v: v >= 1, "must be positive")
COUNT_OR_NEVER = Rule(lambda v: v >= 0, "must be >= 0 (0: none or never)")
ABOVE_ZERO = Rule(lambda v: v > 0, "must be above 0")
OFF_AT_ZERO = Rule(lambda v: v >= 0, "must be >= 0")  # 0 is off (no decay, no clipping)
FRACTION = Rule(lambda v: 0 <= v < 1, "must be in [0, 1)")  # 1 drops everything
STRAGGLE = Rule(lambda v: 1 <= v <= 1000, "must be from 1 to 1000")
RANK = Rule(lambda v: v >= 0, "must be >= 0")
SEED = Rule(lambda v: 0 <= v < 2**32, "must be from 0 to 2**32 - 1")  # numpy's and torch's
# Past these no machine has a meaning for the value (and what it feeds overflows).
LAYERS = Rule(lambda v: v <= 4096, "must be at most 4096")  # bounds the per-stage lists
MEGABYTES = Rule(lambda v: v <= 1e6, "must be at most 1e6 (a terabyte)")
WEEK = Rule(lambda v: v <= 7 * 24 * 3600, "must be at most a week (604800)")
TWO_TOKENS = Rule(lambda v: v >= 2, "must be at least 2")  # a vocabulary of one predicts nothing
RULES = (
    POSITIVE,
    COUNT_OR_NEVER,
    ABOVE_ZERO,
    OFF_AT_ZERO,
    FRACTION,
    STRAGGLE,
    RANK,
    SEED,
    LAYERS,
    MEGABYTES,
    WEEK,
    TWO_TOKENS,
)


def key(default: Any, help: str, *rules: Rule, form: Text | None = None) -> Any:  # noqa: A002
    """Return a config field: its default, its one-line description and its rule.

    The rule is the field's ``Literal[...]`` type (choices), its bounds (``rules``), or, for a
    value whose form a check reads (a folder path, ``A:B``), ``form`` says what it must be.
    ``hpcllm.config.fields`` reads all of it back.
    """
    if isinstance(default, list):
        raise TypeError("a list default needs a factory")
    return field(default=default, metadata={"help": help, "rules": rules, "form": form})
