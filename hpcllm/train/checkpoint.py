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
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hpcllm.config import Config, config_from_dict, load_yaml
from hpcllm.errors import UserError
from hpcllm.files import atomic_write, durable_replace, fsync_path

LATEST = "latest"


def _name(step: int) -> str:
    return f"step_{step:08d}"


def _partial(root: Path, step: int) -> Path:
    # One name for every rank (each writes its shard into it), unlike files.partial_path.
    return root / f".{_name(step)}.partial"


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
    tmp = _partial(root, step)
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
    tmp, final = _partial(root, step), root / _name(step)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    (tmp / "config.yaml").write_text(config_yaml)
    for path in (tmp / "meta.json", tmp / "config.yaml"):
        fsync_path(path)
    if final.exists():
        shutil.rmtree(final)
    durable_replace(tmp, final)
    # Last: `latest` names only a complete, durable folder.
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
    tmp = _partial(root, step)
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


def check_same_model(folder: Path, cfg: Config, vocab_size: int) -> None:
    """Refuse, in one line, to resume ``cfg`` from a checkpoint of another model or stage cut."""
    saved_cfg = config_from_dict(load_yaml((folder / "config.yaml").read_text()))
    saved, mine = saved_cfg.model, cfg.model
    keys = ("n_layer", "n_head", "d_model", "seq_len")
    different = [
        f"{k} {getattr(saved, k)} vs {getattr(mine, k)}"
        for k in keys
        if getattr(saved, k) != getattr(mine, k)
    ]
    if cfg.parallel.pp > 1 and saved_cfg.parallel.pp == cfg.parallel.pp:
        # Same p but another cut of the blocks: each rank's shard holds other layers.
        for key in ("vpp", "pipeline_layers"):
            was, now = getattr(saved_cfg.parallel, key), getattr(cfg.parallel, key)
            if was != now:
                different.append(f"parallel.{key} {was} vs {now}")
    saved_vocab = read_meta(folder).get("vocab_size")
    if saved_vocab not in (None, vocab_size):
        different.append(f"vocabulary {saved_vocab} vs {vocab_size}")
    if different:
        raise UserError(
            f"{folder} holds another model ({', '.join(different)}); train "
            f"with --config {folder / 'config.yaml'} (and your data.path), or "
            "set run.resume=none to start over"
        )
