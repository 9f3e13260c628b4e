"""The distributed optimizer (ZeRO-1): the same training as the plain engines, 1/d of the state.

Parameter-level equivalence after 3 AdamW steps at d = 2 and 4, with and without accumulation,
is in tests/test_data_parallel.py (``ddp+zero``, ``horovod+zero``); here the trainer end to end.
"""

from __future__ import annotations

import json

import pytest
import torch
from family_runs import HOROVOD_OVER_MPI, SMALL, train
from mpirun import python, run_mpi
from overflow_record import check_or_record
from torch import nn

from hpcllm.config import load_config
from hpcllm.errors import UserError
from hpcllm.model.gpt import GPT
from hpcllm.observe import read_metrics
from hpcllm.parallel.data.distributed_optimizer import (
    Collectives,
    ExpertCut,
    TorchCollectives,
    ZeroState,
)
from hpcllm.parallel.data.optimizer_parts import merge_shards
from hpcllm.parallel.roles import TensorRole
from hpcllm.train import checkpoint
from hpcllm.train.optim import build_optimizer


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from hpcllm.datasets.prepare import PrepareOptions, prepare

    out = tmp_path_factory.mktemp("data") / "stdlib"
    prepare(PrepareOptions(out=out, corpus="python-stdlib", tokenizer="byte"), progress=False)
    return out


def _train(ranks, data, run_dir, *extra, steps=4):
    sets = [*SMALL, "model.n_layer=4", "train.micro_batch_size=2", "train.global_batch_size=16"]
    return train(
        ranks, data, run_dir, *sets, f"train.steps={steps}", "train.eval_interval=0", *extra
    ).check()


def _losses(run_dir):
    return torch.tensor([r["loss"] for r in read_metrics(run_dir)])


# -- one process: layout and state conversion ------------------------------------------------


def _zero(dp, rank, bucket_numel, model=None, dtype=torch.float32):
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
        dtype,
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
    assert "master_weight" not in merged["state"][0]  # fp32 weights are their own masters
    assert set(merged["state"]) == set(state["state"])
    for i, entry in state["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(merged["state"][i][name], entry[name]), (i, name)


def test_bf16_weights_keep_exact_fp32_masters_that_round_trip_through_checkpoints():
    shards, zeros = [], []
    for rank in range(2):
        copy = GPT(load_config(None, SMALL).model, 100, seed=3)
        _, plain, zero = _zero(2, rank, 5000, copy, torch.bfloat16)
        zeros.append(zero)
        for p in copy.parameters():
            assert p.dtype == torch.bfloat16
        # The masters start from the fp32 values the model was built with, not the bf16 ones.
        for bucket in zero.buckets:
            master = zero.masters[bucket.slot]
            assert master.dtype == torch.float32
            mine = bucket.part(2, rank)
            assert torch.equal(master.to(torch.bfloat16), bucket.data[mine])
        adam = torch.optim.AdamW(
            [{"params": zero.group_parts(g)} for g in range(len(plain.param_groups))]
        )
        for part in zero.parts:
            part.grad = torch.randn_like(part)
        adam.step()
        shards.append(zero.shard_state(adam.state_dict()))
    merged = merge_shards(shards)
    flat = zeros[0].flat_params
    originals = [p for p in GPT(load_config(None, SMALL).model, 100, seed=3).parameters()]
    assert len(originals) == len(flat)
    for i, entry in merged["state"].items():
        assert entry["master_weight"].dtype == torch.float32
        assert entry["master_weight"].shape == flat[i].shape
    # Cut back into a fresh rank-1 state: its masters are the saved ones, bit for bit.
    copy = GPT(load_config(None, SMALL).model, 100, seed=3)
    _, _, fresh = _zero(2, 1, 5000, copy, torch.bfloat16)
    own = fresh.own_state(merged)
    assert all("master_weight" not in e for e in own["state"].values())
    for slot, master in fresh.masters.items():
        assert torch.equal(master, shards[1]["state"][slot]["master_weight"])


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


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["parallel.dp_engine=ps"], "applies to the ddp and horovod engines"),
        (["parallel.dp_compression=fp16"], "set parallel.dp_compression: none"),
        (["train.param_dtype=bf16"], r"set train.precision: bf16 \(not fp32\)"),
    ],
)
def test_what_cannot_run_it_says_so_in_one_line(sets, message):
    with pytest.raises(UserError, match=message):
        load_config(None, ["parallel.distributed_optimizer=true", *sets])


def test_bf16_weights_need_the_distributed_optimizer():
    with pytest.raises(UserError, match="set parallel.distributed_optimizer: true"):
        load_config(None, ["train.param_dtype=bf16", "train.precision=bf16"])
    cfg = load_config(
        None,
        ["train.param_dtype=bf16", "train.precision=bf16", "parallel.distributed_optimizer=true"],
    )
    assert cfg.train.param_dtype == "bf16"


# -- under mpirun: the trainer -----------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("ranks", "layout", "engine"),
    [
        (4, ["parallel.tp=2", "parallel.sequence_parallel=true"], "ddp"),
        (4, ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved"], "horovod"),
        (4, ["parallel.pp=2", "parallel.schedule=zb-h1", "model.recompute=full"], "ddp"),
    ],
)
def test_trainer_logs_the_losses_of_the_plain_engine(data, tmp_path, ranks, layout, engine):
    # (d = 2 alone, with each engine, is tests/test_data_parallel.py's, parameter by parameter.)
    common = [*layout, f"parallel.dp_engine={engine}"]
    _train(ranks, data, tmp_path / "plain", *common, "train.save_interval=1", steps=3)
    run = _train(
        ranks, data, tmp_path / "zero", *common, "parallel.distributed_optimizer=true", steps=3
    )
    assert "distributed optimizer (ZeRO-1)" in run.stdout
    torch.testing.assert_close(
        _losses(tmp_path / "zero"), _losses(tmp_path / "plain"), rtol=1e-5, atol=0
    )
    # And the weights after the 3 AdamW steps, shard by shard: within the AdamW bound of
    # tests/test_data_parallel.py (distance over how far the steps moved them, 2e-4; here
    # over how far steps 2 and 3 moved them, a smaller yardstick).
    saved = checkpoint.checkpoints(tmp_path / "plain")  # newest first
    plain, after_one = _weights(saved[0]), _weights(saved[-1])
    zero = _weights(checkpoint.checkpoints(tmp_path / "zero")[0])
    assert plain.keys() == zero.keys()
    moved = _distance(plain, after_one)
    assert moved > 1e-3, "training did not move the weights"
    assert _distance(zero, plain) / moved <= 2e-4


def _weights(folder):
    """Return every (tp, pp) shard's weights of a checkpoint folder, by file and name."""
    return {
        (path.name, name): value.float()
        for path in sorted(folder.glob("model_tp*_pp*.pt"))
        for name, value in torch.load(path, weights_only=True)["model"].items()
    }


def _distance(a, b):
    return sum(((a[k] - b[k]).double() ** 2).sum() for k in b).sqrt().item()


@pytest.mark.mpi
def test_a_run_resumed_at_another_d_logs_the_uninterrupted_losses(data, tmp_path):
    zero = ["parallel.distributed_optimizer=true", "train.save_interval=2"]
    _train(4, data, tmp_path / "whole", *zero, steps=4)
    files = sorted(p.name for p in (tmp_path / "whole/checkpoints/step_00000002").iterdir())
    assert [f for f in files if f.startswith("optimizer_")] == [
        f"optimizer_tp00_pp00_dp{r:03d}.pt" for r in range(4)
    ]
    # The first half, then the rest at d = 2 from its step-2 checkpoint.
    _in_halves((4, 2), data, tmp_path / "halves", tmp_path / "whole", zero, rtol=1e-5)


def _in_halves(ranks, data, run_dir, whole, sets, rtol):
    """Train 2 steps on ranks[0] ranks, then on to 4 on ranks[1] (resumed from the step-2
    checkpoint), and check the losses against the uninterrupted run in ``whole``."""
    _train(ranks[0], data, run_dir, *sets, steps=2)
    _train(ranks[1], data, run_dir, *sets, steps=4)
    torch.testing.assert_close(_losses(run_dir), _losses(whole), rtol=rtol, atol=0)


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
def test_bf16_weights_track_fp32_weights_and_resume_exactly(data, tmp_path):
    bf16 = ["parallel.distributed_optimizer=true", "train.precision=bf16"]
    _train(2, data, tmp_path / "fp32", *bf16, "train.param_dtype=fp32", steps=4)
    whole = [*bf16, "train.param_dtype=bf16", "train.save_interval=2"]
    run = _train(2, data, tmp_path / "bf16", *whole, steps=4)
    assert "bf16 weights and gradients, fp32 masters and moments" in run.stdout
    # Measured: within 4e-4 of the fp32 weights' losses over 6 steps (docs/data-parallel.md).
    # (4 steps here.)
    torch.testing.assert_close(
        _losses(tmp_path / "bf16"), _losses(tmp_path / "fp32"), rtol=1e-3, atol=0
    )
    # Half the weight and gradient bytes; 12 bytes of optimizer state per parameter for 8.
    mine = read_metrics(tmp_path / "bf16")[-1]["memory_parts_mb"]
    theirs = read_metrics(tmp_path / "fp32")[-1]["memory_parts_mb"]
    assert mine["weights"] == pytest.approx(theirs["weights"] / 2, rel=1e-3)
    assert mine["gradients"] == pytest.approx(theirs["gradients"] / 2, rel=1e-3)
    assert mine["optimizer"] == pytest.approx(theirs["optimizer"] * 1.5, rel=1e-3)
    # The masters are saved: resuming from step 2 logs the uninterrupted losses exactly.
    _in_halves((2, 2), data, tmp_path / "halves", tmp_path / "bf16", whole, rtol=1e-6)
    # Under Horovod, which moves no bf16: the gradients averaged in fp32, the weights
    # gathered as their bits (once a traceback on the first reduce-scatter).
    _train(2, data, tmp_path / "horovod", *bf16, "train.param_dtype=bf16",
           "parallel.dp_engine=horovod", steps=4)  # fmt: skip
    torch.testing.assert_close(
        _losses(tmp_path / "horovod"), _losses(tmp_path / "bf16"), rtol=1e-3, atol=0
    )


@pytest.mark.mpi
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(data, tmp_path):
    result = run_mpi(
        2,
        python(
            "tests/mpi_scripts/fp16_overflow.py",
            "zero",
            str(data),
            str(tmp_path / "run"),
            json.dumps(SMALL),
        ),
        env=HOROVOD_OVER_MPI,
        timeout=300,
    ).check()
    outs = [json.loads(result.rank_stdout[r].splitlines()[-1]) for r in range(2)]
    for out in outs:
        assert out["skipped_steps"] == 1 and out["step2_unchanged"] and out["moved_after"]
    assert outs[0]["scale"] == outs[1]["scale"] < 2.0**16
    # Each step's gradient norm and skip, as logged before the optimizer took the step over.
    check_or_record("zero", tmp_path / "run")


class _Recorded(Collectives):
    """Collectives that record which group started which bucket's reduce-scatter."""

    def __init__(self, group: str, log: list) -> None:
        self.group, self.log = group, log

    def reduce_scatter(self, flat, part, dp, key):
        self.log.append((self.group, key))
        return None

    def all_gather(self, flat, part, key):
        return None

    def wait(self, work):
        pass


def _launch_order(experts_of_the_last_layer_get_tokens: bool) -> list:
    torch.manual_seed(0)
    dense0, dense3 = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8, 8))
    e1, e2 = nn.Parameter(torch.randn(2, 8, 8)), nn.Parameter(torch.randn(2, 8, 8))
    for e in (e1, e2):
        e.role = TensorRole(experts=2)
    params, log = [dense0, e1, dense3, e2], []
    cut = ExpertCut({id(e1), id(e2)}, 2, 0, 2, _Recorded("expert_dp", log), None)
    zero = ZeroState([params], {id(p): 0 for p in params}, set(), 4, 0, 64,
                     _Recorded("dp", log), None, lambda p: False, experts=cut)  # fmt: skip
    h = torch.randn(3, 8) @ dense0
    h = (h + h @ e1[0]) @ dense3
    if experts_of_the_last_layer_get_tokens:  # else (the experts' loop) e2 is never used
        h = h + h @ e2[1]
    zero.arm(0)
    h.sum().backward()
    zero.disarm(0)
    return log


def test_every_rank_starts_a_groups_reduce_scatters_in_one_order_whatever_gets_a_gradient():
    # Each tensor in its own bucket. A rank whose last MoE layer's experts got no token never
    # fires their hooks: its expert buckets once went out in another order than its peers'
    # (bucket 2 on one rank met bucket 3 on the other: gradients of other tensors summed).
    busy, idle = _launch_order(True), _launch_order(False)
    for group in ("dp", "expert_dp"):
        mine = [key for g, key in busy if g == group]
        assert mine == [key for g, key in idle if g == group] and len(mine) == 2, (busy, idle)
