"""``model.compile`` trains to the losses of the uncompiled model, in every layout it serves.

Each case is one of :mod:`test_one_step_path`'s (same data, shapes, steps and overrides) with
the model compiled; its losses are compared with that case's recorded ones, which the
uncompiled trainer reproduces to 1e-6 (``test_losses_equal_the_recorded_ones``), so this
checks compiled against uncompiled at rel 1e-4 (inductor reorders fp32 sums). CPU inductor
compiles a block once per shape (about 25 s cold, 2 s from its on-disk cache), whatever the
depth: the blocks share one graph.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_one_step_path import RECORDED, prepare_data, read_losses, train_case

from hpcllm.config import ModelConfig
from hpcllm.errors import UserError
from hpcllm.model.gpt import GPT
from hpcllm.train.parallelize import compile_chunks, resolve_compile

# name: (ranks, recorded case, overrides)
CASES: dict[str, tuple[int, str, list[str]]] = {
    "d1-full": (1, "d1", ["model.compile=full"]),
    "d1-blocks-recompute-full": (1, "d1", ["model.compile=blocks", "model.recompute=full"]),
    "d1-blocks-recompute-selective": (
        1,
        "d1",
        ["model.compile=blocks", "model.recompute=selective"],
    ),
    "t2-blocks": (2, "t2", ["parallel.tp=2", "model.compile=blocks"]),
    "p2-blocks": (
        2,
        "p2-1f1b",
        ["parallel.pp=2", "parallel.schedule=1f1b", "model.compile=blocks"],
    ),
    "d2-ddp-blocks": (2, "d2-ddp", ["parallel.dp_engine=ddp", "model.compile=blocks"]),
    "d2-horovod-blocks": (2, "d2-horovod", ["parallel.dp_engine=horovod", "model.compile=blocks"]),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_data(tmp_path_factory.mktemp("compile"))


@pytest.mark.mpi
@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_model_trains_to_the_uncompiled_losses(
    case: str, data: Path, tmp_path: Path
) -> None:
    ranks, recorded_case, overrides = CASES[case]
    run_dir = tmp_path / case
    train_case(ranks, data, run_dir, overrides, timeout=420)
    recorded = json.loads(RECORDED.read_text())[recorded_case]
    got = read_losses(run_dir)
    assert len(got["loss"]) == len(recorded["loss"]) == 4
    for key in ("loss", "val_loss"):
        for new, old in zip(got[key], recorded[key], strict=True):
            assert math.isclose(new, old, rel_tol=1e-4), (key, got[key], recorded[key])


def test_auto_compiles_on_cuda_only_whole_on_one_gpu_and_zb_h1_never() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_compile("auto", cpu, "1f1b") == "none"
    assert resolve_compile("auto", cpu, "1f1b", one_gpu=True) == "none"
    assert resolve_compile("auto", cuda, "1f1b") == "blocks"
    assert resolve_compile("auto", cuda, "1f1b", one_gpu=True) == "full"
    assert resolve_compile("blocks", cuda, "1f1b", one_gpu=True) == "blocks"
    assert resolve_compile("auto", cuda, "zb-h1") == "none"
    assert resolve_compile("full", cpu, "interleaved") == "full"
    with pytest.raises(UserError, match="zb-h1"):
        resolve_compile("blocks", cuda, "zb-h1")


@pytest.mark.parametrize("how", ["blocks", "full"])
def test_compile_mode_reaches_every_compiled_part(how: str, monkeypatch) -> None:
    """model.compile_mode is the mode of every torch.compile the chunks get: each block and
    the head under blocks, the chunk under full."""
    calls = []
    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self, **kw: calls.append((type(self).__name__, kw))
    )
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(("head", kw)) or fn)

    class Chunk(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleDict({"0": torch.nn.Linear(2, 2), "1": torch.nn.ReLU()})
            self.head = torch.nn.Linear(2, 2)
            self.post, self.tp_group = True, None

    compile_chunks(torch.nn.ModuleList([Chunk()]), how, "reduce-overhead")
    mode = {"mode": "reduce-overhead"}
    blocks = [("Linear", mode), ("ReLU", mode), ("head", mode)]
    assert calls == ([("Chunk", mode)] if how == "full" else blocks)


@pytest.mark.slow
def test_blocks_share_one_compiled_graph_and_weights_stay_the_models() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg = ModelConfig(preset=None, n_layer=3, n_head=2, d_model=32, seq_len=16)
    model, reference = GPT(cfg, 50, seed=3), GPT(cfg, 50, seed=3)
    compile_chunks(torch.nn.ModuleList([model]), "blocks")
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    loss, expected = model(ids, ids), reference(ids, ids)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    # Three blocks, one block graph (plus the head's): compiling deeper models costs no more.
    assert counters["stats"]["unique_graphs"] == 2
    # Compilation adds no parameters and renames none: checkpoints keep their keys.
    assert list(model.state_dict()) == list(reference.state_dict())
