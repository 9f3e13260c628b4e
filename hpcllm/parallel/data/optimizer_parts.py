"""The distributed optimizer's state as it is saved: one part per dp rank, and their merge.

Each dp rank of the distributed optimizer (:mod:`hpcllm.parallel.data.distributed_optimizer`)
saves its 1/d of the Adam moments, cut out of its flat gradient buckets, with the buckets'
layout. :func:`merge_shards` turns a whole set of parts back into the plain AdamW
``state_dict`` of the same parameters, which any optimizer at any d loads. The engine (a set
of one at d = 1) and the checkpoint reader (:mod:`hpcllm.train.checkpoint`) both merge
through here, so the format does not import the engine.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# What a dp rank's part says it is (the ``format`` key of its state).
FORMAT = "hpcllm-distributed-optimizer-1"


def is_shard_state(state: Any) -> bool:
    """Return whether ``state`` is one dp rank's distributed-optimizer shard."""
    return isinstance(state, dict) and state.get("format") == FORMAT


def merge_shards(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Return the plain AdamW ``state_dict`` of the parameters from every dp rank's shard.

    ``shards`` of one layout, one per dp rank. Each parameter's moments are cut out of the
    buckets whole again (padding dropped); the step and the param groups' settings are the
    same on every rank.
    """
    shards = sorted(shards, key=lambda s: s["dp_rank"])
    layout = shards[0]["layout"]
    dp = layout["dp"]
    if [s["dp_rank"] for s in shards] != list(range(dp)):
        raise ValueError(f"the distributed optimizer's shards are incomplete (d = {dp})")
    shapes = layout["shapes"]
    state: dict[int, dict[str, Any]] = {}
    if shards[0]["state"]:
        for bucket in layout["buckets"]:
            slot = bucket["slot"]
            step = shards[0]["state"][slot]["step"]
            names = [
                k
                for k in ("exp_avg", "exp_avg_sq", "master_weight")
                if k in shards[0]["state"][slot]
            ]
            for name in names:
                flat = torch.cat([s["state"][slot][name] for s in shards])
                for i, off in zip(bucket["indices"], bucket["offsets"], strict=True):
                    n = math.prod(shapes[i])
                    entry = state.setdefault(i, {"step": step.clone()})
                    entry[name] = flat[off : off + n].reshape(shapes[i]).clone()
    param_groups = []
    start = 0
    for g, size in enumerate(layout["group_sizes"]):
        settings = {k: v for k, v in shards[0]["param_groups"][g].items() if k != "params"}
        param_groups.append({**settings, "params": list(range(start, start + size))})
        start += size
    return {"state": dict(sorted(state.items())), "param_groups": param_groups}
