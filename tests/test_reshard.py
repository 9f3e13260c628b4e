"""Checkpoints that outlive their layout: re-cut for any (t, p, v, d), read whole anywhere.

The mpirun cases resume a run at another layout and assert the losses the original layout
logged, each case run by one of the registered families in turn; the one-process cases check
the re-cut itself (round trips are exact), the parameter lists the re-cut derives against the
real chunks and optimizer, and the tools around it (generate and evaluate at a chosen step,
keep_checkpoints, the export's file modes).
"""

import json
import shutil

import pytest
import torch
from family_runs import cli, rotate, tiny, train, train_args
from mpirun import python, run_mpi

from hpcllm.config import load_config
from hpcllm.generate import load_run_model
from hpcllm.model.stages import build_chunks, chunks_state_dict
from hpcllm.observe import read_metrics
from hpcllm.train import checkpoint, reshard
from hpcllm.train.optim import build_optimizer
from hpcllm.train.trainer import Trainer

TINY = tiny("gpt2")


def _layout_args(layout: dict) -> list[str]:
    return [f"parallel.{k}={v}" for k, v in layout.items()]


def _logged(run) -> dict[int, float]:
    """Return each logged step's training loss."""
    return {r["step"]: r["loss"] for r in read_metrics(run)}


def _keep_only(run, step: int) -> None:
    """Drop every checkpoint but ``step``'s and the metrics after it: the run as it was then."""
    for folder in checkpoint.checkpoints(run):
        if checkpoint.step_of(folder) != step:
            shutil.rmtree(folder)
    (run / "checkpoints" / "latest").write_text(f"step_{step:08d}\n")


# (ranks, layout) before and after; d follows from the ranks. "convert" re-cuts a copy with
# hpcllm convert instead of run.reshard on resume. The registered families take the cases in
# turn (family_runs.rotate), so that each is re-cut both ways.
TRANSITIONS = {
    "t2-to-t1": ((2, {"tp": 2}), (2, {"tp": 1}), "reshard"),
    "p2-to-p1": ((2, {"pp": 2}), (2, {"pp": 1}), "reshard"),
    "p1-to-p2": ((2, {"pp": 1}), (2, {"pp": 2}), "convert"),
    "v2-to-1f1b": (
        (2, {"pp": 2, "vpp": 2, "schedule": "interleaved"}),
        (2, {"pp": 2, "vpp": 1, "schedule": "1f1b"}),
        "convert",
    ),
    "t2p2-to-t1p4": ((4, {"tp": 2, "pp": 2}), (4, {"tp": 1, "pp": 4}), "reshard"),
    "t2p2-to-t2-sp": (
        (4, {"tp": 2, "pp": 2}),
        (2, {"tp": 2, "sequence_parallel": "true"}),
        "reshard",
    ),
}


@pytest.mark.mpi
@pytest.mark.parametrize(("case", "arch"), rotate(TRANSITIONS))
def test_a_run_resumed_at_another_layout_logs_the_original_losses(case, arch, stdlib, tmp_path):
    (np_a, before), (np_b, after), how = TRANSITIONS[case]
    original = tmp_path / "original"
    sets = [*tiny(arch), "train.steps=5"]
    train(np_a, stdlib, original, *sets, "train.save_interval=2", *_layout_args(before)).check()
    losses = _logged(original)
    assert sorted(losses) == [1, 2, 3, 4, 5]
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    _keep_only(copy, 2)
    if how == "convert":
        args = [f"--{k}={v}" for k, v in after.items()]
        cli("convert", "--checkpoint", str(copy), "--out", str(tmp_path / "b"), *args, check=True)
        resumed_run, extra = tmp_path / "b", []
    else:
        resumed_run, extra = copy, ["run.reshard=true"]
    train(np_b, stdlib, resumed_run, *sets, *extra, *_layout_args(after)).check()
    resumed = _logged(resumed_run)
    saved = json.loads((resumed_run / "checkpoints" / "step_00000005" / "meta.json").read_text())
    assert (saved["tp"], saved["pp"]) == (after.get("tp", 1), after.get("pp", 1))
    for step in (3, 4, 5):  # weights, Adam moments, step count, LR and data position carried
        assert resumed[step] == pytest.approx(losses[step], rel=1e-5), (case, arch, step)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,layout", [(2, {"pp": 2}), (4, {"tp": 2, "pp": 2})])
def test_hf_export_of_a_sharded_run_matches_its_distributed_forward(
    ranks, layout, stdlib, tmp_path
):
    import transformers

    from hpcllm.generate import load_run_model

    run = tmp_path / "run"
    train(ranks, stdlib, run, *TINY, "train.steps=2", *_layout_args(layout)).check()
    out = tmp_path / "logits.pt"
    run_mpi(ranks, python("tests/mpi_scripts/checkpoint_logits.py", str(run), str(out))).check()
    ours = torch.load(out)
    cli("convert", "--checkpoint", str(run), "--to-hf", str(tmp_path / "hf"), check=True)
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        logits = theirs(ours["tokens"]).logits
    rel = (logits - ours["logits"]).abs().max() / ours["logits"].abs().max()
    assert rel.item() <= 1e-5

    # Greedy generation of the merged checkpoint and of the export pick the same tokens.
    model, _ = load_run_model(run)
    prompt = ours["tokens"][:1, :8]
    mine = model.generate(prompt, 12, temperature=0)
    theirs.generation_config.eos_token_id = None  # no early stop: compare all 12 tokens
    hf = theirs.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert mine.tolist() == hf.tolist()


def test_parameter_lists_match_the_chunks_and_the_optimizer():
    cfg = load_config(None, TINY)
    for layout in (
        reshard.Cut(pp=1),
        reshard.Cut(pp=2),
        reshard.Cut(pp=2, vpp=2),
        reshard.Cut(pp=4),
        reshard.Cut(pp=3, pipeline_layers=(1, 2, 1)),
    ):
        for rank in range(layout.pp):
            chunks = build_chunks(
                cfg.model,
                300,
                p=layout.pp,
                rank=rank,
                v=layout.vpp,
                tp_group=None,
                seed=1,
                sequence_parallel=False,
                layers=layout.pipeline_layers,
            )
            params = reshard.rank_parameters(cfg.model, layout, rank)
            keys = [reshard._key(layout, c, p.name) for c, ps in enumerate(params) for p in ps]
            assert keys == list(chunks_state_dict(chunks, layout.pp)), layout
            # The optimizer numbers its parameters group by group: that is its state's index.
            optimizer = build_optimizer(chunks, cfg.train, torch.device("cpu"))
            numbered = [p for group in optimizer.param_groups for p in group["params"]]
            named = dict((chunks[0] if layout.pp == 1 else chunks).named_parameters())
            order = reshard.optimizer_order(params)
            assert len(order) == len(numbered)
            for (chunk, param), real in zip(order, numbered, strict=True):
                assert named[reshard._key(layout, chunk, param.name)] is real, param.name


@pytest.mark.slow
def test_recut_there_and_back_is_exact(stdlib, tmp_path):
    cfg = load_config(
        None,
        [*TINY, f"data.path={stdlib}", f"run.dir={tmp_path / 'run'}", "train.steps=2"],
    )
    with Trainer(cfg) as trainer:
        trainer.run(progress=False)
    there = tmp_path / "t2p2v2"
    back = tmp_path / "back"
    for source, out, args in (
        (tmp_path / "run", there, ["--tp", "2", "--pp", "2", "--vpp", "2", "--dp", "1"]),
        (there, back, ["--tp", "1", "--pp", "1"]),
    ):
        cli("convert", "--checkpoint", str(source), "--out", str(out), *args, check=True)
    step = "checkpoints/step_00000002"
    assert len(list((there / step).glob("model_tp*_pp*.pt"))) == 4
    shown = load_config(there / "config.yaml", []).parallel
    assert (shown.tp, shown.pp, shown.vpp, shown.schedule) == (2, 2, 2, "interleaved")
    a = checkpoint.load_shard(tmp_path / "run" / step, 0, 0, 1, 1)
    b = checkpoint.load_shard(back / step, 0, 0, 1, 1)
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    for index, state in a["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][index][key]), (index, key)
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])
    # The tp stream is each tp rank's own: rank 0 continues the saved one, rank 1 (which the
    # t = 1 run had not) keeps its fresh seed rather than sharing rank 0's.
    tp0, tp1 = (checkpoint.load_shard(there / step, r, 0, 2, 2)["rng"] for r in (0, 1))
    assert torch.equal(tp0["tp_stream"]["torch"], a["rng"]["tp_stream"]["torch"])
    assert "tp_stream" not in tp1
    assert torch.equal(tp0["torch"], tp1["torch"])  # the default stream: the same on both
    meta_a, meta_b = (
        checkpoint.read_meta(tmp_path / "run" / step),
        checkpoint.read_meta(back / step),
    )
    for key in ("step", "consumed_samples", "global_batch", "vocab_size"):
        assert meta_a[key] == meta_b[key], key


@pytest.mark.slow
def test_resume_at_another_layout_without_reshard_is_one_line(stdlib, tmp_path):
    run = tmp_path / "run"
    cfg = load_config(None, [*TINY, f"data.path={stdlib}", f"run.dir={run}", "train.steps=1"])
    with Trainer(cfg) as trainer:
        trainer.run(progress=False)
    cli("convert", "--checkpoint", str(run), "--out", str(tmp_path / "p2"), "--pp", "2", check=True)
    args = train_args(stdlib, tmp_path / "p2", *TINY, "train.steps=2")
    refused = cli(*args)  # one process, pp = 1: the checkpoint has pp = 2
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "run.reshard=true" in lines[0] and "tp=1, pp=2" in lines[0]
    resumed = cli(*args, "--set", "run.reshard=true")
    assert resumed.returncode == 0, resumed.stderr
    assert "re-cut from tp=1, pp=2" in resumed.stdout + resumed.stderr


@pytest.fixture(scope="module")
def one_step_run(stdlib, tmp_path_factory):
    """A one-step tiny run (t = p = 1), trained once for the tests that only read it."""
    run = tmp_path_factory.mktemp("one-step") / "run"
    cfg = load_config(None, [*TINY, f"data.path={stdlib}", f"run.dir={run}", "train.steps=1"])
    with Trainer(cfg) as trainer:
        trainer.run(progress=False)
    return run


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,message",
    [
        (["--tp", "3"], "not divisible by --tp 3"),
        (["--vpp", "2"], "--vpp 2 needs a pipeline"),
        (["--pp", "8"], "fewer than the 8 pipeline stages"),
        (["--dp", "3"], "not a multiple of micro_batch_size x --dp = 2 x 3"),
        (["--tp", "2", "--step", "7"], "no checkpoint of step 7"),
        ([], "say what to convert"),
        (["--pp", "2", "--schedule", "interleaved"], "interleaved needs parallel.vpp >= 2"),
        (["--pp", "2", "--vpp", "2", "--schedule", "1f1b"], "needs parallel.schedule: inter"),
    ],
)
def test_convert_refuses_bad_layouts_in_one_line(args, message, one_step_run, tmp_path, capfd):
    command = ["convert", "--checkpoint", str(one_step_run), "--out", str(tmp_path / "x"), *args]
    if args == ["--tp", "3"]:  # one case as a user types it, in its own process
        done = cli(*command)
        code, stderr = done.returncode, done.stderr
    else:  # the same entry point in this process, without a second interpreter's start-up
        from hpcllm.cli import main

        code, stderr = main(command), capfd.readouterr().err
    assert code == 2
    assert message in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_keep_checkpoints_generate_step_and_evaluate(stdlib, tmp_path):
    run = tmp_path / "run"
    cfg = load_config(
        None,
        [
            *TINY,
            f"data.path={stdlib}",
            f"run.dir={run}",
            "train.steps=4",
            "train.save_interval=1",
            "train.eval_interval=4",
            "train.eval_iters=3",
            "run.keep_checkpoints=2",
        ],
    )
    with Trainer(cfg) as trainer:
        trainer.run(progress=False)
    assert [checkpoint.step_of(f) for f in checkpoint.checkpoints(run)] == [4, 3]
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]

    # The logged validation loss, read back by evaluate from the same micro-batches.
    logged = [r["val_loss"] for r in read_metrics(run) if r.get("val_loss") is not None]
    done = cli(
        "evaluate", "--checkpoint", str(run), "--data", str(stdlib), "--iters", "3", "--json",
        check=True,
    )  # fmt: skip
    result = json.loads(done.stdout)
    assert result["loss"] == pytest.approx(logged[-1], rel=1e-5)
    assert result["perplexity"] == pytest.approx(2.718281828 ** result["loss"], rel=1e-9)
    assert result["samples"] == 3 * 2

    for step in (3, 4):  # the chosen checkpoint's weights, not the newest's
        model, _ = load_run_model(run, step=step)
        saved = checkpoint.load_shard(run / "checkpoints" / f"step_{step:08d}", 0, 0, 1, 1)
        assert torch.equal(
            model.blocks["0"].mlp.fc.weight, saved["model"]["blocks.0.mlp.fc.weight"]
        )
    greedy = ["generate", "--checkpoint", str(run), "--prompt", "def ", "--temperature", "0"]
    at_3 = cli(*greedy, "--step", "3", "--tokens", "5")
    assert at_3.returncode == 0 and at_3.stdout.startswith("def "), at_3.stderr
    gone = cli(*greedy, "--step", "2")
    assert gone.returncode == 2 and "has steps 3, 4" in gone.stderr


def test_prune_keeps_everything_while_the_newest_does_not_verify(stdlib, tmp_path):
    run = tmp_path / "run"
    cfg = load_config(
        None,
        [*TINY, f"data.path={stdlib}", f"run.dir={run}", "train.steps=3", "train.save_interval=1"],
    )
    with Trainer(cfg) as trainer:
        trainer.run(progress=False)
    newest = checkpoint.checkpoints(run)[0]
    shard = newest / "model_tp00_pp00.pt"
    shard.write_bytes(shard.read_bytes()[:-10])
    warnings: list[str] = []
    assert checkpoint.prune(newest, 1, warnings.append) == []
    assert len(checkpoint.checkpoints(run)) == 3 and "does not verify" in warnings[0]


@pytest.mark.slow
@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o027, 0o640)])
def test_exports_take_the_users_umask(mask, mode, one_step_run, tmp_path):
    run = one_step_run
    hf, recut = tmp_path / "hf", tmp_path / "t2"
    for args in (["--to-hf", str(hf)], ["--out", str(recut), "--tp", "2"]):
        cli("convert", "--checkpoint", str(run), *args, umask=mask, check=True)
    files = [p for p in [*hf.rglob("*"), *recut.rglob("*")] if p.is_file()]
    assert files and {oct(p.stat().st_mode & 0o777) for p in files} == {oct(mode)}


def test_only_the_rank_that_starts_where_a_saved_stage_started_continues_its_streams(tmp_path):
    from hpcllm.config import Config

    cfg = Config()
    cfg.model.preset, cfg.model.n_layer = None, 4
    cfg.model.n_head, cfg.model.d_model, cfg.model.seq_len = 4, 64, 32
    cfg.parallel.pp = 2
    folder = tmp_path / "step_00000001"
    folder.mkdir()
    cfg.dump(folder / "config.yaml")
    (folder / "meta.json").write_text('{"step": 1, "tp": 1, "pp": 2, "vocab_size": 300}')
    saved = reshard.SavedState(folder)
    # p 2 -> 4: new ranks 0 and 2 start where saved stages 0 and 1 started; 1 and 3 split them.
    four = [saved.rng_source(reshard.Cut(pp=4), r) for r in range(4)]
    assert four == [0, None, 1, None]
    assert saved.rng_source(reshard.Cut(pp=1), 0) == 0
    interleaved = reshard.Cut(pp=2, vpp=2)  # rank 1's first stage is stage 1: block 1
    assert [saved.rng_source(interleaved, r) for r in range(2)] == [0, None]
    # Saved interleaved (p 2, v 2: rank 0 holds blocks 0 and 2, rank 1 blocks 1 and 3), cut
    # to p 4: new ranks 0 and 1 start where saved ranks 0 and 1 started; 2 and 3 start at
    # their second chunks and must not take their streams (rank 0's would be drawn twice).
    (folder / "meta.json").write_text('{"step": 1, "tp": 1, "pp": 2, "vpp": 2, "vocab_size": 300}')
    cfg.parallel.vpp, cfg.parallel.schedule = 2, "interleaved"
    cfg.dump(folder / "config.yaml")
    saved = reshard.SavedState(folder)
    assert [saved.rng_source(reshard.Cut(pp=4), r) for r in range(4)] == [0, 1, None, None]
