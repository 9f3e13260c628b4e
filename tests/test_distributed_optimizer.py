"""The distributed optimizer (ZeRO-1): the same training as the plain engines, 1/d of the state.

Parameter-level equivalence after 3 AdamW steps at d = 2 and 4, with and without accumulation,
is in tests/test_data_parallel.py (``ddp+zero``, ``horovod+zero``); here the trainer end to end.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from mpirun import python, run_mpi
from test_train import SMALL

from hpcllm.config import load_config
from hpcllm.errors import UserError
from hpcllm.model.gpt import GPT
from hpcllm.observe import read_metrics
from hpcllm.parallel.data_parallel import build_engine
from hpcllm.parallel.distributed_optimizer import TorchCollectives, ZeroState, merge_shards
from hpcllm.train.optim import build_optimizer


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from hpcllm.datasets.prepare import PrepareOptions, prepare

    out = tmp_path_factory.mktemp("data") / "stdlib"
    prepare(PrepareOptions(out=out, corpus="python-stdlib", tokenizer="byte"), progress=False)
    return out


def _train(ranks, data, run_dir, *extra, steps=4):
    args = ["-m", "hpcllm", "train", "--no-progress"]
    for item in [
        *SMALL,
        "model.n_layer=4",
        "train.micro_batch_size=2",
        "train.global_batch_size=16",
        f"train.steps={steps}",
        "train.eval_interval=0",
        f"data.path={data}",
        f"run.dir={run_dir}",
        *extra,
    ]:
        args += ["--set", item]
    return run_mpi(ranks, python(*args), env={"HOROVOD_CPU_OPERATIONS": "MPI"}, timeout=300).check()


def _losses(run_dir):
    return torch.tensor([r["loss"] for r in read_metrics(run_dir)])


# -- one process: layout and state conversion ------------------------------------------------


def _zero(dp, rank, bucket_numel, model=None):
    model = model or GPT(load_config(None, SMALL).model, 100, seed=3)
    plain = build_optimizer(model, load_config(None, []).train, torch.device("cpu"))
    groups = [g["params"] for g in plain.param_groups]
    chunk_of = {id(p): 0 for p in model.parameters()}
    zero = ZeroState(
        groups,
        chunk_of,
        set(),
        dp,
        rank,
        bucket_numel,
        TorchCollectives(None),
        None,
        lambda p: False,
    )
    return model, plain, zero


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_the_plain_state_cut_into_parts_and_merged_is_the_plain_state(dp):
    model, plain, _ = _zero(1, 0, 10**9)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    plain.step()  # every parameter gets moments
    state = plain.state_dict()
    shards = []
    for rank in range(dp):
        _, own_plain, zero = _zero(dp, rank, 5000)  # several buckets, each padded to d
        parts = zero.own_state(state)
        assert len(parts["state"]) == len(zero.buckets)
        shards.append(zero.shard_state(parts))
        # Every element of this rank's parts is a parameter's (or zero padding).
        for bucket in zero.buckets:
            assert (
                bucket.size % dp == 0 and bucket.size - sum(p.numel() for p in bucket.params) < dp
            )
    merged = merge_shards(shards)
    assert merged["param_groups"] == state["param_groups"]
    assert set(merged["state"]) == set(state["state"])
    for i, entry in state["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(merged["state"][i][name], entry[name]), (i, name)


def test_parameters_become_views_of_their_bucket_with_their_values():
    model = GPT(load_config(None, SMALL).model, 100, seed=3)
    before = {id(p): p.detach().clone() for p in model.parameters()}
    _, _, zero = _zero(2, 1, 3000, model)
    assert len(zero.buckets) > 2
    for bucket in zero.buckets:
        for p, off in zip(bucket.params, bucket.offsets, strict=True):
            assert p.data_ptr() == bucket.data[off:].data_ptr()
            assert p.grad.data_ptr() == bucket.grad[off:].data_ptr()
            assert torch.equal(p, before[id(p)])
    # This rank's parts are the second half of each bucket, in the optimizer's slot order.
    for bucket in zero.buckets:
        part = zero.parts[bucket.slot]
        assert part.data_ptr() == bucket.data[bucket.size // 2 :].data_ptr()


def test_engines_that_cannot_run_it_say_so_in_one_line():
    grid = SimpleNamespace(dp=2, dp_comm=None)
    parallel = load_config(None, ["parallel.distributed_optimizer=true"]).parallel
    with pytest.raises(UserError, match="applies to the ddp and horovod engines"):
        build_engine("ps", grid, parallel)
    parallel.dp_compression = "fp16"
    with pytest.raises(UserError, match="set parallel.dp_compression: none"):
        build_engine("ddp", grid, parallel)


# -- under mpirun: the trainer -----------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("ranks", "layout", "engine"),
    [
        (2, [], "ddp"),
        (2, [], "horovod"),
        (4, ["parallel.tp=2", "parallel.sequence_parallel=true"], "ddp"),
        (4, ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved"], "horovod"),
        (4, ["parallel.pp=2", "parallel.schedule=zb-h1", "model.recompute=full"], "ddp"),
    ],
)
def test_trainer_logs_the_losses_of_the_plain_engine(data, tmp_path, ranks, layout, engine):
    common = [*layout, f"parallel.dp_engine={engine}"]
    _train(ranks, data, tmp_path / "plain", *common)
    run = _train(ranks, data, tmp_path / "zero", *common, "parallel.distributed_optimizer=true")
    assert "distributed optimizer (ZeRO-1)" in run.stdout
    torch.testing.assert_close(
        _losses(tmp_path / "zero"), _losses(tmp_path / "plain"), rtol=1e-5, atol=0
    )


@pytest.mark.mpi
def test_a_run_resumed_at_another_d_logs_the_uninterrupted_losses(data, tmp_path):
    zero = ["parallel.distributed_optimizer=true", "train.save_interval=3"]
    _train(4, data, tmp_path / "whole", *zero, steps=6)
    files = sorted(p.name for p in (tmp_path / "whole/checkpoints/step_00000003").iterdir())
    assert [f for f in files if f.startswith("optimizer_")] == [
        f"optimizer_tp00_pp00_dp{r:03d}.pt" for r in range(4)
    ]
    # The first half, then the rest at d = 2 from its step-3 checkpoint.
    _train(4, data, tmp_path / "halves", *zero, steps=3)
    _train(2, data, tmp_path / "halves", *zero, steps=6)
    torch.testing.assert_close(
        _losses(tmp_path / "halves"), _losses(tmp_path / "whole"), rtol=1e-5, atol=0
    )


@pytest.mark.mpi
def test_optimizer_state_per_rank_is_one_dth(data, tmp_path):
    state = {}
    for d in (1, 2, 4):
        run = _train(d, data, tmp_path / f"d{d}", "parallel.distributed_optimizer=true", steps=1)
        assert "memory per rank (the largest): weights" in run.stdout
        parts = read_metrics(tmp_path / f"d{d}")[-1]["memory_parts_mb"]
        state[d] = parts["optimizer"] * 1e6  # measured from the state after the step
    for d in (2, 4):
        # Each bucket pads to a multiple of d: at most d - 1 elements (8 bytes of moments
        # each) per bucket, plus one 4-byte step per bucket part.
        assert abs(state[d] - state[1] / d) <= 8 * (8 * (d - 1) + 4), (d, state)
    assert state[1] > 1e6


@pytest.mark.mpi
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(data, tmp_path):
    result = run_mpi(
        2,
        python(
            "tests/mpi_scripts/zero_fp16_overflow.py",
            str(data),
            str(tmp_path / "run"),
            json.dumps(SMALL),
        ),
        env={"HOROVOD_CPU_OPERATIONS": "MPI"},
        timeout=300,
    ).check()
    outs = [json.loads(result.rank_stdout[r].splitlines()[-1]) for r in range(2)]
    for out in outs:
        assert out["skipped_steps"] == 1 and out["step2_unchanged"] and out["moved_after"]
    assert outs[0]["scale"] == outs[1]["scale"] < 2.0**16
