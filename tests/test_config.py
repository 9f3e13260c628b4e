"""Config files and ``--set`` values read with YAML 1.2's rules: every documented value unquoted.

YAML 1.1 (PyYAML's default) reads ``off``/``on``/``yes``/``no`` as booleans and ``7:3`` as
the base-60 number 423, so ``--set model.fused_kernels=off`` used to fail with "must be str,
got False". Files and ``--set`` share one loader (:func:`hpcllm.config.load_yaml`).

Values are checked for meaning as well as type: each harmful value (nan, a negative epsilon,
zero ranks, a run folder that cannot be a folder) is one UserError line naming the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpcllm import families
from hpcllm.config import (
    Config,
    ModelConfig,
    config_from_dict,
    fields,
    load_config,
    load_yaml,
    model_config,
    render_yaml,
)
from hpcllm.errors import UserError

EVERY_CHOICE = [(f.section, f.name, value) for f in fields() if f.choices for value in f.choices]
# The keys every family shares and each registered family's own, each once.
EVERY_FIELD = fields() + [f for arch in families.names() for f in fields(arch) if f.family]


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


# Choices that work only beside another setting, and that setting.
COMPANIONS = {
    ("train", "param_dtype", "bf16"): [
        ("train", "precision", "bf16"),
        ("parallel", "distributed_optimizer", "true"),
    ],
}


@pytest.mark.parametrize(("section", "key", "value"), EVERY_CHOICE)
def test_every_documented_choice_works_unquoted_with_set_and_in_a_file(
    section: str, key: str, value: str, tmp_path
) -> None:
    settings = [(section, key, value), *COMPANIONS.get((section, key, value), [])]
    cfg = load_config(None, [f"{s}.{k}={v}" for s, k, v in settings])
    assert getattr(getattr(cfg, section), key) == value
    path = tmp_path / "config.yaml"
    sections: dict[str, list[str]] = {}
    for s, k, v in settings:
        sections.setdefault(s, []).append(f"  {k}: {v}\n")
    path.write_text("".join(f"{s}:\n" + "".join(lines) for s, lines in sections.items()))
    assert getattr(getattr(load_config(path), section), key) == value


def test_profile_steps_range_reads_as_text() -> None:
    assert load_config(None, ["train.profile_steps=7:9"]).train.profile_steps == "7:9"


def test_a_yaml_1_1_boolean_word_for_a_boolean_key_is_one_clear_error() -> None:
    with pytest.raises(UserError, match=r"run.tensorboard must be bool, got 'yes'"):
        load_config(None, ["run.tensorboard=yes"])
    assert load_config(None, ["run.tensorboard=false"]).run.tensorboard is False


# Each of these ended in a traceback (or trained nan and exited 0) before values were checked
# for meaning; each is now one UserError line naming the key.
KNOWN_TRACEBACKS = [
    ("train.lr=nan", "train.lr must be a finite number"),
    ("model.init_std=-1", "model.init_std must be above 0"),
    ("parallel.tp=0", "parallel.tp must be positive"),
    ("run.dir=/proc/x", "run.dir '/proc/x' is in the kernel's /proc"),
    ("run.dir=/dev/null/x", "run.dir '/dev/null/x' cannot be a folder: /dev/null is not"),
    ("data.seed=-1", "data.seed must be from 0 to 2"),
]


@pytest.mark.parametrize(("override", "words"), KNOWN_TRACEBACKS)
def test_a_known_traceback_is_one_user_error_line(override: str, words: str) -> None:
    with pytest.raises(UserError, match=re.escape(words)) as err:
        load_config(None, [override])
    assert "\n" not in str(err.value)


def test_a_binary_or_non_utf8_config_file_is_one_user_error_line(tmp_path) -> None:
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(bytes(range(256)) * 4)
    latin = tmp_path / "latin1.yaml"
    latin.write_bytes("train:\n  lr: 1e-3  # réglé\n".encode("latin-1"))
    for path in (binary, latin):
        with pytest.raises(UserError, match="is not UTF-8 text") as err:
            load_config(path)
        assert "\n" not in str(err.value)


def test_invalid_yaml_is_one_line_with_its_place(tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  lr: [1, 2\n")
    with pytest.raises(UserError, match=r"bad\.yaml:\d+:\d+ is not valid YAML") as err:
        load_config(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text", [".nan", ".inf", "-.inf", ".NaN", "-.Inf"])
def test_yaml_nan_and_infinity_in_a_file_are_refused(text: str, tmp_path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(f"train:\n  lr: {text}\n")
    with pytest.raises(UserError, match="train.lr must be a finite number"):
        load_config(path)


FLOAT_KEYS = [(f.section, f.name, f.family) for f in EVERY_FIELD if "float" in f.type_text()]


@pytest.mark.parametrize(("section", "key", "family"), FLOAT_KEYS)
@pytest.mark.parametrize("value", ["nan", ".nan", "inf", ".inf", "-.inf", "1e999"])
def test_no_float_key_takes_nan_or_infinity(section: str, key: str, family, value: str) -> None:
    arch = [f"model.arch={family}"] if family else []  # a family's own key, in its family
    with pytest.raises(UserError, match=rf"{section}\.{key} must be a finite number"):
        load_config(None, [*arch, f"{section}.{key}={value}"])


HARMFUL = [
    ("train.grad_clip=-1", "train.grad_clip must be >= 0"),
    ("train.lr=0", "train.lr must be above 0"),
    ("train.lr=-1e-3", "train.lr must be above 0"),
    ("train.min_lr=-1", "train.min_lr must be >= 0"),
    ("train.min_lr=1", "train.min_lr 1.0 is above train.lr"),
    ("train.weight_decay=-0.1", "train.weight_decay must be >= 0"),
    ("train.beta1=1", "train.beta1 must be in [0, 1)"),
    ("train.beta2=-0.5", "train.beta2 must be in [0, 1)"),
    ("train.adam_eps=0", "train.adam_eps must be above 0"),
    ("train.adam_eps=-1e-8", "train.adam_eps must be above 0"),
    ("model.layer_norm_eps=-1", "model.layer_norm_eps must be above 0"),
    ("model.layer_norm_eps=0", "model.layer_norm_eps must be above 0"),
    ("model.init_std=0", "model.init_std must be above 0"),
    ("model.dropout=1", "model.dropout must be in [0, 1)"),
    ("model.dropout=-0.1", "model.dropout must be in [0, 1)"),
    ("model.n_layer=0", "model.n_layer must be positive"),
    ("model.n_layer=100000", "model.n_layer must be at most 4096"),
    ("model.n_head=-2", "model.n_head must be positive"),
    ("model.d_model=0", "model.d_model must be positive"),
    ("model.seq_len=0", "model.seq_len must be positive"),
    ("model.vocab_size=1", "model.vocab_size must be at least 2"),
    ("parallel.pp=0", "parallel.pp must be positive"),
    ("parallel.dp=0", "parallel.dp must be positive"),
    ("parallel.vpp=0", "parallel.vpp must be positive"),
    ("parallel.ddp_bucket_mb=0", "parallel.ddp_bucket_mb must be above 0"),
    ("parallel.ddp_bucket_mb=1e300", "parallel.ddp_bucket_mb must be at most 1e6"),
    ("parallel.horovod_fusion_mb=-1", "parallel.horovod_fusion_mb must be >= 0"),
    ("parallel.horovod_cycle_ms=-1", "parallel.horovod_cycle_ms must be >= 0"),
    ("parallel.max_staleness=-1", "parallel.max_staleness must be >= 0"),
    ("parallel.local_sgd_steps=0", "parallel.local_sgd_steps must be positive"),
    ("parallel.ps_async_order=random", "parallel.ps_async_order must be one of arrival, round-"),
    ("parallel.local_sgd_engine=ps", "parallel.local_sgd_engine must be one of ddp, horovod"),
    ("data.prefetch=0", "data.prefetch must be positive"),
    ("data.seed=4294967296", "data.seed must be from 0 to 2**32 - 1"),
    ("data.path=", "data.path must be a folder path"),
    ("train.seed=-1", "train.seed must be from 0 to 2**32 - 1"),
    ("train.steps=0", "train.steps must be positive"),
    ("train.micro_batch_size=0", "train.micro_batch_size must be positive"),
    ("train.global_batch_size=0", "train.global_batch_size must be positive"),
    ("train.lr_decay_steps=0", "train.lr_decay_steps must be positive"),
    ("train.lr_reference_batch=0", "train.lr_reference_batch must be positive"),
    ("train.log_interval=0", "train.log_interval must be positive"),
    ("train.eval_iters=0", "train.eval_iters must be positive"),
    ("train.warmup_steps=-1", "train.warmup_steps must be >= 0"),
    ("train.eval_interval=-1", "train.eval_interval must be >= 0"),
    ("train.save_interval=-5", "train.save_interval must be >= 0"),
    ("train.peak_tflops=0", "train.peak_tflops must be above 0"),
    ("train.profile_steps=7:3", "train.profile_steps 7:3: need 0 <= A < B"),
    ("train.profile_steps=a:b", "train.profile_steps must be A:B"),
    ("train.profile_steps=3", "train.profile_steps must be A:B"),
    ("train.max_bad_steps=0", "train.max_bad_steps must be positive"),
    ("train.steps=99999999999999999999", "train.steps must fit in 64 bits"),
    ("run.dir=", "run.dir must be a folder path"),
    ("run.dir=/sys/run", "run.dir '/sys/run' is in the kernel's /sys"),
    ("run.resume=never", "run.resume must be one of auto, none"),
    ("run.save_failure=ignore", "run.save_failure must be one of fail, warn"),
    ("run.timeout_s=0", "run.timeout_s must be above 0"),
    ("run.timeout_s=-1", "run.timeout_s must be above 0"),
    ("run.timeout_s=1e9", "run.timeout_s must be at most a week"),
    ("run.overwrite=yes", "run.overwrite must be bool"),
]


@pytest.mark.parametrize(("override", "words"), HARMFUL)
def test_a_harmful_value_is_refused_in_one_line(override: str, words: str) -> None:
    with pytest.raises(UserError, match=re.escape(words)) as err:
        load_config(None, [override])
    assert "\n" not in str(err.value)


def test_a_run_dir_through_a_file_or_on_a_file_is_refused(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    for where in (tmp_path / "file", tmp_path / "file" / "run"):
        with pytest.raises(UserError, match="cannot be a folder"):
            load_config(None, [f"run.dir={where}"])
    assert load_config(None, [f"run.dir={tmp_path / 'new' / 'run'}"]).run.dir.endswith("run")
    assert load_config(None, [f"run.dir={tmp_path}"]).run.dir == str(tmp_path)


def test_compression_the_engine_cannot_do_is_refused() -> None:
    with pytest.raises(UserError, match="dp_compression applies to ddp and horovod, not ps"):
        load_config(None, ["parallel.dp_engine=ps", "parallel.dp_compression=fp16"])
    with pytest.raises(UserError, match="Horovod compresses to fp16 only"):
        load_config(None, ["parallel.dp_engine=horovod", "parallel.dp_compression=bf16"])


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["parallel.dp_engine=ps-async", "parallel.tp=2"], "ps-async runs data parallelism alone"),
        (["parallel.dp_engine=local-sgd", "parallel.pp=2"], "local-sgd runs data parallelism"),
        (
            ["parallel.dp_engine=local-sgd", "parallel.distributed_optimizer=true"],
            "distributed_optimizer applies to the ddp and horovod engines, not local-sgd",
        ),
        (
            ["parallel.dp_engine=ps-async", "parallel.dp_compression=fp16"],
            "dp_compression applies to ddp and horovod, not ps-async",
        ),
        (["parallel.dp_engine=ps-async", "train.precision=fp16"], "use train.precision bf16"),
        (
            ["parallel.dp_engine=local-sgd", "parallel.local_sgd_steps=4", "train.save_interval=6"],
            "train.save_interval 6 is not a multiple of parallel.local_sgd_steps 4",
        ),
    ],
)
def test_what_the_async_engines_cannot_do_is_refused(overrides: list[str], words: str) -> None:
    with pytest.raises(UserError, match=re.escape(words)) as err:
        load_config(None, overrides)
    assert "\n" not in str(err.value)
    # The same engines at t = p = 1 with what they do support are accepted.
    load_config(None, ["parallel.dp_engine=ps-async", "parallel.max_staleness=0"])
    load_config(None, ["parallel.dp_engine=local-sgd", "train.save_interval=8"])


def test_meaningful_edges_are_accepted() -> None:
    cfg = load_config(
        None,
        [
            "train.grad_clip=0",
            "train.weight_decay=0",
            "train.min_lr=0",
            "train.warmup_steps=0",
            "train.eval_interval=0",
            "train.save_interval=0",
            "model.dropout=0",
            "train.beta1=0",
            "data.seed=0",
            "train.seed=4294967295",
            "parallel.horovod_cycle_ms=0",
            "train.lr=1e-3",
        ],
    )
    assert cfg.train.grad_clip == 0 and cfg.data.seed == 0


def test_new_keys_have_their_defaults_and_take_their_values() -> None:
    cfg = load_config()
    assert (cfg.run.overwrite, cfg.run.save_failure, cfg.run.timeout_s) == (False, "fail", 600.0)
    assert cfg.train.max_bad_steps == 10
    cfg = load_config(
        None,
        [
            "run.overwrite=true",
            "run.save_failure=warn",
            "run.timeout_s=30",
            "train.max_bad_steps=1",
        ],
    )
    assert (cfg.run.overwrite, cfg.run.save_failure, cfg.run.timeout_s) == (True, "warn", 30.0)
    assert cfg.train.max_bad_steps == 1


def test_every_key_is_listed_in_train_help() -> None:
    from hpcllm.cli import build_parser

    parser = build_parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(verbs.choices["train"].description.split())
    for section in dataclasses.fields(Config):
        keys = ", ".join(f.name for f in dataclasses.fields(section.default_factory()))
        assert f"{section.name} ({keys})" in text
    # Each registered family's own keys, under a line naming the family.
    for arch in families.names():
        own = [f for f in fields(arch) if f.family]
        header = f"the {arch} family's own keys (model.arch={arch}):" + ("" if own else " none")
        assert header in text, arch
        for f in own:
            assert f" {f.key} " in text[text.index(header) :], f.key


def test_checkpoint_keys_take_their_values_from_the_command_line_and_yaml(tmp_path) -> None:
    cfg = load_config()
    assert (cfg.run.reshard, cfg.run.keep_checkpoints) == (False, None)
    cfg = load_config(None, ["run.reshard=true", "run.keep_checkpoints=3"])
    assert (cfg.run.reshard, cfg.run.keep_checkpoints) == (True, 3)
    path = tmp_path / "run.yaml"
    path.write_text("run:\n  reshard: true\n  keep_checkpoints: 2\n")
    cfg = load_config(path)
    assert (cfg.run.reshard, cfg.run.keep_checkpoints) == (True, 2)
    path.write_text("run:\n  keep_checkpoints: null\n")
    assert load_config(path).run.keep_checkpoints is None
    with pytest.raises(UserError, match="run.keep_checkpoints must be positive"):
        load_config(None, ["run.keep_checkpoints=0"])


REPO = Path(__file__).resolve().parents[1]


def test_every_key_carries_its_description_and_its_rule():
    seen = set()
    for f in EVERY_FIELD:
        assert f.help and "\n" not in f.help and len(f.help) <= 100, f.key
        assert f.help not in seen, f"{f.key} repeats another key's description"
        seen.add(f.help)
        kind = f.type_text()
        if "int" in kind or "float" in kind:
            # A number always has bounds (or a form a check reads): none means any value goes.
            assert f.rules or f.form, f"{f.key} has no bound"
        elif kind.startswith("str") and f.choices is None:
            assert f.form, f"{f.key}: a free text key says what form it takes"
        assert f.rule_text(), f.key
        # The default passes the key's own rule.
        assert f.choices is None or f.default in f.choices, f.key
        for rule in f.rules:
            assert f.default is None or rule.passes(f.default), (f.key, rule.says)


def test_the_config_reference_page_is_written_from_the_fields():
    # A stale page fails: regenerate it with `python -m hpcllm.config > docs/config.md`. It is
    # run as that command: a family another test registers in this process is not the page's.
    env = {k: v for k, v in os.environ.items() if k != "HPCLLM_FAMILIES"}
    page = _python(env, "-m", "hpcllm.config")
    assert page.returncode == 0, page.stderr
    assert (REPO / "docs" / "config.md").read_text() == page.stdout
    for arch in families.names():  # each family's own keys, in a table under its name
        own = [f for f in fields(arch) if f.family]
        if own:
            table = page.stdout.split(f"### `model`: the {arch} family's own keys")[1]
            for f in own:
                assert f"\n| {f.name} | " in table, f.key


def test_the_printed_config_describes_each_key_and_reads_back(tmp_path):
    cfg = load_config(None, ["parallel.pipeline_layers=[1, 3]", "parallel.pp=2"])
    text = render_yaml(cfg)
    for f in fields():
        assert f"  {f.name}: " in text and f"# {f.help}" in text, f.key
    path = tmp_path / "printed.yaml"
    path.write_text(text)
    assert load_config(path) == cfg


# -- a family owns its config ---------------------------------------------------------------

LLAMA_TINY = ["model.arch=llama", "model.preset=llama-tiny"]


def test_a_familys_model_section_is_the_shared_keys_then_its_own():
    shared = [f.name for f in dataclasses.fields(ModelConfig)]
    own = [f.name for f in dataclasses.fields(families.get("llama").keys)]
    llama = model_config("llama", n_kv_heads=2)
    assert [f.name for f in dataclasses.fields(llama)] == shared + own
    assert isinstance(llama, ModelConfig) and (llama.arch, llama.n_kv_heads) == ("llama", 2)
    assert type(model_config("llama")) is type(llama)  # the class is built once
    assert type(Config().model) is type(model_config("gpt2")) is ModelConfig  # gpt2 adds none
    assert [f.name for f in fields("llama") if f.family == "llama"] == own
    assert not [f for f in fields() if f.family]


@pytest.mark.parametrize("arch_first", [True, False], ids=["arch-first", "arch-last"])
def test_a_familys_own_key_is_read_before_or_after_its_arch(arch_first: bool, tmp_path) -> None:
    sets = [*LLAMA_TINY, "model.n_kv_heads=1"]
    cfg = load_config(None, sets if arch_first else sets[::-1])
    assert isinstance(cfg.model, ModelConfig) and cfg.model.n_kv_heads == 1
    lines = ["  arch: llama\n", "  preset: llama-tiny\n", "  n_kv_heads: 1\n"]
    path = tmp_path / "llama.yaml"
    path.write_text("model:\n" + "".join(lines if arch_first else lines[::-1]))
    assert load_config(path) == cfg
    # The file sets the key and the command line the family, or the other way round.
    path.write_text("model:\n  n_kv_heads: 1\n")
    assert load_config(path, LLAMA_TINY) == cfg
    path.write_text("model:\n  arch: llama\n  preset: llama-tiny\n")
    assert load_config(path, ["model.n_kv_heads=1"]) == cfg


def test_another_familys_key_is_refused_unless_null_or_at_its_default(tmp_path) -> None:
    with pytest.raises(UserError) as err:
        load_config(None, ["model.n_kv_heads=2"])
    assert str(err.value) == (
        "model.n_kv_heads is not a gpt2 setting (the gpt2 family reads none); set it null, or "
        "choose the family that reads it (model.arch)"
    )
    path = tmp_path / "config.yaml"
    path.write_text("model:\n  rope_theta: 500000.0\n")
    with pytest.raises(UserError, match=r"^model\.rope_theta is not a gpt2 setting"):
        load_config(path)
    with pytest.raises(UserError, match=r"^model\.n_kv_heads must be int or null, got 'x'$"):
        load_config(None, ["model.n_kv_heads=x"])
    # Null, or Llama's own default, asks nothing of a GPT-2: the key is dropped.
    quiet = ["model.n_kv_heads=null", "model.rope_theta=10000", "model.tie_embeddings=null"]
    assert load_config(None, quiet) == load_config()
    # A key no family declares stays unknown; the guess may be another family's key.
    guess = "unknown key model.n_kv_head (did you mean model.n_kv_heads?); model keys: arch,"
    with pytest.raises(UserError, match="^" + re.escape(guess)):
        load_config(None, ["model.n_kv_head=2"])


# The model section of every run folder's config.yaml before each family owned its keys:
# Llama's keys in every config, at their defaults in a GPT-2's.
FORMER_MODEL_SECTION = """\
model:
  arch: {arch}
  preset: {preset}
  n_layer: 4
  n_head: 4
  d_model: 128
  seq_len: 128
  n_kv_heads: {n_kv_heads}
  ffn_size: {ffn_size}
  ffn_multiplier: null
  ffn_multiple_of: 256
  rope_theta: 10000.0
  rope_scaling: {rope_scaling}
  rope_low_freq_factor: 1.0
  rope_high_freq_factor: 4.0
  rope_original_seq_len: 8192
  tie_embeddings: {tie_embeddings}
  vocab_size: null
  dropout: 0.0
  recompute: none
  fused_kernels: auto
  compile: auto
  layer_norm_eps: 1.0e-05
  init_std: 0.02
"""


OWN = ("n_kv_heads", "ffn_size", "rope_scaling", "tie_embeddings")


@pytest.mark.parametrize(
    ("arch", "preset", "own"),
    [
        ("gpt2", "tiny", dict.fromkeys(OWN, "null")),
        ("llama", "llama-tiny", dict(zip(OWN, ("2", "352", "4.0", "false"), strict=True))),
    ],
    ids=["gpt2", "llama"],
)
def test_a_run_folders_config_from_before_the_families_owned_their_keys_loads(
    arch: str, preset: str, own: dict[str, str], tmp_path
) -> None:
    text = FORMER_MODEL_SECTION.format(arch=arch, preset=preset, **own)
    # Such a run kept 8192 where llama-tiny's preset says 32 (a preset used to fill only null
    # keys): the folder resumes as it trained.
    written = ["model.rope_original_seq_len=8192"] if arch == "llama" else []
    expected = load_config(None, [f"model.arch={arch}", f"model.preset={preset}", *written])
    assert config_from_dict(load_yaml(text)) == expected  # resume, re-cut, load_model
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert load_config(path) == expected  # --config RUN/config.yaml
    for saved in sorted((REPO / "tests" / "recorded").rglob("config.yaml")):
        assert type(config_from_dict(load_yaml(saved.read_text())).model) is ModelConfig


def test_the_printed_config_of_a_family_describes_its_own_keys_and_reads_back(tmp_path):
    cfg = load_config(None, [*LLAMA_TINY, "model.n_kv_heads=1"])
    text = render_yaml(cfg)
    for f in fields(cfg):
        assert f"  {f.name}: " in text and f"# {f.help}" in text, f.key
    assert "  n_kv_heads: 1  # key/value heads, grouped-query attention" in text
    path = tmp_path / "printed.yaml"
    path.write_text(text)
    assert load_config(path) == cfg


# A family registered by a plugin module (HPCLLM_FAMILIES), in a process of its own so that
# this one's registry stays the built-in families: GPT-2's spec with a key, a preset and a
# check of its own.
KEYED_FAMILY = '''
import dataclasses

from hpcllm import families
from hpcllm.keys import POSITIVE, key
from hpcllm.user_error import UserError


@dataclasses.dataclass
class KeyedKeys:
    """The keyed family's own key."""

    n_experts: int = key(4, "experts per block (keyed)", POSITIVE)


def check(model, tp):
    if model.n_experts % tp:
        raise UserError(f"model.n_experts {model.n_experts} is not divisible by parallel.tp {tp}")


families.register(
    dataclasses.replace(
        families.get("gpt2"),
        name="keyed",
        keys=KeyedKeys,
        presets={"keyed-tiny": {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16}},
        check=check,
        hf_model_type=None,
    )
)
'''


def _python(env: dict[str, str], *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Return an environment in which hpcllm registers the keyed family."""
    folder = tmp_path_factory.mktemp("plugin")
    (folder / "keyed_family.py").write_text(KEYED_FAMILY)
    path = os.pathsep.join([str(folder), str(REPO)])
    return {**os.environ, "HPCLLM_FAMILIES": "keyed_family", "PYTHONPATH": path}


@pytest.mark.slow
def test_a_family_registered_elsewhere_brings_its_own_key(keyed: dict[str, str], tmp_path):
    def train(*sets: str, cwd: Path = tmp_path) -> subprocess.CompletedProcess:
        words = [word for item in sets for word in ("--set", item)]
        return _python(keyed, "-m", "hpcllm", "train", *words, "--print-config", cwd=cwd)

    keyed_tiny = ["model.n_experts=2", "model.arch=keyed", "model.preset=keyed-tiny"]
    printed = train(*keyed_tiny)
    assert printed.returncode == 0, printed.stderr
    assert "\n  n_experts: 2  # experts per block (keyed)\n" in printed.stdout
    (tmp_path / "printed.yaml").write_text(printed.stdout)
    again = _python(keyed, "-m", "hpcllm", "train", "--config", "printed.yaml", "--print-config",
                    cwd=tmp_path)  # fmt: skip
    assert (again.returncode, again.stdout) == (0, printed.stdout), again.stderr
    for sets, words in [
        (["model.n_experts=0"], "model.n_experts must be positive, got 0"),
        (["model.n_experts=3", "parallel.tp=2"], "n_experts 3 is not divisible by parallel.tp 2"),
        (["model.arch=gpt2"], "model.n_experts is not a gpt2 setting"),
    ]:
        refused = train(*keyed_tiny, *sets)
        assert refused.returncode == 2 and words in refused.stderr, refused.stderr
        assert refused.stderr.count("\n") == 1
    shown = _python(keyed, "-m", "hpcllm", "train", "--help").stdout
    assert re.search(
        r"the keyed family's own keys \(model.arch=keyed\):\n  model\.n_experts +int +4\n"
        r" +experts per block \(keyed\)\n",
        shown,
    )
    page = _python(keyed, "-m", "hpcllm.config").stdout
    assert "### `model`: the keyed family's own keys" in page
    assert "\n| n_experts | int | 4 | must be positive | experts per block (keyed) |\n" in page
    assert "keyed-tiny or null" in page and "must be a model family: gpt2, keyed, llama," in page


def test_the_batch_product_is_computed_in_one_place():
    # micro-batch x accumulation x d, and its inverses, only in hpcllm.config.BatchPlan: any
    # product of a micro-batch size with d or an accumulation count elsewhere, or a division
    # of a global batch, fails (every spelling the code used before: micro_batch_size * dp,
    # d * b, global_batch // (d * b), iters * micro_batch_size).
    import ast

    sizes = {"dp", "dp_size", "d", "accumulation", "iters", "m"}
    micro = ("micro_batch", "micro_batch_size", "b")

    def names(node: ast.AST) -> set[str]:
        found = set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name):
                found.add(sub.id)
            elif isinstance(sub, ast.Attribute):
                found.add(sub.attr)
        return found

    bad = []
    for top in ("hpcllm", "datasets", "kernels"):
        for path in sorted((REPO / top).rglob("*.py")):
            if path == REPO / "hpcllm" / "config.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.BinOp):
                    continue
                left, right = names(node.left), names(node.right)
                if isinstance(node.op, ast.Mult) and any(
                    set(micro) & a and sizes & b for a, b in ((left, right), (right, left))
                ):
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno}")
                if isinstance(node.op, ast.FloorDiv | ast.Mod) and any(
                    "global_batch" in n for n in left
                ):
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not bad, "the batch product outside hpcllm.config.BatchPlan: " + ", ".join(bad)


def test_p_and_t_name_the_pipeline_and_tensor_sizes_only():
    # `p, t = cfg.parallel, cfg.train` once read like the pipeline and tensor sizes: a local
    # name p or t bound to a config section fails (call them parallel and train).
    import ast

    bad = []
    for top in ("hpcllm", "datasets", "kernels"):
        for path in sorted((REPO / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
                    continue
                target, value = node.targets[0], node.value
                pairs = (
                    list(zip(target.elts, value.elts, strict=False))
                    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
                    else [(target, value)]
                )
                for name, bound in pairs:
                    if (
                        isinstance(name, ast.Name)
                        and name.id in ("p", "t")
                        and isinstance(bound, ast.Attribute)
                        and bound.attr in ("parallel", "train", "model", "data", "run")
                    ):
                        bad.append(f"{path.relative_to(REPO)}:{node.lineno} {name.id}")
    assert not bad, "p or t bound to a config section: " + ", ".join(bad)


def test_a_preset_fills_every_key_it_gives_that_the_user_did_not():
    # Keys whose default is not null are the preset's too: Llama 3's rotary base, llama-tiny's
    # scaled context. What the user gives wins, in a file or on the command line.
    llama3 = load_config(None, ["model.arch=llama", "model.preset=llama3-8b"]).model
    assert (llama3.rope_theta, llama3.n_kv_heads, llama3.ffn_size) == (500000.0, 8, 14336)
    assert (
        load_config(
            None, ["model.arch=llama", "model.preset=llama-tiny"]
        ).model.rope_original_seq_len
        == 32
    )
    given = ["model.arch=llama", "model.rope_theta=1000", "model.preset=llama3-8b"]
    assert load_config(None, given).model.rope_theta == 1000.0
