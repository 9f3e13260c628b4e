"""A step with a non-finite loss or gradient is skipped and counted; too many in a row stop the
run with one line, the weights and the newest checkpoint still finite."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from family_runs import SMALLEST

from hpcllm.config import load_config
from hpcllm.errors import UserError
from hpcllm.observe import read_metrics
from hpcllm.train import checkpoint
from hpcllm.train.trainer import Trainer

SMALL = [
    *SMALLEST,
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.log_interval=1",
    "train.eval_interval=0",
    "train.save_interval=1",
    "train.warmup_steps=0",
    "train.grad_clip=0",
    "run.tensorboard=false",
]


@pytest.mark.parametrize(
    "precision,engine",
    [("fp32", "ddp"), ("bf16", "ddp"), ("fp16", "ddp"), ("fp32", "ps-async")],
)
def test_a_diverging_run_skips_bad_steps_then_stops_with_its_weights_finite(
    stdlib: Path, tmp_path: Path, precision: str, engine: str
) -> None:
    cfg = load_config(
        None,
        [
            *SMALL,
            f"data.path={stdlib}",
            f"run.dir={tmp_path}",
            "train.steps=40",
            "train.lr=1e9",  # the first update blows the weights up; the loss goes non-finite
            "train.max_bad_steps=3",
            f"train.precision={precision}",
            f"parallel.dp_engine={engine}",
        ],
    )
    with Trainer(cfg) as trainer:
        with pytest.raises(
            UserError, match=r"training diverged: the last 3 steps \(to step"
        ) as error:
            trainer.run(progress=False)
        assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
        stopped = trainer.step
    records = read_metrics(tmp_path)
    assert [r["skipped"] for r in records[-3:]] == [True, True, True]
    assert records[-1]["skipped_steps"] >= 3 and records[-1]["step"] == stopped
    # Checkpoints stop before the streak reaches the limit: the newest is of weights that
    # no bad step changed, and finite.
    newest = checkpoint.latest(tmp_path)
    assert int(newest.name.split("_")[1]) < stopped
    shard = checkpoint.load_shard(newest, 0, 0, 1, 1)
    assert all(torch.isfinite(v).all() for v in shard["model"].values())
    # The message is true: it names the newest checkpoint (saved at every step here, some
    # during the streak), and it advises bf16 only to an fp16 run.
    message = str(error.value)
    named = re.search(r"checkpoint(?: of step| is of step) (\d+)", message)
    assert named and int(named.group(1)) == checkpoint.step_of(newest), message
    assert "no checkpoint was written" not in message
    assert ("bf16 instead of fp16" in message) == (precision == "fp16")
