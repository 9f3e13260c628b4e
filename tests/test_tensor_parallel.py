import json

import pytest
from family_runs import SMALL, cli, train
from mpirun import python, run_mpi

pytestmark = pytest.mark.mpi


def _check_equivalence(result, ranks: int, tp: int, sp: bool) -> None:
    for rank in range(ranks):
        out = json.loads(result.rank_stdout[rank].splitlines()[-1])
        assert out["tp"] == tp and out["dp"] == ranks // tp and out["sp"] == sp
        # Sequence parallelism trades every activation all-reduce for a gather and a scatter.
        expected = {"all_gather", "reduce_scatter"} if sp else set()
        assert expected <= set(out["comm"]) and ("reduce_scatter" in out["comm"]) == sp
        # A vocabulary of 250 divides by no t: padded to 128·t, split in equal shards.
        assert out["padded_vocab"] == 128 * tp and out["vocab_rows"] == 128
        assert out["init"] == 0.0, "shards are not slices of the t = 1 weights"
        assert out["logits"] <= 1e-5
        assert out["loss"] <= 1e-5, "loss differs from the unpadded serial loss"
        assert out["grad"] <= 1e-5, out["grad_worst"]
        for serial, parallel in zip(out["serial_losses"], out["parallel_losses"], strict=True):
            assert parallel == pytest.approx(serial, rel=1e-5)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_gpt_equals_the_serial_gpt(tp, sp):
    args = ["sp"] if sp else []
    result = run_mpi(tp, python("tests/mpi_scripts/tp_equivalence.py", *args), timeout=300).check()
    _check_equivalence(result, tp, tp, sp)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("engine", ["ddp", "horovod"])
def test_t2_d2_gradients_through_each_engine_equal_the_serial_gpt(engine, sp):
    args = ["tp=2", f"engine={engine}"] + (["sp"] if sp else [])
    result = run_mpi(
        4,
        python("tests/mpi_scripts/tp_equivalence.py", *args),
        env={"HOROVOD_CPU_OPERATIONS": "MPI"},
        timeout=300,
    ).check()
    _check_equivalence(result, 4, 2, sp)


@pytest.mark.parametrize("tp", [2, 4])
def test_dropout_streams_communication_and_memory_at_t(tp):
    result = run_mpi(tp, python("tests/mpi_scripts/tp_internals.py"), timeout=300).check()
    b, s, h = 2, 32, 64  # the script's shape
    sbh = b * s * h * 4  # one fp32 activation of the residual stream
    for rank in range(tp):
        out = json.loads(result.rank_stdout[rank].splitlines()[-1])
        # Dropout outside tp regions is identical on every tp rank, inside it differs, and
        # the tp stream leaves the default one where it was.
        assert out["rng"] == {
            "outside_equal": True,
            "inside_differ": True,
            "default_undisturbed": True,
        }
        assert out["replicated_equal"] and out["replicated_dropped"]
        assert out["sp_masks_differ"]
        # Recomputation replays both streams: the same masks, so the same loss and grads.
        for variant in ("tp", "tp+sp"):
            assert out["recompute"][variant] == {"full": 0.0, "selective": 0.0}
        # Per block and micro-batch: two all-reduces of b·s·h forward and two backward.
        # Sequence parallelism makes each a reduce-scatter plus an all-gather, and gathers
        # each column-parallel layer's input once more in backward instead of storing it.
        assert out["comm"]["tp"] == {
            "all_reduce_forward": 2 * sbh,
            "all_reduce_backward": 2 * sbh,
            "all_gather_forward": 0,
            "all_gather_backward": 0,
            "reduce_scatter_forward": 0,
            "reduce_scatter_backward": 0,
        }
        assert out["comm"]["tp+sp"] == {
            "all_reduce_forward": 0,
            "all_reduce_backward": 0,
            "all_gather_forward": 2 * sbh,
            "all_gather_backward": 4 * sbh,
            "reduce_scatter_forward": 2 * sbh,
            "reduce_scatter_backward": 2 * sbh,
        }
        # Weights: each rank holds 1/t of the block, plus the small whole LayerNorms/biases.
        share = out["params"]["rank"] / out["params"]["serial"]
        assert 1 / tp <= share <= 1 / tp + 0.01, share
        # Sequence parallelism keeps 1/t of the LayerNorm/dropout regions' activations.
        saved = out["saved"]
        assert saved["tp+sp"]["region"] * tp == saved["tp"]["region"] > 0
        assert saved["tp+sp"]["total"] < saved["tp"]["total"]


# The t = 1 runs of the cases below, by (engine, d): the sp = False and sp = True cases of an
# engine compare with the same serial run, trained once.
_SERIAL: dict[tuple[str, int], list] = {}


@pytest.mark.parametrize(
    "engine, tp, sp",
    [
        ("ddp", 2, False),
        ("ddp", 2, True),
        ("horovod", 2, False),
        ("horovod", 2, True),
        ("ps", 2, False),
        ("ddp", 4, True),
    ],
)
def test_trainer_with_tp_logs_the_losses_of_t1(stdlib, tmp_path, engine, tp, sp):
    from hpcllm.observe import read_metrics

    def trained(np, run, *extra):
        sets = [*SMALL, "model.n_head=4", "train.steps=5", "train.global_batch_size=16"]
        sets += ["train.eval_interval=0", f"parallel.dp_engine={engine}", *extra]
        train(np, stdlib, run, *sets).check()
        return read_metrics(run)

    dp = 4 // tp
    if (engine, dp) not in _SERIAL:
        _SERIAL[engine, dp] = trained(dp, tmp_path / "t1")
    serial = _SERIAL[engine, dp]
    parallel = trained(
        4, tmp_path / "t2", f"parallel.tp={tp}", f"parallel.sequence_parallel={str(sp).lower()}"
    )
    assert [r["step"] for r in parallel] == [1, 2, 3, 4, 5]
    for a, b in zip(serial, parallel, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        # The global norm counts each tensor-parallel slice, and whole parameters once.
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    step = tmp_path / "t2" / "checkpoints" / "step_00000005"
    shards = sorted(p.name for p in step.glob("*.pt"))
    assert shards == [f"model_tp{r:02d}_pp00.pt" for r in range(tp)]


def test_convert_tp_resumes_where_the_original_run_would(stdlib, tmp_path):
    import torch

    from hpcllm.generate import load_run_model
    from hpcllm.observe import read_metrics

    def trained(np, run, steps, tp):
        sets = [*SMALL, "model.n_head=4", f"train.steps={steps}", "train.lr_decay_steps=6"]
        train(np, stdlib, run, *sets, "train.eval_interval=0", f"parallel.tp={tp}").check()
        return {r["step"]: r["loss"] for r in read_metrics(run)}

    trained(2, tmp_path / "t2", 3, 2)
    for tp in (1, 4):
        out = str(tmp_path / f"t{tp}")
        cli("convert", "--tp", str(tp), "--checkpoint", str(tmp_path / "t2"), "--out", out,
            timeout=120, check=True)  # fmt: skip
    model, _ = load_run_model(tmp_path / "t1")  # a tp = 1 checkpoint again
    assert model.wte.weight.shape[0] == 384  # 257 padded for t = 1, not for t = 2 (512)
    step = tmp_path / "t4" / "checkpoints" / "step_00000003"
    assert len(list(step.glob("model_tp*_pp00.pt"))) == 4
    # The four t = 4 shards merge back into the t = 2 run's model, weight for weight.
    merged, _ = load_run_model(tmp_path / "t4")
    source, _ = load_run_model(tmp_path / "t2")
    for (name, got), want in zip(
        merged.state_dict().items(), source.state_dict().values(), strict=True
    ):
        assert torch.equal(got, want), name
    original = trained(2, tmp_path / "t2", 6, 2)
    # The t = 4 copy was checked above, merged; resuming it too (4 ranks on this machine's
    # two cores) would add little to what t = 1 shows, and test_reshard resumes other re-cuts.
    converted = trained(1, tmp_path / "t1", 6, 1)
    assert sorted(converted) == [4, 5, 6]  # resumed at step 3: weights and Adam state
    for step in (4, 5, 6):
        assert converted[step] == pytest.approx(original[step], rel=1e-5)


def test_a_resume_with_tensor_parallel_dropout_logs_the_uninterrupted_losses(stdlib, tmp_path):
    # Dropout inside the tp regions draws from each tp rank's own stream: a checkpoint must
    # carry that stream too, or the resumed run draws other masks.
    script = python("tests/mpi_scripts/tp_dropout_resume.py", stdlib, tmp_path, json.dumps(SMALL))
    result = run_mpi(2, script, timeout=300).check()
    runs = json.loads(result.rank_stdout[0].splitlines()[-1])
    assert sorted(runs["split"]) == ["1", "2", "3"]
    assert runs["split"]["3"] == runs["whole"]["3"]  # loss and gradient norm, exactly
