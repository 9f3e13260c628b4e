"""Preflight refuses what cannot run on a world size; start-up warnings name what runs badly.

Both touch nothing (no data, device, process group or file), so every case runs in
milliseconds.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from hpcllm.bench.dp import default_precisions
from hpcllm.config import load_config
from hpcllm.errors import UserError
from hpcllm.train.parallelize import check_compile_mode
from hpcllm.train.preflight import (
    check_against_data,
    cpu_has_native_bf16,
    preflight,
    startup_warnings,
)


@pytest.mark.parametrize(
    ("overrides", "world_size", "words"),
    [
        (["parallel.tp=2"], 3, "world size 3 is not divisible by tp*pp = 2*1"),
        (["parallel.tp=2", "parallel.pp=2"], 6, "world size 6 is not divisible by tp*pp"),
        (["parallel.dp=3"], 2, "tp*pp*dp = 1*1*3 = 3 does not equal the world size 2"),
        (["parallel.vpp=2"], 1, "needs parallel.pp >= 2"),
        (["parallel.pp=2", "parallel.schedule=interleaved"], 2, "needs parallel.vpp >= 2"),
        (["parallel.pp=2", "parallel.vpp=2"], 2, "needs parallel.schedule: interleaved"),
        (["parallel.pp=8"], 8, "model.n_layer 4 is fewer than the 8 pipeline stages"),
        (["parallel.pp=2", "parallel.pipeline_layers=[1, 2]"], 2, "pipeline_layers [1, 2]"),
        (["parallel.pipeline_layers=[3]"], 1, "pipeline_layers [3] must give each"),
        (["train.global_batch_size=12"], 8, "not a multiple of micro_batch_size x dp = 4 x 8"),
        (
            ["parallel.pp=2", "parallel.schedule=zb-h1", "model.compile=blocks"],
            2,
            "model.compile: blocks cannot run parallel.schedule: zb-h1",
        ),
    ],
)
def test_preflight_refuses_what_cannot_run_in_one_line(
    overrides: list[str], world_size: int, words: str
) -> None:
    with pytest.raises(UserError, match=re.escape(words)) as err:
        preflight(load_config(None, overrides), world_size)
    assert "\n" not in str(err.value)


def test_preflight_checks_the_config_itself() -> None:
    # A Config changed after loading: heads over t, and the sequence over t, are checked again.
    cfg = load_config()
    cfg.parallel.tp = 8
    with pytest.raises(UserError, match="model.n_head 4 is not divisible by parallel.tp 8"):
        preflight(cfg, 8)
    cfg = load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=true"])
    cfg.model.seq_len = 127
    with pytest.raises(UserError, match="use a seq_len divisible by 2"):
        preflight(cfg, 2)


@pytest.mark.parametrize(
    ("overrides", "world_size"),
    [
        ([], 1),
        ([], 8),
        (["parallel.tp=2", "parallel.pp=2"], 8),
        (["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved"], 2),
        (["parallel.pp=2", "parallel.schedule=zb-h1", "model.compile=auto"], 2),
        (["parallel.schedule=zb-h1", "model.compile=blocks"], 1),  # one stage runs 1f1b
        (["parallel.pipeline_layers=[4]"], 1),
        (["train.global_batch_size=32"], 4),
    ],
)
def test_preflight_passes_what_can_run(overrides: list[str], world_size: int) -> None:
    preflight(load_config(None, overrides), world_size)


def _warnings(overrides: list[str], **kwargs: object) -> list[str]:
    given = {
        "world_size": 1,
        "device_type": "cpu",
        "cpu_has_bf16": True,
        "train_tokens": None,
        "val_tokens": None,
        **kwargs,
    }
    return startup_warnings(load_config(None, overrides), **given)


def test_no_warning_for_a_sound_run() -> None:
    assert _warnings([], train_tokens=10**7, val_tokens=10**6) == []
    assert _warnings(["train.precision=fp16"], device_type="cuda") == []
    assert _warnings(["train.precision=bf16"], device_type="cuda", cpu_has_bf16=False) == []


def test_half_precision_the_cpu_emulates_is_named() -> None:
    (fp16,) = _warnings(["train.precision=fp16"])
    assert "fp16 on a CPU" in fp16
    (bf16,) = _warnings(["train.precision=bf16"], cpu_has_bf16=False)
    assert "bf16 on a CPU without native bf16" in bf16
    assert _warnings(["train.precision=bf16"], cpu_has_bf16=True) == []


def test_fewer_micro_batches_than_stages_is_named() -> None:
    (bubble,) = _warnings(["parallel.pp=4"], world_size=4)
    assert "1 micro-batch(es) per step for 4 pipeline stages" in bubble
    assert "global_batch_size 16" in bubble
    assert _warnings(["parallel.pp=4", "train.global_batch_size=16"], world_size=4) == []


def test_data_read_more_than_once_is_named_and_a_fitting_run_is_not() -> None:
    # 100 steps x global batch 4 x 128 tokens: 400 samples wanted.
    (over,) = _warnings([], train_tokens=100 * 128 + 1)
    assert "train split holds 100 samples" in over and "4.0 times over" in over
    assert _warnings([], train_tokens=400 * 128 + 1) == []
    # Smaller than one global micro-batch: the reader refuses it, no warning first.
    assert _warnings([], train_tokens=3 * 128 + 1) == []


def test_a_validation_split_shorter_than_eval_iters_is_named() -> None:
    (short,) = _warnings([], val_tokens=3 * 4 * 128 + 1)  # 3 micro-batches of 4, eval_iters 10
    assert "validation split holds 3 global micro-batch(es)" in short
    assert _warnings([], val_tokens=10 * 4 * 128 + 1) == []
    # None or empty (the trainer warns), or smaller than one micro-batch (the reader refuses).
    assert _warnings([], val_tokens=0) == []
    assert _warnings([], val_tokens=2 * 128 + 1) == []


def test_a_train_split_too_small_for_a_micro_batch_names_the_keys_that_fit_it() -> None:
    # 3 samples of 128 tokens, a micro-batch of 4: the advice names the trainer's keys.
    manifest = SimpleNamespace(vocab_size=257, n_tokens=lambda split: 3 * 128 + 1)
    with pytest.raises(UserError) as err:
        check_against_data(load_config(), manifest, 1)  # type: ignore[arg-type]
    assert str(err.value) == (
        "the train split has 3 samples of 128 tokens, fewer than one global micro-batch (1 "
        "ranks x 4); use more data, a shorter model.seq_len or a smaller "
        "train.micro_batch_size"
    )


def test_cpu_bf16_is_read_from_the_cpu_flags(tmp_path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n")
    assert not cpu_has_native_bf16(info)
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n")
    assert cpu_has_native_bf16(info)
    info.write_text("processor\t: 0\nflags\t\t: fpu amx_tile amx_bf16\n")
    assert cpu_has_native_bf16(info)
    info.write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16\n")
    assert cpu_has_native_bf16(info)
    assert not cpu_has_native_bf16(tmp_path / "missing")


def test_bench_dp_default_precisions_skip_emulated_bf16() -> None:
    assert default_precisions(gpu=True, native_bf16=False) == (["fp32", "fp16"], None)
    assert default_precisions(gpu=False, native_bf16=True) == (["fp32", "bf16"], None)
    precisions, note = default_precisions(gpu=False, native_bf16=False)
    assert precisions == ["fp32"] and "bf16 left out" in note


def test_a_compile_mode_that_does_nothing_is_named() -> None:
    (idle,) = _warnings(["model.compile_mode=max-autotune"])  # the CPU: auto compiles nothing
    assert idle == (
        "model.compile_mode max-autotune does nothing here: model.compile auto compiles "
        "nothing on cpu"
    )
    graphs = ["model.compile_mode=reduce-overhead", "train.micro_batch_size=1"]
    assert _warnings([*graphs, "train.global_batch_size=1"], device_type="cuda") == []
    assert _warnings(["model.compile_mode=max-autotune"], device_type="cuda") == []


def test_cuda_graphs_over_several_micro_batches_are_refused_in_one_line() -> None:
    with pytest.raises(UserError) as refused:
        check_compile_mode("reduce-overhead", "full", "cuda", 4)
    assert "\n" not in str(refused.value)
    assert "reduce-overhead cannot train 4 micro-batches per step" in str(refused.value)
    check_compile_mode("reduce-overhead", "full", "cuda", 1)  # one micro-batch: measured
    check_compile_mode("reduce-overhead", "blocks", "cpu", 4)  # no CUDA graphs off the GPU
    check_compile_mode("reduce-overhead", "none", "cuda", 4)  # nothing compiled
    check_compile_mode("max-autotune", "full", "cuda", 4)
