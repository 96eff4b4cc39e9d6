"""Workers for test_ddp.py and test_hsdp.py: replicated training (DDP; HSDP's replicate ×
shard mesh) equals a single-process run on the concatenated batch, and every replica ends
with bitwise-identical parameters, bases, moments and counters.

HSDP: four ranks form a 2×2 mesh; ``fully_shard(..., mesh=mesh)`` with a 2-D mesh shards each
parameter over the "shard" dimension and replicates it over "replicate". Every rank trains on
its own quarter of each batch, so the two replica groups see different data and only FSDP2's
all-reduce over the replicate dimension makes their gradients (and so their GaLore bases)
agree.
"""

from __future__ import annotations

from functools import partial

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel

from ..dist import (
    assert_params_match,
    assert_same_across,
    cpu_mesh,
    make_model,
    max_change,
    optimizer,
    shard,
    sharded_vs_single,
)

CONFIGS = [{"projector": "svd"}, {"projector": "randomized"}]


def _check_replicas(
    model: nn.Module, opt, what: str, group: dist.ProcessGroup | None = None
) -> None:
    """Three refreshes; both projection sides present; every state tensor (a DTensor's local
    shard) bitwise equal across ``group``; bases laid out on their parameter's mesh."""
    sides = set()
    for name, p in model.named_parameters():
        state = opt.state[p]
        if "galore.refreshes" in state:
            assert int(state["galore.refreshes"]) == 3, (name, int(state["galore.refreshes"]))
        for key, value in state.items():  # bases, moments and counters alike
            if key.startswith("proj."):
                sides.add(key)
                if isinstance(p, DTensor):
                    assert isinstance(value, DTensor) and value.device_mesh is p.device_mesh
            local = value.to_local() if isinstance(value, DTensor) else value
            assert_same_across(local, f"{what}: {name} {key}", group)
    assert sides == {"proj.left", "proj.right"}, sides


def ddp_matches_single_process(rank: int, world: int) -> None:
    for settings in CONFIGS:
        # rank r trains on its 1/world of each batch
        model, opt, reference, _ = sharded_vs_single(
            rank, world, DistributedDataParallel, partial(optimizer, settings=settings)
        )
        assert_params_match(model, reference, 1e-5, f"{settings} rank {rank}/{world}")
        for name, p in model.named_parameters():
            assert_same_across(p, f"{settings} {name}")
        moved = max_change(model, make_model())
        assert moved > 1e-3, moved
        _check_replicas(model, opt, f"{settings} rank {rank}")


def _hsdp(model: nn.Module, mesh) -> nn.Module:
    shard(model, mesh)
    for name, p in model.named_parameters():  # the layout under test really is HSDP
        assert isinstance(p, DTensor) and p.device_mesh.ndim == 2, name
        assert tuple(p.placements) == (Replicate(), Shard(0)), (name, p.placements)
    return model


def hsdp_matches_single_process(rank: int, world: int) -> None:
    assert world == 4
    mesh = cpu_mesh(2, 2, names=("replicate", "shard"))
    for settings in CONFIGS:
        # rank r trains on rows [3r, 3r + 3) of each batch
        hsdp, opt, reference, _ = sharded_vs_single(
            rank, world, partial(_hsdp, mesh=mesh), partial(optimizer, settings=settings)
        )
        assert_params_match(hsdp, reference, 1e-5, f"{settings} rank {rank}")
        moved = max_change(hsdp, make_model())
        assert moved > 1e-3, moved
        # Replicas hold bitwise-identical bases (and every other state tensor).
        _check_replicas(hsdp, opt, f"{settings} rank {rank}", mesh.get_group("replicate"))
