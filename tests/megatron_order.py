"""An independent oracle for Megatron's rank order, written the way Megatron-LM builds groups.

Megatron's ``initialize_model_parallel`` enumerates groups per axis with strided ranges rather
than from coordinates; re-deriving them that way checks :class:`hpcllm.topology.Layout`
against a second construction instead of against itself.
"""

from __future__ import annotations


def megatron_groups(tp: int, pp: int, dp: int) -> dict[str, list[list[int]]]:
    """Return the tp, pp, dp, mp and embedding groups Megatron-LM forms for these sizes."""
    world = tp * pp * dp
    per_stage = world // pp
    tp_groups = [list(range(i * tp, (i + 1) * tp)) for i in range(world // tp)]
    pp_groups = [list(range(i, world, per_stage)) for i in range(per_stage)]
    dp_groups = []
    for stage in range(pp):
        start, end = stage * per_stage, (stage + 1) * per_stage
        dp_groups += [list(range(start + j, end, tp)) for j in range(tp)]
    mp_groups = [
        sorted(r for g in pp_groups for r in g if (r % per_stage) // tp == d) for d in range(dp)
    ]
    # Megatron's embedding groups: each pipeline's first and last stage (the tied embedding).
    embedding_groups = [[g[0], g[-1]] for g in pp_groups] if pp > 1 else []
    return {
        "tp": tp_groups,
        "pp": pp_groups,
        "dp": dp_groups,
        "mp": mp_groups,
        "embedding": embedding_groups,
    }


def megatron_expert_groups(tp: int, pp: int, dp: int, ep: int) -> dict[str, list[list[int]]]:
    """Return the expert-parallel and expert-data-parallel groups of Megatron-Core's order
    tp-cp-ep-dp-pp (cp = 1, experts split over tp as the dense layers are): a stage's data-
    parallel ranks of one tp index, taken ep consecutive at a time (ep), or every ep-th
    (expert-dp)."""
    world = tp * pp * dp
    per_stage = world // pp
    ep_groups, edp_groups = [], []
    for stage in range(pp):
        start, end = stage * per_stage, (stage + 1) * per_stage
        for j in range(tp):
            replicas = list(range(start + j, end, tp))
            ep_groups += [replicas[k : k + ep] for k in range(0, dp, ep)]
            edp_groups += [replicas[k::ep] for k in range(ep)]
    return {"ep": ep_groups, "expert_dp": edp_groups}


def megatron_context_groups(tp: int, pp: int, dp: int, cp: int) -> dict[str, list[list[int]]]:
    """Return every group of Megatron-Core's order tp-cp-dp-pp with context parallelism,
    enumerated by strides within each stage's tp·cp·dp ranks: tp (consecutive), cp (every
    tp-th within a block of tp·cp), dp (every tp·cp-th within a stage), dp_cp (every tp-th
    within a stage), pp (every stage's), mp (a tp × pp block of one dp and cp index)."""
    world = tp * cp * dp * pp
    per_stage, block = world // pp, tp * cp
    groups: dict[str, list[list[int]]] = {
        "tp": [list(range(i * tp, (i + 1) * tp)) for i in range(world // tp)],
        "pp": [list(range(i, world, per_stage)) for i in range(per_stage)],
        "cp": [],
        "dp": [],
        "dp_cp": [],
    }
    for stage in range(pp):
        start, end = stage * per_stage, (stage + 1) * per_stage
        for b in range(start, end, block):
            groups["cp"] += [list(range(b + j, b + block, tp)) for j in range(tp)]
        groups["dp"] += [list(range(start + j, end, block)) for j in range(block)]
        groups["dp_cp"] += [list(range(start + j, end, tp)) for j in range(tp)]
    groups["mp"] = [
        sorted(r for g in groups["pp"] for r in g if (r % per_stage) // tp == i)
        for i in range(dp * cp)
    ]
    groups["embedding"] = [[g[0], g[-1]] for g in groups["pp"]] if pp > 1 else []
    return groups


def group_of(groups: list[list[int]], rank: int) -> list[int]:
    """Return the one group in ``groups`` that holds ``rank``."""
    (found,) = [g for g in groups if rank in g]
    return found


LAYOUTS_8 = [(1, 1, 8), (2, 2, 2), (2, 4, 1), (8, 1, 1), (1, 8, 1), (4, 1, 2)]
# With expert parallelism inside d: (tp, pp, dp, ep).
LAYOUTS_8_EP = [(1, 1, 8, 2), (2, 2, 2, 2), (1, 2, 4, 4), (2, 1, 4, 2)]
# With context parallelism next to tp: (tp, pp, dp, ep = 1, cp).
LAYOUTS_8_CP = [(1, 1, 4, 1, 2), (2, 1, 2, 1, 2), (1, 2, 2, 1, 2), (2, 2, 1, 1, 2), (1, 1, 2, 1, 4)]
