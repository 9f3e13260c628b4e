"""A checkpoint holds named parts: one added from a test alone is saved, verified and resumed.

:class:`Draws` stands for any stateful component (a data blend's position, a router's
statistics): its own random generator, advanced once a step by a gradient hook, and a running
total. The trainer knows nothing of it; ``Trainer(parts={"draws": ...})`` names it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from family_runs import SMALL

from hpcllm.config import load_config
from hpcllm.datasets.prepare import PrepareOptions, prepare
from hpcllm.errors import UserError
from hpcllm.observe import read_metrics
from hpcllm.train import checkpoint
from hpcllm.train.trainer import Trainer


class Draws:
    """A stateful part: one draw from its own generator per step, summed."""

    def __init__(self) -> None:
        self.gen = torch.Generator().manual_seed(7)
        self.total = torch.zeros(())
        self.steps = 0

    def tick(self, *_: Any) -> None:
        self.total += torch.rand((), generator=self.gen)
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"gen": self.gen.get_state(), "total": self.total.clone(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.gen.set_state(state["gen"])
        self.total = state["total"].clone()
        self.steps = state["steps"]


@pytest.fixture(scope="module")
def stdlib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data") / "stdlib"
    prepare(PrepareOptions(out=out, corpus="python-stdlib", tokenizer="byte"), progress=False)
    return out


def _train(stdlib: Path, run: Path, steps: int, parts: dict[str, Any], *extra: str) -> list:
    cfg = load_config(
        None,
        [
            *SMALL,
            f"data.path={stdlib}",
            f"run.dir={run}",
            f"train.steps={steps}",
            "train.lr_decay_steps=4",
            "train.save_interval=2",
            "train.eval_interval=0",
            *extra,
        ],
    )
    hooks = [part.tick for part in parts.values() if isinstance(part, Draws)]
    with Trainer(cfg, grad_hooks=hooks, parts=parts) as trainer:
        trainer.run(progress=False)
    return [r["loss"] for r in read_metrics(run)]


def test_a_part_named_by_a_test_alone_resumes_exactly(stdlib: Path, tmp_path: Path) -> None:
    whole = Draws()
    losses = _train(stdlib, tmp_path / "whole", 4, {"draws": whole})
    first = Draws()
    _train(stdlib, tmp_path / "split", 2, {"draws": first})
    assert first.steps == 2
    # A fresh part, loaded from the step-2 checkpoint, goes on where the first left off.
    second = Draws()
    resumed = _train(stdlib, tmp_path / "split", 4, {"draws": second}, "run.resume=auto")
    assert second.steps == whole.steps == 4
    assert torch.equal(second.total, whole.total)
    assert torch.equal(second.gen.get_state(), whole.gen.get_state())
    assert resumed[-2:] == losses[-2:]  # the model's own parts resumed too, bit for bit
    # The manifest names it among the parts, and the checkpoint verifies with it.
    folder = checkpoint.latest(tmp_path / "split")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["parts"] == ["model", "optimizer", "scaler", "rng", "draws"]
    assert checkpoint.verify(folder).status == "ok"
    shard = checkpoint.load_shard(folder, 0, 0, 1, 1)
    assert torch.equal(shard["draws"]["total"], whole.total)


def test_a_part_the_checkpoint_lacks_is_refused_in_one_line_and_an_extra_one_is_left(
    stdlib: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    _train(stdlib, run, 2, {"draws": Draws()})
    with pytest.raises(UserError, match=r"holds no 'later' \(its parts: model, optimizer"):
        _train(stdlib, run, 4, {"draws": Draws(), "later": Draws()}, "run.resume=auto")
    # A part the run does not track is named in a warning and left unread.
    _train(stdlib, run, 4, {}, "run.resume=auto")
    assert "holds parts this run does not use, left unread: ['draws']" in capsys.readouterr().err


def test_a_layout_names_each_file_by_the_axes_that_cut_it_and_one_replica_writes_it() -> None:
    from hpcllm.train.checkpoint.format import Layout

    grid = type("G", (), {"tp": 2, "pp": 1, "dp": 2})()
    layout = Layout.of_grid(grid, optimizer_by_dp=True)
    assert layout.names() == {
        "model_tp00_pp00.pt",
        "model_tp01_pp00.pt",
        "optimizer_tp00_pp00_dp000.pt",
        "optimizer_tp00_pp00_dp001.pt",
        "optimizer_tp01_pp00_dp000.pt",
        "optimizer_tp01_pp00_dp001.pt",
    }
    assert layout.writes("model", {"tp": 1, "pp": 0, "dp": 0})
    assert not layout.writes("model", {"tp": 1, "pp": 0, "dp": 1})  # a replica's copy
    assert layout.writes("optimizer", {"tp": 1, "pp": 0, "dp": 1})
    # Format 2's meta.json implies the same layout; the manifest's round-trips.
    meta = {"tp": 2, "pp": 1, "dp": 2, "optimizer_shards": 2}
    assert Layout.of_meta(meta).names() == layout.names()
    assert Layout.from_json(json.loads(json.dumps(layout.to_json()))) == layout
    # A further axis is one more kind of file, not another format: at ep > 1 the experts'
    # files, cut by ep and written by each ep rank's first expert-dp replica (ep is the
    # fast-varying part of dp: dp rank = ep rank + ep · expert-dp rank).
    grid = type("G", (), {"tp": 1, "pp": 1, "dp": 4, "ep": 2})()
    experts = Layout.of_grid(grid, optimizer_by_dp=False)
    assert experts.names() == {
        "model_tp00_pp00.pt",
        "experts_tp00_pp00_ep00.pt",
        "experts_tp00_pp00_ep01.pt",
    }
    assert experts.writes("experts", {"tp": 0, "pp": 0, "dp": 1, "ep": 1})
    assert not experts.writes("experts", {"tp": 0, "pp": 0, "dp": 3, "ep": 1})  # a replica
    assert not experts.writes("model", {"tp": 0, "pp": 0, "dp": 1, "ep": 1})
    both = Layout.of_grid(grid, optimizer_by_dp=True)  # a file cut by dp is cut by ep too
    assert both.writes("optimizer", {"tp": 0, "pp": 0, "dp": 3, "ep": 1})
    assert Layout.from_json(json.loads(json.dumps(experts.to_json()))) == experts
    dense = type("G", (), {"tp": 1, "pp": 1, "dp": 4})()
    assert "ep" not in Layout.of_grid(dense, optimizer_by_dp=False).sizes


@pytest.mark.parametrize(("saved", "ep"), [(2, 1), (2, 2), (2, 4), (4, 2), (1, 4), (4, 4)])
def test_experts_saved_by_one_ep_are_read_cut_for_another(saved: int, ep: int) -> None:
    from hpcllm.train.checkpoint.read import experts_files, merge_experts

    # 8 experts: each tensor's row e is expert e; the optimizer's entry keeps its step.
    whole = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    per = 8 // saved
    files = {
        j: {
            "model": {"experts.up": whole[j * per : (j + 1) * per]},
            "optimizer": {"state": {5: {"exp_avg": -whole[j * per : (j + 1) * per]}}},
        }
        for j in range(saved)
    }
    for rank in range(ep):
        wanted = experts_files(saved, ep, rank)
        shard = {"model": {"wte": torch.ones(2)}, "optimizer": {"state": {5: {"step": 7}}}}
        merge_experts(shard, {j: files[j] for j in wanted}, saved, ep, rank)
        mine = whole[rank * 8 // ep : (rank + 1) * 8 // ep]
        assert torch.equal(shard["model"]["experts.up"], mine), (saved, ep, rank)
        assert torch.equal(shard["optimizer"]["state"][5]["exp_avg"], -mine)
        assert shard["optimizer"]["state"][5]["step"] == 7 and "wte" in shard["model"]
        # Only the files that hold this rank's experts are read.
        assert len(wanted) == max(1, saved // ep), (saved, ep, rank, wanted)


def test_a_manifest_whose_layout_is_broken_fails_verification(stdlib: Path, tmp_path: Path):
    run = tmp_path / "run"
    _train(stdlib, run, 2, {})
    folder = checkpoint.latest(run)
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["layout"]["files"]["model"] = ["tp", "cp"]  # an axis without a size
    path.write_text(json.dumps(manifest))
    verdict = checkpoint.verify(folder)
    assert verdict.status == "bad" and "names an axis without a size" in verdict.reason
    # A layout that names a file the folder lacks: the file is reported missing.
    manifest["layout"] = {"axes": {"tp": 2, "pp": 1}, "files": {"model": ["tp", "pp"]}}
    path.write_text(json.dumps(manifest))
    verdict = checkpoint.verify(folder)
    assert verdict.status == "bad"
    assert "model_tp01_pp00.pt is not in manifest.json" in verdict.reason
