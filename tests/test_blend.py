"""Weighted blends of prepared folders (``data.blend``): the order, the reader, resume, checks."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from datasets_fixtures import letter_dataset, source_letter
from family_runs import SMALLEST, cli

from hpcllm.config import load_config
from hpcllm.datasets.blend import (
    BLEND_PART,
    Blend,
    BlendedReader,
    BlendOrder,
    BlendPosition,
    Phase,
    data_hash,
)
from hpcllm.datasets.reader import ShardDataset, epoch_permutation
from hpcllm.errors import UserError

SEQ = 16


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three byte-tokenized folders of different sizes (A small, so that it runs out), and one
    made with a BPE tokenizer."""
    root = tmp_path_factory.mktemp("blend")
    made = {
        letter: letter_dataset(root, letter, n) for letter, n in (("A", 12), ("B", 60), ("C", 30))
    }
    made["BPE"] = letter_dataset(root, "D", 40, tokenizer="bpe")
    return made


def _blend(folders: dict[str, Path], *weighted: tuple[str, float]) -> Blend:
    return Blend([[str(folders[name]), weight, name.lower()] for name, weight in weighted])


def _deviation(weights: tuple[float, ...], samples: int) -> np.ndarray:
    """Return, for every prefix n = 1..samples, the largest |count_i(n) - w_i n| over i."""
    order = BlendOrder(weights)
    sources = order.take(0, [0] * len(weights), samples)
    counts = np.cumsum(np.eye(len(weights), dtype=np.int64)[sources], axis=0)
    n = np.arange(1, samples + 1)[:, None]
    w = np.array(weights) / sum(weights)
    return np.abs(counts - w * n).max(axis=1)


@pytest.mark.parametrize("weights", [(0.3, 0.7), (0.2, 0.3, 0.5), (0.15, 0.6, 0.25)])
def test_every_prefix_of_10000_samples_is_within_one_sample_of_the_weights(weights):
    deviation = _deviation(weights, 10_000)
    assert deviation.max() <= 1
    assert deviation.max() <= BlendOrder(weights).bound + 1e-9  # 1/2 for two, 3/4 for three


def test_the_bound_holds_for_up_to_eight_sources_where_megatrons_greedy_rule_strays():
    rng = np.random.default_rng(7)
    for k in range(2, 9):
        for _ in range(6):
            weights = tuple(rng.dirichlet(np.full(k, 0.5)) + 1e-3)
            assert _deviation(weights, 1500).max() <= 1 - 1 / (2 * k - 2) + 1e-9, weights
    # Megatron's BlendedDataset: the source furthest behind its share, argmax w_i (n+1) - c_i.
    weights = np.array([0.01, 0.44, 0.03, 0.51, 0.01])
    counts, worst = np.zeros(5), 0.0
    for n in range(400):
        counts[np.argmax(weights * (n + 1) - counts)] += 1
        worst = max(worst, np.abs(counts - weights * (n + 1)).max())
    assert worst > 1.05
    assert _deviation(tuple(weights), 400).max() <= 0.875 + 1e-9


def test_the_order_goes_on_from_any_position_and_weights_are_normalised():
    order = BlendOrder([3, 7, 5])
    whole = order.take(0, [0, 0, 0], 3000)
    assert order.weights == pytest.approx([0.2, 7 / 15, 1 / 3])
    pieces, counts, start = [], [0, 0, 0], 0
    for size in (1, 7, 500, 999, 1493):
        pieces.append(order.take(start, counts, size))
        start += size
    assert np.array_equal(np.concatenate(pieces), whole)
    assert order.counts_at(1234) == np.bincount(whole[:1234], minlength=3).tolist()
    assert order.counts_at(3000, 1234, order.counts_at(1234)) == counts
    assert BlendOrder([1]).take(5, [5], 4).tolist() == [0, 0, 0, 0]


def _stream(reader: BlendedReader, steps: int) -> list[np.ndarray]:
    """Return ``steps`` micro-batches of ``reader`` as (b, seq + 1) token arrays."""
    batches = iter(reader)
    out = []
    for _ in range(steps):
        batch = next(batches)
        out.append(np.concatenate([batch.input_ids, batch.labels[:, -1:]], axis=1))
    batches.close()
    return out


def test_each_source_gives_its_samples_in_its_own_order_epoch_after_epoch(folders):
    blend = _blend(folders, ("A", 0.5), ("B", 0.3), ("C", 0.2))
    reader = BlendedReader(blend, seq_len=SEQ, micro_batch_size=4, seed=3)
    windows = [w for batch in _stream(reader, 40) for w in batch]
    order = blend.order.take(0, [0, 0, 0], len(windows))
    for index, letter in enumerate("ABC"):
        dataset = ShardDataset(folders[letter], "train", SEQ)
        mine = [w for w, source in zip(windows, order, strict=True) if source == index]
        assert {source_letter(w) for w in mine} == {letter}
        n = dataset.n_samples
        expected = [
            dataset.window(int(epoch_permutation(n, 3, j // n)[j % n])) for j in range(len(mine))
        ]
        assert all(np.array_equal(a, b) for a, b in zip(mine, expected, strict=True))
    assert (
        len([s for s in order if s == 0]) > 2 * ShardDataset(folders["A"], "train", SEQ).n_samples
    )


def test_d_ranks_together_read_what_one_rank_reads_and_resume_anywhere_at_any_d(folders):
    blend = _blend(folders, ("A", 0.3), ("B", 0.7))
    single = _stream(BlendedReader(blend, seq_len=SEQ, micro_batch_size=4, seed=1), 10)
    ranks = [
        _stream(
            BlendedReader(blend, seq_len=SEQ, micro_batch_size=2, dp_rank=r, dp_size=2, seed=1), 10
        )
        for r in (0, 1)
    ]
    for step in range(10):
        assert np.array_equal(np.concatenate([ranks[0][step], ranks[1][step]]), single[step])
    # Stopped after 4 micro-steps at d = 2, resumed at d = 1 and at d = 4 from the position.
    first = BlendedReader(blend, seq_len=SEQ, micro_batch_size=2, dp_size=2, seed=1)
    _stream(first, 4)
    counts = first.counts_at(16)
    assert counts == blend.order.counts_at(16) and sum(counts) == 16
    again = BlendedReader(
        blend, seq_len=SEQ, micro_batch_size=4, seed=1, consumed_samples=16, counts=counts
    )
    assert all(np.array_equal(a, b) for a, b in zip(_stream(again, 6), single[4:], strict=True))
    quarter = [
        _stream(
            BlendedReader(
                blend,
                seq_len=SEQ,
                micro_batch_size=1,
                dp_rank=r,
                dp_size=4,
                seed=1,
                consumed_samples=16,
            ),
            6,
        )
        for r in range(4)
    ]
    for step in range(6):
        assert np.array_equal(np.concatenate([q[step] for q in quarter]), single[4 + step])


def test_a_blend_of_two_tokenizers_is_refused_naming_the_odd_one_out(folders):
    with pytest.raises(UserError) as err:
        _blend(folders, ("A", 1), ("BPE", 1), ("C", 1))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(
        f"data.blend source bpe ({folders['BPE']}) was made with another tokenizer"
    )
    assert "than a, c" in message and "--tokenizer" in message
    with pytest.raises(UserError, match=r"data.blend source x: .* does not exist"):
        Blend([[str(folders["A"]), 1, "a"], [str(folders["A"].parent / "none"), 1, "x"]])


def test_a_source_too_short_for_one_sample_is_named(folders):
    blend = _blend(folders, ("A", 1), ("B", 1))
    with pytest.raises(UserError, match=r"^data.blend source a: sequence length 100000 is longer"):
        blend.check(100_000)


def _position(blend: Blend, consumed: int, state: dict | None = None) -> BlendPosition:
    """Return ``blend``'s position at ``consumed`` samples, loaded from ``state`` if given, its
    reader built (one rank, micro-batch 4)."""
    position = BlendPosition(blend, lambda: consumed)
    if state is not None:
        position.load_state_dict(state)
    read = {"seq_len": SEQ, "micro_batch_size": 4, "dp_rank": 0, "dp_size": 1, "seed": 1}
    position.reader_for(consumed_samples=consumed, prefetch=1, **read)
    return position


def _saved_after(blend: Blend, samples: int) -> dict:
    """Return the position a run that began ``blend`` at sample 0 saves after ``samples``."""
    position = _position(blend, 0)
    assert position.reader is not None
    _stream(position.reader, samples // 4)
    position.consumed = lambda: samples
    return position.state_dict()


def test_the_position_resumes_the_same_blend_and_refuses_changed_data(folders, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(folders["B"], copy)
    blend = Blend([[str(folders["A"]), 0.3, "a"], [str(copy), 0.7, "b"]])
    saved = _saved_after(blend, 40)
    assert saved["counts"] == blend.order.counts_at(40)
    assert saved["phase_start"] == 0 and saved["phase_counts"] == [0, 0]
    assert [s["name"] for s in saved["sources"]] == ["a", "b"]
    resumed = _position(blend, 40, saved)  # the same blend goes on where it was
    assert resumed.note is None and resumed.reader is not None
    assert resumed.reader.counts == saved["counts"]
    # The same data prepared again (elsewhere, by another version, with other timings).
    raw = json.loads((copy / "manifest.json").read_text())
    raw["prepare"]["seconds"] = 123.0
    raw["created_by"] = "hpcllm 9.9"
    raw["sources"]["inputs"] = ["/elsewhere/texts"]
    (copy / "manifest.json").write_text(json.dumps(raw))
    again = Blend([[str(folders["A"]), 0.3, "a"], [str(copy), 0.7, "b"]])
    assert data_hash(again.sources[1].manifest) == saved["sources"][1]["hash"]
    assert _position(again, 40, saved).note is None
    shutil.rmtree(copy)
    letter_dataset(tmp_path / "changed", "B", 61)  # one document more
    shutil.copytree(tmp_path / "changed" / "b", copy)
    changed = Blend([[str(folders["A"]), 0.3, "a"], [str(copy), 0.7, "b"]])
    with pytest.raises(
        UserError, match=r"^data.blend source b \(.*\) is not the data the checkpoint drew from"
    ):
        BlendPosition(changed, lambda: 0).load_state_dict(saved)
    # Absurd weights are normalised without overflow.
    assert Blend(
        [[str(folders["A"]), 1e308, "a"], [str(folders["C"]), 1e308, "c"]]
    ).order.weights == [0.5, 0.5]


def test_another_mixture_begins_a_new_phase_where_each_source_goes_on(folders):
    first = Blend([[str(folders["A"]), 0.3, "a"], [str(folders["B"]), 0.7, "b"]])
    saved = _saved_after(first, 40)
    drawn = dict(zip("ab", saved["counts"], strict=True))
    # Annealing: other weights, b left out and c added, from sample 40 on.
    second = Blend([[str(folders["A"]), 0.8, "a"], [str(folders["C"]), 0.2, "c"]])
    position = _position(second, 40, saved)
    assert position.note.startswith(
        "data.blend differs from the checkpoint's (then a 0.3, b 0.7; now a 0.8, c 0.2): the "
        "blend's order begins again at sample 40"
    )
    reader = position.reader
    assert reader.phase.start == 40 and reader.phase.before == (drawn["a"], 0)
    windows = [w for batch in _stream(reader, 50) for w in batch]
    # Within the phase, every prefix tracks the new weights; a goes on in its own order.
    order = second.order.take(0, [0, 0], len(windows))
    assert [source_letter(w) for w in windows] == ["AC"[i] for i in order]
    a = ShardDataset(folders["A"], "train", SEQ)
    expected = [
        a.window(int(epoch_permutation(a.n_samples, 1, j // a.n_samples)[j % a.n_samples]))
        for j in range(drawn["a"], drawn["a"] + int((order == 0).sum()))
    ]
    mine = [w for w, i in zip(windows, order, strict=True) if i == 0]
    assert all(np.array_equal(x, y) for x, y in zip(mine, expected, strict=True))
    # Saved again, the phase goes on, exactly.
    state = reader.counts_at(240)
    later = BlendPosition(second, lambda: 240)
    later.reader = reader
    again = later.state_dict()
    assert again["phase_start"] == 40 and again["phase_counts"] == [drawn["a"], 0]
    assert again["counts"] == state
    resumed = _position(second, 240, again)
    assert resumed.note is None and resumed.reader.phase == reader.phase


def test_blend_config_forms_and_refusals(tmp_path):
    sets = ["data.blend=[[data/a, 3], [data/b, 7, bee]]"]
    assert load_config(None, sets).data.blend == [["data/a", 3.0, "a"], ["data/b", 7.0, "bee"]]
    megatron = load_config(None, ["data.blend=0.3 data/a 0.7 data/b/"]).data.blend
    assert megatron == [["data/a", 0.3, "a"], ["data/b", 0.7, "b"]]
    assert load_config(None, ["data.blend=data/a"]).data.blend == [["data/a", 1.0, "a"]]
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  blend:\n    - [data/a, 0.3]\n    - [data/b, 0.7]\n")
    assert load_config(path).data.blend == megatron
    refused = {
        "data.blend=[]": "data.blend needs at least one source (null: read data.path)",
        "data.blend=[[data/a, 0]]": "data.blend entry 1: WEIGHT must be a number above 0, got 0",
        "data.blend=[[data/a, .nan]]": "data.blend entry 1: WEIGHT must be a number above 0",
        "data.blend=[[data/a, 1], [data/a/, 2]]": "data.blend lists data/a twice",
        "data.blend=[[x/a, 1], [y/a, 2]]": "data.blend names two sources a (x/a and y/a)",
        "data.blend=[[data/a, 1, 'a b']]": "data.blend entry 1: NAME must be letters, digits",
        "data.blend=0.3 data/a 0.7": "data.blend as text is Megatron's 'W1 PATH1 W2 PATH2 ...'",
        "data.blend=[data/a]": "data.blend entry 1 must be [PATH, WEIGHT] or [PATH, WEIGHT, NAME]",
        "data.blend={a: 1}": "data.blend must be a list of [PATH, WEIGHT]",
    }
    for text, message in refused.items():
        with pytest.raises(UserError) as err:
            load_config(None, [text])
        assert str(err.value).startswith(message), (text, str(err.value))
    # Both in one place are refused; the command line's stands over the file's, as for any key.
    with pytest.raises(UserError, match="data.blend and data.path are both given on the command"):
        load_config(None, [*sets, "data.path=data/x"])
    path.write_text("data:\n  path: data/x\n  blend: [[data/a, 1]]\n")
    with pytest.raises(UserError, match=f"data.blend and data.path are both given in {path};"):
        load_config(path)
    assert load_config(path, ["data.blend=null"]).data.path == "data/x"
    path.write_text("data:\n  path: data/x\n")
    assert load_config(path, sets).data.blend == [["data/a", 3.0, "a"], ["data/b", 7.0, "bee"]]
    # A blended run's config.yaml holds no data.path; with --set data.path=D it reads D.
    saved = tmp_path / "run-config.yaml"
    load_config(None, sets).dump(saved)
    assert "path" not in yaml.safe_load(saved.read_text())["data"]
    assert load_config(saved).data.blend == [["data/a", 3.0, "a"], ["data/b", 7.0, "bee"]]
    folder = load_config(saved, ["data.path=data/y"]).data
    assert folder.blend is None and folder.path == "data/y"
    with pytest.raises(UserError, match="data.synthetic reads no folder"):
        load_config(None, [*sets, "data.synthetic=true"])


@pytest.mark.slow
def test_print_config_and_a_refused_blend_on_the_command_line(folders, tmp_path):
    blend = f"data.blend=[[{folders['A']}, 0.25], [{folders['C']}, 0.75, cee]]"
    done = cli(
        "train", "--print-config", "--set", blend, "--set", f"run.dir={tmp_path / 'r'}", check=True
    )
    printed = yaml.safe_load(done.stdout)
    assert printed["data"]["blend"] == [
        [str(folders["A"]), 0.25, "a"],
        [str(folders["C"]), 0.75, "cee"],
    ]
    bad = f"data.blend=0.5 {folders['A']} 0.5 {folders['BPE']}"
    done = cli("train", "--set", bad, "--set", f"run.dir={tmp_path / 'r'}")
    assert done.returncode == 2 and not (tmp_path / "r").exists()
    lines = done.stderr.strip().splitlines()
    assert (
        len(lines) == 1 and "data.blend source d (" in lines[0] and "another tokenizer" in lines[0]
    )


def _run_cfg(folders: dict[str, Path], run: Path, *extra: str):
    return load_config(
        None,
        [
            *SMALLEST,
            f"model.seq_len={SEQ}",
            f"data.blend=[[{folders['A']}, 0.2], [{folders['B']}, 0.5], [{folders['C']}, 0.3]]",
            f"run.dir={run}",
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            "train.eval_interval=3",
            "train.eval_iters=2",
            "train.save_interval=3",
            "train.log_interval=1",
            "train.lr=3e-3",
            *extra,
        ],
    )


@pytest.mark.slow
def test_a_blended_run_resumes_exactly_and_logs_each_sources_validation(folders, tmp_path):
    from hpcllm.observe import interval_line, read_metrics
    from hpcllm.train import checkpoint
    from hpcllm.train.inspect_run import render_run, verify_run
    from hpcllm.train.trainer import Trainer

    with Trainer(_run_cfg(folders, tmp_path / "whole", "train.steps=6")) as trainer:
        banner = trainer.banner()
        trainer.run(progress=False)
    with Trainer(_run_cfg(folders, tmp_path / "split", "train.steps=3")) as trainer:
        trainer.run(progress=False)
    with Trainer(_run_cfg(folders, tmp_path / "split", "train.steps=6")) as trainer:
        assert trainer.reader.consumed_samples == 12
        trainer.run(progress=False)
    whole = {r["step"]: r for r in read_metrics(tmp_path / "whole")}
    split = {r["step"]: r for r in read_metrics(tmp_path / "split")}
    for step in range(1, 7):
        assert split[step]["loss"] == whole[step]["loss"], step
        assert split[step]["grad_norm"] == whole[step]["grad_norm"], step
    # Each source's validation loss, and the blend's: their mean by weight.
    for step in (3, 6):
        record = whole[step]
        by = {name: record[f"val_loss/{name}"] for name in "abc"}
        assert record["val_loss"] == pytest.approx(0.2 * by["a"] + 0.5 * by["b"] + 0.3 * by["c"])
        assert split[step]["val_loss"] == record["val_loss"]
        assert len(set(by.values())) == 3
        line = interval_line(record, 6, None, 0.0)
        assert line.endswith(
            f"val_loss {record['val_loss']:8.4f} a {by['a']:.4f} b {by['b']:.4f} c {by['c']:.4f}"
        )
    meta = checkpoint.read_meta(tmp_path / "whole" / "checkpoints" / "step_00000006")
    assert meta[BLEND_PART] == {
        "phase_start": 0,
        "consumed_samples": 24,
        "samples": dict(zip("abc", BlendOrder([0.2, 0.5, 0.3]).counts_at(24), strict=True)),
    }
    text = "\n".join(banner)
    assert "blend of 3 folder(s) (data.blend), one tokenizer; the run's 24 samples draw:" in text
    assert "b  weight 0.5000  12 samples" in text
    shown = render_run(verify_run(tmp_path / "whole"))
    assert (
        "blend of 3 (data.blend): name, weight, samples drawn (at step_00000006), folder" in shown
    )
    assert f"  b  0.5000  {meta[BLEND_PART]['samples']['b']:>9}  {folders['B']}" in shown
    # A re-cut carries the position (hpcllm convert; run.reshard: the MPI test below).
    cli(
        "convert",
        "--checkpoint",
        str(tmp_path / "whole"),
        "--out",
        str(tmp_path / "t2"),
        "--tp",
        "2",
        check=True,
    )
    recut = render_run(verify_run(tmp_path / "t2"))
    assert (
        "tp 2 x pp 1 x dp 1" in recut
        and "parts: model, optimizer, scaler, rng, data_blend" in recut
    )
    assert f"  b  0.5000  {meta[BLEND_PART]['samples']['b']:>9}  {folders['B']}" in recut
    # The TensorBoard events hold each source's validation loss.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "whole" / "tensorboard"))
    events.Reload()
    assert {"val_loss", "val_loss/a", "val_loss/b", "val_loss/c"} <= set(events.Tags()["scalars"])
    # Resumed on another mixture, the run begins a new phase of the order where it stopped.
    other = [f"data.blend=[[{folders['A']}, 0.5], [{folders['B']}, 0.5]]", "train.steps=7"]
    with Trainer(_run_cfg(folders, tmp_path / "whole", *other)) as trainer:
        drawn = meta[BLEND_PART]["samples"]
        assert trainer.reader.phase == Phase(24, (drawn["a"], drawn["b"]))
    # A run trained on one folder goes on as a blend, whose order begins at its step.
    plain = [f"data.path={folders['A']}", "data.blend=null", "train.steps=1"]
    with Trainer(_run_cfg(folders, tmp_path / "plain", *plain)) as trainer:
        trainer.run(progress=False)
    with Trainer(_run_cfg(folders, tmp_path / "plain", "train.steps=2")) as trainer:
        assert trainer.reader.phase.start == 4 and trainer.reader.counts == [0, 0, 0]
        assert "samples draw (its order begun at sample 4):" in "\n".join(trainer.banner())
        trainer.run(progress=False)
    meta = checkpoint.read_meta(tmp_path / "plain" / "checkpoints" / "step_00000002")
    assert meta[BLEND_PART]["phase_start"] == 4 and sum(meta[BLEND_PART]["samples"].values()) == 4
    assert math.isfinite(whole[6]["loss"])


@pytest.mark.mpi
def test_a_blended_run_resumes_exactly_at_another_d_and_after_a_recut(folders, tmp_path):
    from mpirun import python, run_mpi

    from hpcllm.observe import read_metrics
    from hpcllm.train.trainer import Trainer

    # d = 2, two micro-batches a rank and step; resumed at d = 2, at t = 2 (d = 1, re-cut) and,
    # here, in one process (d = 1): each logs the uninterrupted run's losses and norms.
    sets = [
        *SMALLEST,
        "model.n_head=4",
        f"model.seq_len={SEQ}",
        f"data.blend=[[{folders['A']}, 0.2], [{folders['B']}, 0.5], [{folders['C']}, 0.3]]",
        "train.micro_batch_size=2",
        "train.global_batch_size=8",
        "train.eval_interval=0",
        "train.log_interval=1",
        "train.lr=3e-3",
        "run.tensorboard=false",
    ]
    script = python("tests/mpi_scripts/blend_resume.py", tmp_path, "6", json.dumps(sets))
    result = run_mpi(2, script, timeout=300).check()
    runs = json.loads(result.rank_stdout[0].splitlines()[-1])
    with Trainer(load_config(None, [*sets, f"run.dir={tmp_path / 'half'}", "train.steps=6"])) as t:
        assert t.grid.dp == 1 and t.reader.consumed_samples == 24
        t.run(progress=False)
    runs["d1"] = read_metrics(tmp_path / "half")
    whole = {r["step"]: r for r in runs["whole"]}
    for name in ("split", "recut", "d1"):
        got = {r["step"]: r for r in runs[name]}
        assert sorted(got) == list(range(1, 7)), name
        for step in range(4, 7):
            for key in ("loss", "grad_norm"):
                if name == "split":  # the same layout: the same numbers
                    assert got[step][key] == whole[step][key], (name, step, key)
                else:
                    assert got[step][key] == pytest.approx(whole[step][key], rel=1e-5), (
                        name,
                        step,
                        key,
                    )
            assert got[step]["consumed_samples"] == 8 * step


@pytest.mark.slow
def test_bench_data_times_a_blend_beside_the_plain_reader(folders):
    blend = f"0.5 {folders['A']} 0.5 {folders['C']}"
    args = ["--seq-len", str(SEQ), "--micro-batch-size", "2", "--steps", "20", "--warmup", "1"]
    done = cli("bench", "data", str(folders["A"]), *args, "--blend", blend, check=True)
    table = done.stdout.splitlines()
    assert (
        table[1]
        == f"  blend: a 0.5, c 0.5; ratio: the blend's rate over {folders['A']}'s, same rank"
    )
    rows = [line for line in table if "chunk cache" in line]
    assert [row.split()[4] for row in rows] == ["plain", "blend", "plain", "blend"]
    assert all("ratio" in row for row in rows[1::2]) and not any("ratio" in r for r in rows[::2])
    done = cli("bench", "data", str(folders["A"]), *args, "--blend", "[[x, 0]]")
    assert (
        done.returncode == 2 and "--blend entry 1: WEIGHT must be a number above 0" in done.stderr
    )


def test_a_val_split_too_small_for_a_global_micro_batch_is_left_out_with_a_warning(folders):
    from hpcllm.bench.runs import synthetic_unless_data
    from hpcllm.datasets.blend import validation_readers

    said = []
    blend = _blend(folders, ("A", 1), ("B", 1))
    a_val = ShardDataset(folders["A"], "val", SEQ).n_samples
    readers = validation_readers(
        blend,
        seq_len=SEQ,
        micro_batch_size=a_val + 1,
        dp_rank=0,
        dp_size=1,
        seed=0,
        warn=said.append,
    )
    assert list(readers) == ["b"] and readers["b"][0] == 0.5
    assert len(said) == 1 and said[0].startswith("data.blend source a is left out of validation: ")
    # A benchmark of training reads a blend that is given, as it reads a given data.path.
    given = ["data.blend=[[data/a, 1]]"]
    assert synthetic_unless_data(None, given) == given
    assert synthetic_unless_data(None, ["train.steps=2"]) == [
        "data.synthetic=true",
        "train.steps=2",
    ]
