"""Config files and ``--set`` values read with YAML 1.2's rules: every documented value unquoted.

YAML 1.1 (PyYAML's default) reads ``off``/``on``/``yes``/``no`` as booleans and ``7:3`` as
the base-60 number 423, so ``--set model.fused_kernels=off`` used to fail with "must be str,
got False". Files and ``--set`` share one loader (:func:`hpcllm.config.load_yaml`).
"""

from __future__ import annotations

import pytest

from hpcllm.config import _CHOICES, load_config, load_yaml
from hpcllm.errors import UserError

EVERY_CHOICE = [
    (section, key, value) for (section, key), values in _CHOICES.items() for value in values
]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("off", "off"),
        ("on", "on"),
        ("yes", "yes"),
        ("no", "no"),
        ("y", "y"),
        ("true", True),
        ("False", False),
        ("7:3", "7:3"),
        ("1:30:00", "1:30:00"),
        ("1e-3", 0.001),
        ("2.0e-3", 0.002),
        ("12", 12),
        ("-3", -3),
        ("010", 10),
        ("0x1f", 31),
        ("0o17", 15),
        ("1_000", "1_000"),
        ("null", None),
        ("~", None),
        ("[1, 2]", [1, 2]),
    ],
)
def test_plain_scalars_follow_yaml_1_2(text: str, value: object) -> None:
    assert load_yaml(text) == value
    assert load_yaml(f"key: {text}") == {"key": value}


@pytest.mark.parametrize(("section", "key", "value"), EVERY_CHOICE)
def test_every_documented_choice_works_unquoted_with_set_and_in_a_file(
    section: str, key: str, value: str, tmp_path
) -> None:
    cfg = load_config(None, [f"{section}.{key}={value}"])
    assert getattr(getattr(cfg, section), key) == value
    path = tmp_path / "config.yaml"
    path.write_text(f"{section}:\n  {key}: {value}\n")
    assert getattr(getattr(load_config(path), section), key) == value


def test_profile_steps_range_reads_as_text() -> None:
    assert load_config(None, ["train.profile_steps=7:9"]).train.profile_steps == "7:9"


def test_a_yaml_1_1_boolean_word_for_a_boolean_key_is_one_clear_error() -> None:
    with pytest.raises(UserError, match=r"run.tensorboard must be bool, got 'yes'"):
        load_config(None, ["run.tensorboard=yes"])
    assert load_config(None, ["run.tensorboard=false"]).run.tensorboard is False
