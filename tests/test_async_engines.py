"""ps-async and local-sgd against one-process replays of the same algorithm (under mpirun)."""

import sys
from pathlib import Path

import pytest
import torch
from family_runs import HOROVOD_OVER_MPI, SMALL, cli, sets, train
from mpirun import python, run_mpi

sys.path.insert(0, str(Path(__file__).parent / "mpi_scripts"))
from async_equivalence import CLIP, rr_lr  # noqa: E402
from dp_equivalence import MICRO, VOCAB, global_batch, make_optimizer, model_config  # noqa: E402

from hpcllm.model.gpt import GPT  # noqa: E402

pytestmark = pytest.mark.mpi


def _run(tmp_path, dp, mode):
    run_mpi(
        dp,
        python("tests/mpi_scripts/async_equivalence.py", str(tmp_path), mode),
        env={"HOROVOD_CPU_OPERATIONS": "MPI", "PYTHONPATH": "tests/mpi_scripts"},
        timeout=300,
    ).check()


def _load(tmp_path, name, dp):
    """Return rank 0's file of ``name``, after checking every rank holds the same weights."""
    files = [torch.load(tmp_path / f"{name}-rank{r}.pt") for r in range(dp)]
    for other in files[1:]:
        for key, value in files[0]["weights"].items():
            assert torch.equal(other["weights"][key], value), (name, key)
    return files[0]


def _relative_error(got, expected):
    return max((got[n] - v).abs().max().item() / v.abs().max().item() for n, v in expected.items())


def _moved(got, expected, start):
    """||got - expected|| over how far training moved the weights (see test_data_parallel)."""

    def distance(a, b):
        return sum(((a[n] - b[n]).double() ** 2).sum() for n in b).sqrt().item()

    return distance(got, expected) / distance(expected, start)


def _mine(k, rank, d):
    ids, labels = global_batch(k, MICRO * d)
    return ids[rank * MICRO : (rank + 1) * MICRO], labels[rank * MICRO : (rank + 1) * MICRO]


def _model():
    return GPT(model_config(), VOCAB, seed=7)


@pytest.mark.parametrize("dp", [2, 4])
def test_ps_async_at_staleness_0_is_the_ps_engine(tmp_path, dp):
    _run(tmp_path, dp, "k0")
    start = _model().state_dict()
    for kind in ("sgd", "adamw"):
        ps = _load(tmp_path, f"ps-{kind}", dp)["weights"]
        k0 = _load(tmp_path, f"k0-{kind}", dp)["weights"]
        assert _relative_error(start, ps) > 1e-3, "training did not move the weights"
        if kind == "sgd":
            assert _relative_error(k0, ps) <= 1e-5
        else:  # AdamW amplifies summation-order noise where a gradient is nearly 0
            assert _moved(k0, ps, start) <= 2e-4


def _replay_ps_async(d, k, lengths):
    """ps-async in one process, the server taking the workers in round-robin order."""
    masters = _model()
    optimizer = make_optimizer("adamw", masters, "fp32")
    caches = [_model() for _ in range(d)]
    seen, count, version, stats = [0] * d, [0] * d, 0, []
    for n in lengths:
        quota, applied, turn, running = n * d, 0, 0, set(range(d))
        dropped, staleness, losses, sent = 0, [], [], [0] * d
        while running:
            while turn % d not in running:
                turn += 1
            i, turn = turn % d, turn + 1
            cache = caches[i]
            cache.zero_grad(set_to_none=True)
            loss = cache(*_mine(count[i], i, d))
            loss.backward()
            count[i] += 1
            sent[i] += 1
            if applied < quota:
                staleness.append(version - seen[i])
                losses.append(loss.item())
                for master, mine in zip(masters.parameters(), cache.parameters(), strict=True):
                    master.grad = mine.grad / d
                for group in optimizer.param_groups:
                    group["lr"] = rr_lr(version // d)
                torch.nn.utils.clip_grad_norm_(masters.parameters(), CLIP)
                optimizer.step()
                version += 1
                applied += 1
                stop = applied == quota
            else:
                dropped += 1
                stop = True
            if stop:
                running.discard(i)
            elif version - seen[i] > k:
                cache.load_state_dict(masters.state_dict())
                seen[i] = version
        for cache in caches:  # the segment's end: everybody takes the server's weights
            cache.load_state_dict(masters.state_dict())
        seen = [version] * d
        stats.append(
            {
                "updates": quota,
                "dropped_gradients": dropped,
                "staleness_mean": sum(staleness) / len(staleness),
                "staleness_max": max(staleness),
                "rank_gradients": sent,
                "loss": sum(losses) / len(losses),
            }
        )
    return masters.state_dict(), stats


@pytest.mark.parametrize("dp", [2, 4])
def test_ps_async_in_round_robin_order_is_its_one_process_replay(tmp_path, dp):
    _run(tmp_path, dp, "rr")
    start = _model().state_dict()
    for k in (1, 2):
        got = _load(tmp_path, f"rr-k{k}", dp)
        expected, stats = _replay_ps_async(dp, k, [2, 1])
        assert _relative_error(start, expected) > 1e-3
        assert _moved(got["weights"], expected, start) <= 2e-4, k
        for mine, theirs in zip(got["stats"], stats, strict=True):
            assert mine["loss"] == pytest.approx(theirs.pop("loss"), rel=1e-5)
            assert {key: mine[key] for key in theirs} == theirs, k
        # Staleness happened (what the test is about): some gradient met newer weights.
        assert max(s["staleness_max"] for s in stats) >= 1
        assert all(s["skipped_updates"] == 0 for s in got["stats"])
    # A NaN gradient from worker 1: its update is skipped and counted, the others applied.
    poisoned = _load(tmp_path, "rr-nan", dp)
    (stats,) = poisoned["stats"]
    assert (stats["skipped_updates"], stats["skipped_steps"], stats["bad_steps_in_a_row"]) == (
        1,
        1,
        0,
    )
    assert all(torch.isfinite(w).all() for w in poisoned["weights"].values())
    assert _relative_error(start, poisoned["weights"]) > 1e-3
    # The last d updates skipped: d updates, but one step, and one step's worth in a row (what
    # train.max_bad_steps counts).
    (stats,) = _load(tmp_path, "rr-nan-step", dp)["stats"]
    assert (stats["skipped_updates"], stats["skipped_steps"], stats["bad_steps_in_a_row"]) == (
        dp,
        1,
        1,
    )


def _replay_local_sgd(d, period, steps, moments, kind="adamw", clip=CLIP):
    models = [_model() for _ in range(d)]
    optimizers = [make_optimizer(kind, m, "fp32") for m in models]
    for k in range(steps):
        for i, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            model(*_mine(k, i, d)).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if (k + 1) % period == 0:
            with torch.no_grad():
                for params in zip(*(m.parameters() for m in models), strict=True):
                    mean = torch.stack(params).mean(0)
                    for p in params:
                        p.copy_(mean)
                    if moments:
                        for key in ("exp_avg", "exp_avg_sq"):
                            pairs = zip(optimizers, params, strict=True)
                            states = [o.state[p][key] for o, p in pairs]
                            mean = torch.stack(states).mean(0)
                            for state in states:
                                state.copy_(mean)
    return models[0].state_dict()


def test_local_sgd_is_its_one_process_replay_and_sync_sgd_at_h1(tmp_path):
    d = 2
    _run(tmp_path, d, "local")
    start = _model().state_dict()
    for case, period, moments in (("h1", 1, False), ("h4", 4, False), ("h4-moments", 4, True)):
        expected = _replay_local_sgd(d, period, 8, moments)
        got = _load(tmp_path, f"local-{case}", d)["weights"]
        assert _moved(got, expected, start) <= 2e-4, case
    # Horovod averages what torch averages.
    horovod = _load(tmp_path, "local-h4-horovod", d)["weights"]
    assert _relative_error(horovod, _load(tmp_path, "local-h4", d)["weights"]) <= 1e-6
    # Averaging the moments is a different algorithm, and the test can tell.
    assert (
        _moved(
            _load(tmp_path, "local-h4-moments", d)["weights"],
            _replay_local_sgd(d, 4, 8, False),
            start,
        )
        > 1e-3
    )
    # Plain SGD at H = 1: the average of d steps is the step on the average gradient.
    sgd = _load(tmp_path, "local-sgd-h1", d)["weights"]
    ddp = _load(tmp_path, "local-ddp", d)["weights"]
    assert _relative_error(start, ddp) > 1e-3
    assert _relative_error(sgd, ddp) <= 1e-5


def _train(stdlib, run_dir, *extra):
    return train(2, stdlib, run_dir, *SMALL, *extra)


def test_ps_async_trains_logs_its_staleness_and_resumes(stdlib, tmp_path):
    from hpcllm.observe import read_metrics

    run_dir = tmp_path / "run"
    common = [
        "parallel.dp_engine=ps-async",
        "parallel.max_staleness=2",
        "train.straggler_rank=1",
        "train.straggler_factor=3",
        "train.log_interval=3",
        "train.save_interval=3",
        "train.eval_interval=0",
    ]
    run = _train(stdlib, run_dir, *common, "train.steps=6")
    run.check()
    assert "data parallel ps-async: asynchronous parameter server" in run.stdout
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [3, 6]
    for r in records:
        assert r["updates"] == 3 * 2  # d updates a step
        assert r["consumed_samples"] == r["step"] * 8
        # The straggler sent fewer gradients than the server's own worker, which never
        # waited for it.
        assert r["rank_gradients"][0] > r["rank_gradients"][1] >= 1
        assert r["staleness_max"] >= 1 and r["staleness_mean"] > 0
        assert r["slowest_rank"] == 1
    # Resumed from its step-6 checkpoint, it goes on from the server's weights.
    resumed = _train(stdlib, run_dir, *common, "train.steps=9")
    resumed.check()
    assert "resumes from step 6" in resumed.stdout
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [3, 6, 9]
    assert records[-1]["loss"] < records[0]["loss"]


def test_local_sgd_averages_before_it_saves_and_resumes_exactly(stdlib, tmp_path):
    from hpcllm.observe import read_metrics
    from hpcllm.train import checkpoint

    common = ["parallel.dp_engine=local-sgd", "parallel.local_sgd_steps=2", "train.eval_interval=0"]
    whole = tmp_path / "whole"
    _train(stdlib, whole, *common, "train.steps=6").check()
    parts = tmp_path / "parts"
    _train(stdlib, parts, *common, "train.steps=4", "train.save_interval=2").check()
    _train(stdlib, parts, *common, "train.steps=6", "train.save_interval=2").check()
    want = [r["loss"] for r in read_metrics(whole)]
    got = [r["loss"] for r in read_metrics(parts)]
    # Each replica's AdamW state is its own (the moments are not averaged): the checkpoint
    # keeps both, and each rank resumes with its own, so the losses are the uninterrupted
    # run's.
    assert got == pytest.approx(want, rel=1e-5)
    folder = parts / "checkpoints" / "step_00000004"
    assert checkpoint.verify(folder).status == "ok"
    assert sorted(f.name for f in folder.glob("optimizer_*")) == [
        "optimizer_tp00_pp00_dp000.pt",
        "optimizer_tp00_pp00_dp001.pt",
    ]


def test_bench_sync_writes_its_table_chart_and_json(stdlib, tmp_path):
    import json

    run = cli(
        "bench", "sync", "--engines", "ddp", "ps-async", "--staleness", "2", "--steps", "6",
        "--log-every", "3", "--out", str(tmp_path / "b"), *sets(*SMALL, f"data.path={stdlib}"),
        env=HOROVOD_OVER_MPI, timeout=600, check=True,
    )  # fmt: skip
    result = json.loads((tmp_path / "b" / "bench_sync.json").read_text())
    rows = {(r["strategy"], r["straggler"]): r for r in result["rows"]}
    assert sorted(rows) == [
        ("ps-async K=2", False),
        ("ps-async K=2", True),
        ("sync ddp", False),
        ("sync ddp", True),
    ]
    # Synchronous ddp waits for the straggler every step: its rate falls by about the factor.
    assert rows["sync ddp", True]["vs_no_straggler"] < 0.75
    assert rows["ps-async K=2", True]["staleness_mean"] > 0
    assert rows["sync ddp", False]["staleness_mean"] is None
    assert all(r["val_loss_mean"] > 0 for r in rows.values())  # the final evaluation
    assert (tmp_path / "b" / "bench_sync.png").stat().st_size > 10_000
    assert "ps-async K=2" in run.stdout and "vs none" in run.stdout
