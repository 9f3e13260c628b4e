"""Checkpoints: one file per (tp, pp) rank, written to a hidden folder, renamed, then `latest`.

```
RUN_DIR/checkpoints/
  step_00000200/
    meta.json                  step, consumed samples, grid sizes
    config.yaml                the run's resolved config
    model_tp00_pp00.pt         model, optimizer, scaler, RNG states of that model shard
  latest                       "step_00000200", replaced last
```

Data-parallel replicas hold the same shard, so only dp rank 0 of each (tp, pp) writes. A
crash at any moment leaves either the previous `latest` or the new one, never a half-written
checkpoint that `latest` points to.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hpcllm.errors import UserError
from hpcllm.files import atomic_write, fsync_path

LATEST = "latest"


def _name(step: int) -> str:
    return f"step_{step:08d}"


def shard_file(tp_rank: int, pp_rank: int) -> str:
    """Return the file name of a (tp, pp) model shard."""
    return f"model_tp{tp_rank:02d}_pp{pp_rank:02d}.pt"


def rng_state(device: torch.device) -> dict[str, Any]:
    """Return every RNG state a step may draw from."""
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save(
    run_dir: Path,
    step: int,
    grid: Any,
    shard: dict[str, Any],
    meta: dict[str, Any],
    config_yaml: str,
) -> Path:
    """Write the checkpoint of ``step`` (a collective: every rank calls it); return its path."""
    root = run_dir / "checkpoints"
    final = root / _name(step)
    tmp = root / f".{_name(step)}.partial"
    if grid.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    if grid.dp_rank == 0:
        path = tmp / shard_file(grid.tp_rank, grid.pp_rank)
        torch.save(shard, path)
        fsync_path(path)
    dist.barrier()
    if grid.rank == 0:
        _publish(
            root,
            step,
            {**meta, "step": step, "tp": grid.tp, "pp": grid.pp, "dp": grid.dp},
            config_yaml,
        )
    dist.barrier()
    return final


def _publish(root: Path, step: int, meta: dict[str, Any], config_yaml: str) -> None:
    """Complete the hidden folder of ``step``, rename it, then point `latest` at it."""
    tmp = root / f".{_name(step)}.partial"
    final = root / _name(step)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    (tmp / "config.yaml").write_text(config_yaml)
    for path in (tmp / "meta.json", tmp / "config.yaml", tmp):
        fsync_path(path)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    # Last, and durably (the rename of the folder above is flushed with it).
    atomic_write(root / LATEST, _name(step) + "\n")


def write_offline(
    run_dir: Path,
    step: int,
    shards: dict[tuple[int, int], dict[str, Any]],
    meta: dict[str, Any],
    config_yaml: str,
    *,
    tp: int,
    pp: int,
    dp: int | None,
) -> Path:
    """Write a whole checkpoint from one process (conversion tools); return its folder."""
    root = run_dir / "checkpoints"
    tmp = root / f".{_name(step)}.partial"
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for (tp_rank, pp_rank), shard in shards.items():
        path = tmp / shard_file(tp_rank, pp_rank)
        torch.save(shard, path)
        fsync_path(path)
    _publish(root, step, {**meta, "step": step, "tp": tp, "pp": pp, "dp": dp}, config_yaml)
    return root / _name(step)


def latest(run_dir: Path) -> Path | None:
    """Return the checkpoint folder `latest` names, or None if the run has none."""
    pointer = Path(run_dir) / "checkpoints" / LATEST
    if not pointer.is_file():
        return None
    folder = pointer.parent / pointer.read_text().strip()
    if not (folder / "meta.json").is_file():
        raise UserError(f"{pointer} names {folder.name}, which is missing or incomplete")
    return folder


def read_meta(folder: Path) -> dict[str, Any]:
    """Return a checkpoint's meta.json."""
    return json.loads((folder / "meta.json").read_text())


def load_shard(folder: Path, tp_rank: int, pp_rank: int, tp: int, pp: int) -> dict[str, Any]:
    """Return this rank's shard of a checkpoint, after checking the grid it was saved with."""
    meta = read_meta(folder)
    if (meta["tp"], meta["pp"]) != (tp, pp):
        raise UserError(
            f"{folder} was saved with tp={meta['tp']}, pp={meta['pp']} and this "
            f"run has tp={tp}, pp={pp}; hpcllm convert --tp N re-cuts tensor-"
            "parallel shards (pipeline stages must match)"
        )
    path = folder / shard_file(tp_rank, pp_rank)
    if not path.is_file():
        raise UserError(f"checkpoint shard {path} is missing")
    return torch.load(path, map_location="cpu", weights_only=False)
