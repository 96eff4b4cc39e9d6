"""FSDP2 (fully_shard) on CPU with gloo: galore2 equals a single-process run on the same data."""

from __future__ import annotations

import pytest

from ..dist import spawn
from . import fsdp_cases


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_matches_single_process(world):
    spawn(fsdp_cases.fsdp_matches_single_process, world)


@pytest.mark.parametrize("world", [2, 3])
def test_exact_refresh_is_split_across_ranks_and_batched(world):
    spawn(fsdp_cases.exact_refresh_is_split_and_batched, world)


def test_svd_owners_are_balanced_by_cost():
    import torch

    from galore2.fsdp.placement import ShardedPlacement, assign_owners

    def fake(world):
        pl = object.__new__(ShardedPlacement)
        pl.world, pl.owner = world, None
        return pl

    shapes = [torch.Size(s) for s in [(64, 64)] * 4 + [(128, 128), (8,)]]
    placements = [fake(3) for _ in shapes]
    assign_owners(list(zip(shapes, placements, strict=True)))
    owners = [pl.owner for pl in placements]
    assert owners[4] == 0  # the largest SVD goes first, to rank 0
    assert owners[5] is None  # 1-D parameters have no SVD
    assert sorted(owners[:4]) == [1, 1, 2, 2]  # the rest fill ranks 1 and 2 (8× cheaper each)
