import itertools
import re

import pytest
from megatron_order import LAYOUTS_8, group_of, megatron_groups

from hpcllm.errors import UserError
from hpcllm.topology import Layout


def test_megatron_docstring_example():
    # The 16-GPU example in Megatron-LM's parallel_state: t=2, p=4, so d=2.
    layout = Layout(tp=2, pp=4, dp=2)
    assert layout.groups("tp") == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
        [8, 9],
        [10, 11],
        [12, 13],
        [14, 15],
    ]
    assert layout.groups("dp") == [
        [0, 2],
        [1, 3],
        [4, 6],
        [5, 7],
        [8, 10],
        [9, 11],
        [12, 14],
        [13, 15],
    ]
    assert layout.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


@pytest.mark.parametrize("sizes", LAYOUTS_8 + [(2, 3, 4), (3, 2, 5), (1, 1, 1), (4, 4, 4)])
def test_groups_match_megatron_construction(sizes):
    layout = Layout(*sizes)
    oracle = megatron_groups(*sizes)
    for rank in range(layout.world_size):
        assert layout.tp_group(rank) == group_of(oracle["tp"], rank)
        assert layout.pp_group(rank) == group_of(oracle["pp"], rank)
        assert layout.dp_group(rank) == group_of(oracle["dp"], rank)
        assert layout.mp_group(rank) == group_of(oracle["mp"], rank)


@pytest.mark.parametrize("sizes", [(2, 3, 4), (4, 2, 1), (1, 1, 6)])
def test_coords_and_rank_are_inverse_and_groups_partition(sizes):
    layout = Layout(*sizes)
    seen = set()
    for tp_rank, pp_rank, dp_rank in itertools.product(
        range(layout.tp), range(layout.pp), range(layout.dp)
    ):
        rank = layout.rank(tp_rank, pp_rank, dp_rank)
        assert layout.coords(rank) == (tp_rank, pp_rank, dp_rank)
        seen.add(rank)
    assert seen == set(range(layout.world_size))
    for axis, size in (
        ("tp", layout.tp),
        ("pp", layout.pp),
        ("dp", layout.dp),
        ("mp", layout.tp * layout.pp),
    ):
        groups = layout.groups(axis)
        assert all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size))


def test_dp_defaults_to_world_over_tp_pp():
    assert Layout.for_world(8, tp=2) == Layout(2, 1, 4)
    assert Layout.for_world(8, tp=2, pp=2, vpp=3) == Layout(2, 2, 2, 3)


@pytest.mark.parametrize(
    "world, kwargs, words",
    [
        (6, dict(tp=4), "not divisible by tp*pp"),
        (8, dict(tp=2, pp=2, dp=3), "does not equal the world size 8"),
        (8, dict(tp=0), "parallel.tp must be a positive integer"),
        (8, dict(tp=2, dp=-4), "parallel.dp must be a positive integer"),
        (4, dict(pp=1, vpp=2), "needs parallel.pp >= 2"),
    ],
)
def test_bad_sizes_are_user_errors(world, kwargs, words):
    with pytest.raises(UserError, match=re.escape(words)):
        Layout.for_world(world, **kwargs)


def test_coords_reject_ranks_outside_the_world():
    with pytest.raises(ValueError):
        Layout(2, 2, 2).coords(8)
