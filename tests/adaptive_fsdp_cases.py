"""Worker for test_adaptive_refresh.py: adaptive refresh under FSDP2 equals one process."""

from __future__ import annotations

import copy

import torch
from torch import nn

import galore2

from .fsdp_cases import make_model, shard

STEPS, BATCH = 40, 12
SETTINGS = {"rank": 3, "update_proj_gap": 2, "adaptive_refresh": True, "refresh_threshold": 0.3,
            "refresh_patience": 2, "max_update_proj_gap": 8}  # fmt: skip


def _train(model: nn.Module, projector: str, rank: int = 0, world: int = 1):
    groups = galore2.param_groups(model, projector=projector, **SETTINGS)
    opt = galore2.GaLoreAdamW(groups, lr=1e-2)
    per = BATCH // world
    for _ in range(STEPS):
        g = torch.Generator().manual_seed(7)  # the same batch every step: a steady subspace
        x, y = torch.randn(BATCH, 10, generator=g), torch.randn(BATCH, 5, generator=g)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return opt


def adaptive_matches_single_process(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    for projector in ("randomized", "svd"):
        reference = make_model()
        sharded = shard(copy.deepcopy(reference), mesh)
        ref_stats = _train(reference, projector).refresh_stats()
        stats = _train(sharded, projector, rank, world).refresh_stats()
        assert {i: (s["refreshes"], s["gap"]) for i, s in stats.items()} == {
            i: (s["refreshes"], s["gap"]) for i, s in ref_stats.items()
        }
        assert max(s["gap"] for s in stats.values()) > SETTINGS["update_proj_gap"]  # it adapted
        for (name, p), q in zip(sharded.named_parameters(), reference.parameters(), strict=True):
            diff = (p.full_tensor() - q).abs().max().item()
            assert diff <= 1e-5, f"{projector} rank {rank}/{world}: {name} differs by {diff:.2e}"
