import json
import math
import signal
import subprocess
import sys
import time

import pytest
import torch
from family_runs import HOROVOD_OVER_MPI, SMALL, train_args
from mpirun import REPO, python, run_mpi

from hpcllm.commands.train import STOPPED_EXIT
from hpcllm.config import load_config
from hpcllm.datasets.prepare import PrepareOptions, prepare
from hpcllm.generate import load_run_model
from hpcllm.observe import read_metrics
from hpcllm.train import checkpoint
from hpcllm.train.trainer import Trainer


@pytest.fixture(scope="module")
def stdlib(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "stdlib"
    prepare(PrepareOptions(out=out, corpus="python-stdlib", tokenizer="byte"), progress=False)
    return out


def _cfg(stdlib, run_dir, *extra):
    return load_config(None, [*SMALL, f"data.path={stdlib}", f"run.dir={run_dir}", *extra])


def test_loss_falls_on_the_stdlib_corpus(stdlib, tmp_path):
    trainer = Trainer(_cfg(stdlib, tmp_path / "run", "train.steps=40", "train.eval_interval=0"))
    summary = trainer.run(progress=False)
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert len(losses) == 40
    assert losses[0] == pytest.approx(math.log(257), abs=0.3)  # uniform over bytes + EOS
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5
    assert summary["val_loss"] < losses[0] - 1.5
    record = read_metrics(tmp_path / "run")[-1]
    for key in (
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "tflops_per_gpu",
        "mfu",
        "step_time_s",
        "memory_mb",
        "val_loss",
    ):
        assert key in record
    assert record["mfu"] is None  # CPU, no peak given
    assert (tmp_path / "run" / "config.yaml").is_file()
    assert checkpoint.latest(tmp_path / "run").name == "step_00000040"


def test_fp16_skips_a_step_with_an_inf_gradient_and_goes_on(stdlib, tmp_path):
    before = {}

    def hook(step, model, optimizer):
        before[step] = [p.detach().clone() for p in model.parameters()]
        if step == 2:
            next(model.parameters()).grad.view(-1)[0] = float("inf")

    cfg = _cfg(
        stdlib, tmp_path / "run", "train.steps=5", "train.precision=fp16", "train.eval_interval=0"
    )
    summary = Trainer(cfg, grad_hooks=[hook]).run(progress=False)
    assert summary["skipped_steps"] == 1
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert same(before[2], before[3]), "the step with the inf gradient changed the weights"
    assert not same(before[3], before[4]), "training did not go on after the skipped step"
    records = read_metrics(tmp_path / "run")
    assert [r["skipped"] for r in records] == [False, False, True, False, False]
    assert records[-1]["skipped_steps"] == 1 and math.isfinite(records[-1]["loss"])


@pytest.mark.mpi
@pytest.mark.parametrize("engine", ["ddp", "horovod", "ps"])
def test_resume_reproduces_the_uninterrupted_run(stdlib, tmp_path, engine):
    # Two ranks, two micro-batches each per step (global batch 16): accumulation, and the
    # optimizer state must survive the engine's wrapping (Horovod builds a new optimizer).
    # The three runs (8 steps; 4, then resumed to 8) share one launch.
    common = [
        *SMALL,
        "train.global_batch_size=16",
        "train.lr_decay_steps=8",
        "train.eval_interval=0",
        f"parallel.dp_engine={engine}",
    ]
    script = python(
        "tests/mpi_scripts/resume_in_one_launch.py", stdlib, tmp_path, "8", json.dumps(common)
    )
    result = run_mpi(2, script, env=HOROVOD_OVER_MPI, timeout=300).check()
    runs = json.loads(result.rank_stdout[0].splitlines()[-1])
    whole = {r["step"]: r for r in runs["whole"]}
    split = {r["step"]: r for r in runs["split"]}
    # Steps 1-4, then 5-8 from the checkpoint (a fresh start would log 1-8 again).
    assert [r["step"] for r in runs["split"]] == list(range(1, 9))
    for step in range(1, 9):
        assert split[step]["loss"] == whole[step]["loss"], step
        assert split[step]["grad_norm"] == whole[step]["grad_norm"], step
        assert split[step]["consumed_samples"] == 16 * step


def _wait_for_metrics(run_dir, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "training ended before the signal"
        path = run_dir / "metrics.jsonl"
        if path.exists() and path.read_text().count("\n") >= 2:
            return
        time.sleep(0.1)
    raise AssertionError("no metrics in time")


@pytest.mark.slow
@pytest.mark.parametrize("launcher, sig", [("single", signal.SIGTERM), ("mpirun", signal.SIGUSR1)])
def test_signal_saves_a_loadable_checkpoint_and_exits_75(stdlib, tmp_path, launcher, sig):
    run_dir = tmp_path / "run"
    args = train_args(stdlib, run_dir, *SMALL, "train.steps=100000", "train.eval_interval=0")
    cmd = [sys.executable, "-m", "hpcllm", *args]
    if launcher == "mpirun":
        from mpirun import mpi_env

        from hpcllm.launcher import mpirun_command

        cmd = mpirun_command(2, cmd)
        env = mpi_env()
    else:
        env = None
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_for_metrics(run_dir, proc)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == STOPPED_EXIT, err  # stopped, to be resumed: not finished
    assert f"stopped by {sig.name}" in out
    folder = checkpoint.latest(run_dir)
    meta = checkpoint.read_meta(folder)
    # Rank 0 says at once what the signal starts, and when the save is done, once each.
    said = err.splitlines()
    heard = f"hpcllm: {sig.name}: finishing the step in flight, then saving and stopping"
    assert said.count(heard) == 1, err
    done = [line for line in said if line.startswith(f"hpcllm: stopping at step {meta['step']}:")]
    assert len(done) == 1 and f"saved {folder}" in done[0], err
    assert said.index(heard) < said.index(done[0])
    assert 2 <= meta["step"] < 100000
    model, tokenizer = load_run_model(run_dir)
    assert tokenizer.vocab_size == 257 and model.cfg.n_layer == 2
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == meta["step"]


def test_convert_a_trained_run_to_hf_and_back(stdlib, tmp_path):
    import transformers

    from hpcllm.convert import from_hf, to_hf

    Trainer(_cfg(stdlib, tmp_path / "run", "train.steps=2", "train.eval_interval=0")).run(
        progress=False
    )
    to_hf(tmp_path / "run", tmp_path / "hf")
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ours, _ = load_run_model(tmp_path / "run")
    ids = torch.randint(0, 257, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)
    from_hf(tmp_path / "hf", tmp_path / "back")
    shard = checkpoint.load_shard(checkpoint.latest(tmp_path / "back"), 0, 0, 1, 1)
    for name, value in ours.state_dict().items():
        got = shard["model"][name]
        if name == "wte.weight":  # the padding rows are not exported; they come back as 0
            got, value = got[:257], value[:257]
        assert torch.equal(got, value), name


def test_resume_refuses_another_model_and_none_starts_over_aside(stdlib, tmp_path):
    from hpcllm.errors import UserError

    run = tmp_path / "run"
    with Trainer(_cfg(stdlib, run, "train.steps=2", "train.eval_interval=0")) as first:
        first.run(progress=False)
    with pytest.raises(UserError, match="holds another model .*d_model 64 vs 32"):
        Trainer(_cfg(stdlib, run, "train.steps=4", "model.d_model=32"))
    assert checkpoint.latest(run).name == "step_00000002"  # nothing was touched
    fresh = [
        "train.steps=1",
        "model.d_model=32",
        "run.resume=none",
        "train.eval_interval=0",
    ]
    with pytest.raises(UserError, match="holds checkpoints of an earlier run"):
        Trainer(_cfg(stdlib, run, *fresh))
    with Trainer(_cfg(stdlib, run, *fresh, "run.overwrite=true")) as trainer:
        assert trainer.step == 0 and checkpoint.latest(run) is None
        trainer.run(progress=False)
    assert checkpoint.latest(run).name == "step_00000001"
    (aside,) = tmp_path.glob("run.old-*")  # the earlier run, moved whole
    assert checkpoint.latest(aside).name == "step_00000002"


def test_validation_split_too_small_stops_before_training(tmp_path):
    from hpcllm.errors import UserError

    data = tmp_path / "data"
    (tmp_path / "src").mkdir()
    for i in range(40):
        (tmp_path / "src" / f"{i:02d}.txt").write_text(f"document {i} " * 200)
    prepare(
        PrepareOptions(
            out=data, inputs=(str(tmp_path / "src"),), tokenizer="byte", val_fraction=0.05
        ),
        progress=False,
    )
    with pytest.raises(UserError, match="fewer than one global micro-batch") as err:
        Trainer(_cfg(data, tmp_path / "run", "train.micro_batch_size=100"))
    assert str(err.value).endswith(
        "prepare the data with a larger --val-fraction, or train at a shorter model.seq_len or "
        "a smaller train.micro_batch_size"
    )
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_every_evaluation_reads_the_same_validation_batches(stdlib, tmp_path):
    trainer = Trainer(_cfg(stdlib, tmp_path / "run", "train.steps=1"))
    first = trainer.evaluate()
    assert trainer.evaluate() == first  # same weights, same batches


def test_the_trainer_hands_the_process_back_as_it_found_it(stdlib, tmp_path, monkeypatch):
    # Signal handlers, torch threads, the fused-kernel switch and the random states are the
    # trainer's while it lasts and the process's again after close().
    from hpcllm import kernels

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    handler = signal.getsignal(signal.SIGUSR1)
    torch.set_num_threads(1)
    torch.manual_seed(42)
    expected_draw = torch.rand(3)
    torch.manual_seed(42)
    trainer = Trainer(_cfg(stdlib, tmp_path / "run", "train.steps=1", "train.eval_interval=0"))
    assert signal.getsignal(signal.SIGUSR1) != handler
    trainer.train_step(iter(trainer.reader))
    with trainer:
        pass
    assert signal.getsignal(signal.SIGUSR1) == handler
    assert torch.get_num_threads() == 1
    assert kernels.enabled() is False
    assert torch.equal(torch.rand(3), expected_draw)
    trainer.close()  # a second close changes nothing
    assert signal.getsignal(signal.SIGUSR1) == handler
    with pytest.raises(RuntimeError, match="closed"):
        trainer.train_step(iter(trainer.reader))


def test_ps_async_segments_end_where_profiling_starts_and_stops(stdlib, tmp_path):
    # ps-async runs the steps between sync points as one segment: the profiler, which starts
    # and stops between segments, must get segments that end at train.profile_steps' bounds.
    from hpcllm.config import load_config
    from hpcllm.train.trainer import Trainer

    sets = [*SMALL, f"data.path={stdlib}", f"run.dir={tmp_path}", "train.steps=10"]
    sets += ["train.log_interval=10", "train.eval_interval=0", "parallel.dp_engine=ps-async"]
    with Trainer(load_config(None, [*sets, "train.profile_steps=3:5"])) as trainer:
        lengths = []
        while trainer.step < 10:
            lengths.append(trainer.next_sync_step() - trainer.step)
            trainer.state.step += lengths[-1]
        assert lengths == [3, 2, 5]
    with Trainer(load_config(None, sets)) as trainer:
        assert trainer.next_sync_step() == 10
