"""Checkpoints that cannot betray a resume: manifests, verification and fallback, weights_only
loading, a full disk during a save, torn metrics lines and ``hpcllm inspect --verify``.

One tiny run (two steps, a checkpoint after each) is trained once; each test damages a copy.
"""

import errno
import io
import json
import random
import shutil

import numpy as np
import pytest
import torch
from datasets_fixtures import prepare_corpus
from family_runs import SMALLEST
from full_disk import open_on_full_disk

from hpcllm.cli import main
from hpcllm.config import load_config
from hpcllm.errors import UserError
from hpcllm.observe import MetricsLog, read_metrics
from hpcllm.train import checkpoint
from hpcllm.train.trainer import Trainer

TINY = [
    *SMALLEST,
    "train.micro_batch_size=2",
    "train.steps=2",
    "train.save_interval=1",
    "train.eval_interval=0",
    "train.log_interval=1",
    "run.tensorboard=false",
]
SHARD = "model_tp00_pp00.pt"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    prepare_corpus(root / "corpus", root / "data", tokenizer="byte", val_fraction=0.0)
    cfg = load_config(None, [*TINY, f"data.path={root / 'data'}", f"run.dir={root / 'run'}"])
    with Trainer(cfg) as trainer:
        trainer.run(progress=False)
        yield root / "run", trainer.grid


@pytest.fixture
def run(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained[0], copy)
    return copy


def _step(run, step):
    return run / "checkpoints" / f"step_{step:08d}"


def _flip(path, offset=200, count=64):
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_every_file_is_in_the_manifest_and_the_newest_checkpoint_is_resumed(run):
    folder = _step(run, 2)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["format_version"] == checkpoint.FORMAT_VERSION and manifest["step"] == 2
    assert sorted(manifest["files"]) == ["config.yaml", "meta.json", SHARD]
    for name, entry in manifest["files"].items():
        size, crc = checkpoint.checksum(folder / name)
        assert entry == {"bytes": size, "crc32": crc}
    assert checkpoint.read_meta(folder)["format_version"] == checkpoint.FORMAT_VERSION
    assert [v.status for v in map(checkpoint.verify, checkpoint.checkpoints(run))] == ["ok"] * 2
    warnings = []
    assert checkpoint.resumable(run, warnings.append) == folder
    assert warnings == []
    assert not list((run / "checkpoints").glob(".*"))  # no partial folder left


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


DAMAGE = {
    "flipped shard": (SHARD, _flip, "model_tp00_pp00.pt is corrupt"),
    "truncated shard": (SHARD, _truncate, "model_tp00_pp00.pt has"),
    "empty shard": (SHARD, lambda p: p.write_bytes(b""), "model_tp00_pp00.pt has 0 bytes"),
    "missing shard": (SHARD, lambda p: p.unlink(), "model_tp00_pp00.pt is missing"),
    "bad meta.json": ("meta.json", lambda p: p.write_text('{"step": 2,'), "meta.json"),
    "missing manifest": ("manifest.json", lambda p: p.unlink(), "manifest.json is missing"),
    "garbage manifest": ("manifest.json", lambda p: p.write_bytes(b"\xff\x00"), "manifest.json"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_resumed(run, damage):
    name, spoil, reason = DAMAGE[damage]
    spoil(_step(run, 2) / name)
    verdict = checkpoint.verify(_step(run, 2))
    assert verdict.status == "bad" and reason in verdict.reason
    warnings = []
    assert checkpoint.resumable(run, warnings.append) == _step(run, 1)
    assert len(warnings) == 2  # the damaged checkpoint, and `latest` naming it
    assert str(_step(run, 2)) in warnings[0] and reason in warnings[0]
    assert "names step_00000002; resuming from step_00000001" in warnings[1]


@pytest.mark.parametrize("damage", ["flipped shard", "truncated shard", "empty shard"])
def test_loading_a_damaged_shard_is_one_line_naming_it(run, damage):
    name, spoil, reason = DAMAGE[damage]
    spoil(_step(run, 2) / name)
    with pytest.raises(UserError, match=reason) as caught:
        checkpoint.load_shard(_step(run, 2), 0, 0, 1, 1)
    assert "\n" not in str(caught.value)
    assert not caught.value.same_on_all_ranks  # another rank's shard may be fine


def test_a_shard_that_is_not_a_checkpoint_is_one_line_even_with_its_manifest(run):
    # A shard written wrong from the start (its manifest agrees) still fails in one line.
    folder = _step(run, 2)
    (folder / SHARD).write_bytes(b"not a zip file at all")
    manifest = json.loads((folder / "manifest.json").read_text())
    size, crc = checkpoint.checksum(folder / SHARD)
    manifest["files"][SHARD] = {"bytes": size, "crc32": crc}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=f"checkpoint shard {folder / SHARD} is unreadable"):
        checkpoint.load_shard(folder, 0, 0, 1, 1)


def test_read_meta_names_a_corrupt_file(run):
    (_step(run, 2) / "meta.json").write_bytes(b"\x00\x01garbage")
    with pytest.raises(UserError, match=r"meta.json is unreadable") as caught:
        checkpoint.read_meta(_step(run, 2))
    assert "\n" not in str(caught.value)


def test_a_garbage_latest_is_passed_over_on_resume_and_refused_by_latest(run):
    (run / "checkpoints" / "latest").write_bytes(b"\xde\xad../../etc\n")
    warnings = []
    assert checkpoint.resumable(run, warnings.append) == _step(run, 2)
    assert len(warnings) == 1 and "holds no checkpoint name" in warnings[0]
    with pytest.raises(UserError, match="latest holds no checkpoint name"):
        checkpoint.latest(run)


def test_no_checkpoint_that_verifies_is_one_line_not_a_fresh_start(run, trained):
    assert checkpoint.agreed_resumable(run, trained[1], lambda _: None) == _step(run, 2)
    for step in (1, 2):
        _flip(_step(run, step) / SHARD)
    with pytest.raises(UserError, match="none of the 2 checkpoints") as caught:
        checkpoint.resumable(run, lambda _: None)
    assert "\n" not in str(caught.value)
    with pytest.raises(UserError, match="none of the 2 checkpoints"):
        checkpoint.agreed_resumable(run, trained[1], lambda _: None)
    assert checkpoint.resumable(run.parent / "fresh", lambda _: None) is None


def test_rng_states_round_trip_through_weights_only_loading():
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    np.random.normal()  # numpy keeps a cached Gaussian: it must come back too
    buffer = io.BytesIO()
    torch.save({"rng": checkpoint.rng_state(torch.device("cpu"))}, buffer)
    expected = (torch.rand(3), np.random.normal(size=3), [random.random() for _ in range(3)])
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)["rng"]
    checkpoint.set_rng_state(state, torch.device("cpu"))
    got = (torch.rand(3), np.random.normal(size=3), [random.random() for _ in range(3)])
    assert torch.equal(got[0], expected[0])
    assert np.array_equal(got[1], expected[1]) and got[2] == expected[2]


def test_a_checkpoint_from_before_manifests_is_resumed_unchecked_only_when_asked(run):
    # Format 1: no manifest, no format_version, numpy's RNG state pickled as a tuple.
    folder = _step(run, 2)
    (folder / "manifest.json").unlink()
    meta = json.loads((folder / "meta.json").read_text())
    del meta["format_version"]
    (folder / "meta.json").write_text(json.dumps(meta))
    shard = torch.load(folder / SHARD, weights_only=True)
    np.random.seed(5)
    shard["rng"]["numpy"] = np.random.get_state()
    torch.save(shard, folder / SHARD)
    verdict = checkpoint.verify(folder)
    assert verdict.status == "unverified" and verdict.files == 3
    warnings = []
    # It cannot be told from a damaged checkpoint whose manifest went: refused, unless asked.
    with pytest.raises(UserError, match="has no manifest.json.*run.allow_unverified=true"):
        checkpoint.resumable(run, warnings.append)
    assert checkpoint.resumable(run, warnings.append, allow_unverified=True) == folder
    assert "no manifest; resuming from it unchecked" in warnings[0]
    loaded = checkpoint.load_shard(folder, 0, 0, 1, 1)
    checkpoint.set_rng_state(loaded["rng"], torch.device("cpu"))
    expected = np.random.RandomState(5).random_sample(4)
    assert np.array_equal(np.random.random_sample(4), expected)


def _disk_full_for(monkeypatch, suffix):
    # Files ending in ``suffix`` land on a full disk: ENOSPC from the OS call (torch.save
    # wraps it in a RuntimeError, buffered text writes raise it at flush).
    real_open = open

    def open_full(path, mode="r", *args, **kwargs):
        if str(path).endswith(suffix) and "w" in mode:
            return open_on_full_disk(path, mode, *args, **kwargs)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(checkpoint.write, "open", open_full, raising=False)


def _save(run, grid, step, **options):
    shard = checkpoint.load_shard(_step(run, 2), 0, 0, 1, 1)
    meta = checkpoint.read_meta(_step(run, 2))
    config = (_step(run, 2) / "config.yaml").read_text()
    return checkpoint.save(run, step, grid, shard, meta, config, **options)


def test_a_full_disk_keeps_the_previous_checkpoint_and_fails_in_one_line(run, trained, monkeypatch):
    before = {p: p.read_bytes() for p in _step(run, 2).iterdir()}
    _disk_full_for(monkeypatch, ".pt")
    with pytest.raises(UserError) as caught:
        _save(run, trained[1], 3)
    message = str(caught.value)
    assert "\n" not in message and "no space left on device" in message
    assert f".step_00000003.partial/{SHARD}" in message
    assert message.endswith("; the 2 earlier checkpoints are intact")
    # A first save that fails does not speak of earlier checkpoints.
    shard = checkpoint.load_shard(_step(run, 2), 0, 0, 1, 1)
    with pytest.raises(UserError, match="; there is no earlier checkpoint$"):
        checkpoint.save(run.parent / "fresh", 1, trained[1], shard, {}, "{}\n")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "latest",
        "step_00000001",
        "step_00000002",
    ]
    assert {p: p.read_bytes() for p in _step(run, 2).iterdir()} == before
    assert checkpoint.resumable(run, lambda _: None) == _step(run, 2)


def test_a_full_disk_can_warn_and_go_on(run, trained, monkeypatch):
    _disk_full_for(monkeypatch, "meta.json")
    warnings = []
    assert _save(run, trained[1], 3, on_failure="warn", warn=warnings.append) is None
    assert len(warnings) == 1
    assert ".step_00000003.partial/meta.json: no space left on device" in warnings[0]
    assert not (run / "checkpoints" / ".step_00000003.partial").exists()
    monkeypatch.undo()
    assert _save(run, trained[1], 3) == _step(run, 3)
    assert checkpoint.verify(_step(run, 3)).status == "ok"
    assert checkpoint.latest(run) == _step(run, 3)


def test_a_quota_reads_as_no_space_left():
    err = OSError(errno.EDQUOT, "Disk quota exceeded", "/scratch/run/x.pt")
    assert checkpoint.describe(err) == (
        "/scratch/run/x.pt: no space left on device (disk quota exceeded)"
    )


def test_a_torn_metrics_line_is_dropped_with_a_warning(run):
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    path.write_text("\n".join(lines) + '\n{"step": 3, "lo')
    warnings = []
    assert [r["step"] for r in read_metrics(run, warnings.append)] == [1, 2]
    assert len(warnings) == 1 and "line 3" in warnings[0]
    MetricsLog(run, tensorboard=False, start_step=1).close()  # resuming from step 1
    # Nothing is truncated: the torn line is ended, the marker stands on a line of its own.
    text = path.read_text()
    assert text.startswith("\n".join(lines) + '\n{"step": 3, "lo\n{"resumed_from": 1')
    assert [r["step"] for r in read_metrics(run, warnings.append)] == [1]
    assert not list(run.glob(".metrics.jsonl.partial*"))


def test_inspect_verify_prints_a_table_and_exits_1_on_a_bad_checkpoint(run, capsys):
    assert main(["inspect", "--verify", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["step", "files", "bytes", "status", "reason"]
    assert [line.split()[::3] for line in out[1:3]] == [["2", "ok"], ["1", "ok"]]
    assert out[-2] == "latest: step_00000002"
    assert out[-1] == (
        "newest that verifies: step 2: format 3, tp 1 x pp 1 x dp 1 (model by tp, pp), "
        "parts: model, optimizer, scaler, rng"
    )
    _flip(_step(run, 1) / SHARD)
    assert main(["inspect", "--verify", str(run)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[2].split()[:4] == ["1", "3", out[2].split()[2], "bad"]
    assert "model_tp00_pp00.pt is corrupt" in out[2]
    assert main(["inspect", "--json", str(run)]) == 1
    rows = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [r["status"] for r in rows] == ["ok", "bad"]
    shutil.rmtree(_step(run, 1))
    (run / "checkpoints" / "latest").write_text("nonsense\n")
    assert main(["inspect", "--verify", str(run)]) == 1
    assert capsys.readouterr().out.splitlines()[-2].endswith("latest holds no checkpoint name")


@pytest.mark.mpi
def test_a_full_disk_on_one_rank_fails_the_save_on_every_rank_alike(tmp_path):
    from mpirun import python, run_mpi

    script = python("tests/mpi_scripts/checkpoint_disk_full.py", str(tmp_path / "run"))
    result = run_mpi(2, script, timeout=120).check()
    messages = [result.rank_stdout[rank].splitlines() for rank in (0, 1)]
    assert messages[0] == messages[1], messages
    agreed, resume = messages[0]
    assert (
        "no space left on device" in agreed
        and f"partial/{SHARD.replace('00_', '01_', 1)}" in agreed
    )
    assert resume == "resume: step_00000001"
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "latest",
        "step_00000001",
    ]
