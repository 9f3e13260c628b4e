"""What ``hpcllm train`` can refuse, or warn about, before it touches anything.

:func:`preflight` runs every check that needs only the config and the world size: no data
read, no device, no process group, no file written. So a job that cannot run fails in one
line at once, on every rank alike, and a job that can run leaves no half-made run folder
behind when something else refuses it. :func:`startup_warnings` names settings that run but
waste the machine (a precision the CPU emulates, a pipeline that idles, data read many times
over); the trainer prints them once, on rank 0. :func:`check_against_data` adds what needs
the prepared data's manifest; :func:`check_job` runs both, for the trainer and
``--print-config`` alike.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import overload

import torch

from hpcllm.config import Config, batch_plan, check
from hpcllm.datasets.blend import Blend
from hpcllm.datasets.reader import TRAIN_ADVICE, micro_steps_per_epoch
from hpcllm.datasets.shards import Manifest
from hpcllm.errors import UserError
from hpcllm.model.stages import split_layers
from hpcllm.topology import Layout
from hpcllm.train.parallelize import check_pipeline, compiled_how, resolve_compile

# CPU flags of native bf16 arithmetic: AVX512-BF16 and AMX on x86, the BF16 extension on Arm.
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Return whether this CPU computes in bf16 natively (Linux's /proc/cpuinfo flags).

    Without it torch emulates bf16 through fp32 conversions: a 4-layer GPT ran 20x slower
    than in fp32 on such a machine. Elsewhere than Linux the answer is False.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features") and _BF16_FLAGS & set(value.split()):
            return True
    return False


def _layout(cfg: Config, world_size: int) -> Layout:
    parallel = cfg.parallel
    return Layout.for_world(
        world_size,
        tp=parallel.tp,
        pp=parallel.pp,
        dp=parallel.dp,
        vpp=parallel.vpp,
        ep=parallel.ep,
        cp=parallel.cp,
    )


def preflight(cfg: Config, world_size: int) -> None:
    """Raise a UserError (one line) for the first setting that cannot run on ``world_size`` ranks.

    Checks the config alone (:func:`hpcllm.config.check`), then the grid (t·p dividing the
    world size, or t·p·d equal to it), the micro-batches per step, the pipeline's schedule
    and layer split, and ``model.compile`` against the schedule, as the trainer would meet
    them, in that order.
    """
    check(cfg)
    parallel = cfg.parallel
    layout = _layout(cfg, world_size)
    check_pipeline(cfg, batch_plan(cfg.train, layout.dp).accumulation)
    if parallel.pp == 1 and parallel.pipeline_layers is not None:
        # check_pipeline looks at the split only with a pipeline; one stage still cuts by it.
        try:
            split_layers(cfg.model.n_layer, parallel.pp * parallel.vpp, parallel.pipeline_layers)
        except ValueError as err:
            raise UserError(str(err)) from None
    schedule = parallel.schedule if parallel.pp > 1 else "1f1b"
    resolve_compile(cfg.model.compile, torch.device("cpu"), schedule)


def check_vocab(cfg: Config, manifest: Manifest) -> int:
    """Return the vocabulary the model is built with; a UserError when it is smaller than the
    prepared data's tokenizer's."""
    vocab = cfg.model.vocab_size or manifest.vocab_size
    if vocab < manifest.vocab_size:
        raise UserError(
            f"model.vocab_size {vocab} is smaller than the data's tokenizer ({manifest.vocab_size})"
        )
    return vocab


def check_against_data(cfg: Config, manifest: Manifest, dp: int, blend: Blend | None = None) -> int:
    """Return the model's vocabulary; a UserError for what the prepared data cannot give this
    run: the vocabulary (:func:`check_vocab`), or a train split without one global micro-batch
    (as the reader refuses it). A blend (``manifest`` its first source's) needs a sample of
    every source: its stream never ends."""
    vocab = check_vocab(cfg, manifest)
    if blend is not None:
        blend.check(cfg.model.seq_len)
        return vocab
    samples = _samples(manifest.n_tokens("train"), cfg.model.seq_len)
    plan = batch_plan(cfg.train, dp)
    micro_steps_per_epoch(samples, "train", cfg.model.seq_len, plan, TRAIN_ADVICE)
    return vocab


@overload
def check_job(
    cfg: Config, world_size: int, manifest: Manifest, blend: Blend | None = None
) -> int: ...
@overload
def check_job(cfg: Config, world_size: int, manifest: None, blend: None = None) -> None: ...
def check_job(
    cfg: Config, world_size: int, manifest: Manifest | None, blend: Blend | None = None
) -> int | None:
    """Raise a UserError (one line) for the first thing that keeps ``cfg`` from training on
    ``world_size`` ranks, touching nothing: :func:`preflight`, then, given the prepared data's
    manifest (a blend's first source's, with the ``blend``), :func:`check_against_data`.
    Return the model's vocabulary (None without data).

    The trainer and ``hpcllm train --print-config`` both call it, so the printed config has
    passed the checks the run would make before it starts.
    """
    preflight(cfg, world_size)
    if manifest is None:
        return None
    return check_against_data(cfg, manifest, _layout(cfg, world_size).dp, blend)


def startup_warnings(
    cfg: Config,
    *,
    world_size: int,
    device_type: str,
    cpu_has_bf16: bool,
    train_tokens: int | None,
    val_tokens: int | None,
) -> list[str]:
    """Return one line for each setting of a preflighted ``cfg`` that runs but wastes the run.

    ``device_type`` is the ranks' torch device type (``cpu``, ``cuda``); ``cpu_has_bf16``
    is :func:`cpu_has_native_bf16`; ``train_tokens``/``val_tokens`` are the prepared
    splits' token counts (``Manifest.n_tokens``), None where unknown. Errors stay errors
    elsewhere: a split smaller than one global micro-batch is refused by the data reader,
    and a missing validation split is reported by the trainer.
    """
    m, train = cfg.model, cfg.train
    layout = _layout(cfg, world_size)
    plan = batch_plan(train, layout.dp)
    accumulation, micro_step, global_batch = plan.accumulation, plan.micro_step, plan.global_batch
    warnings = []
    if device_type == "cpu" and train.precision == "fp16":
        warnings.append(
            "train.precision fp16 on a CPU: torch emulates fp16 arithmetic there, far slower "
            "than fp32; use fp32 (or bf16 on a CPU with AVX512-BF16 or AMX)"
        )
    if device_type == "cpu" and train.precision == "bf16" and not cpu_has_bf16:
        warnings.append(
            "train.precision bf16 on a CPU without native bf16 arithmetic (no avx512_bf16 or "
            "amx_bf16 in /proc/cpuinfo): emulated, up to 20x slower than fp32; use fp32"
        )
    if layout.pp > 1 and accumulation < layout.pp:
        warnings.append(
            f"{accumulation} micro-batch(es) per step for {layout.pp} pipeline stages: most "
            f"of each step is pipeline bubble; use at least {layout.pp} (train."
            f"global_batch_size {micro_step * layout.pp} = micro_batch_size x d x pp)"
        )
    if m.compile_mode != "default":
        if compiled_how(cfg, torch.device(device_type), world_size) == "none":
            warnings.append(
                f"model.compile_mode {m.compile_mode} does nothing here: model.compile "
                f"{m.compile} compiles nothing on {device_type}"
            )
    if train_tokens is not None:
        samples = _samples(train_tokens, m.seq_len)
        wanted = train.steps * global_batch
        if samples >= micro_step and samples < wanted:
            warnings.append(
                f"the train split holds {samples} samples of {m.seq_len} tokens; "
                f"train.steps {train.steps} x global batch {global_batch} reads {wanted}, "
                f"{wanted / samples:.1f} times over"
            )
    if val_tokens:
        batches = _samples(val_tokens, m.seq_len) // micro_step
        if 0 < batches < train.eval_iters:
            warnings.append(
                f"the validation split holds {batches} global micro-batch(es) of "
                f"{micro_step} samples, fewer than train.eval_iters {train.eval_iters}; "
                f"each evaluation reads those {batches}"
            )
    return warnings


def _samples(tokens: int, seq_len: int) -> int:
    """Return the samples a split of ``tokens`` gives (as ``ShardDataset`` counts them)."""
    return max(0, (tokens - 1) // seq_len)
