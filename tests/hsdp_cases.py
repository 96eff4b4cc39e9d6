"""Workers for test_hsdp.py: HSDP (2-D mesh replicate × shard) vs a single-process run.

Four ranks form a 2×2 mesh: ``fully_shard(..., mesh=mesh)`` with a 2-D mesh shards each
parameter over the "shard" dimension and replicates it over "replicate" (HSDP). Every rank
trains on its own quarter of each batch, so the two replica groups see different data and
only FSDP2's all-reduce over the replicate dimension makes their gradients (and so their
GaLore bases) agree.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from .fsdp_cases import make_model, optimizer, shard, train

CONFIGS = [{"projector": "svd"}, {"projector": "randomized"}]


def _gather(t: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return parts


def hsdp_matches_single_process(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    assert world == 4
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replicate_group = mesh.get_group("replicate")
    for settings in CONFIGS:
        reference = make_model()
        hsdp = copy.deepcopy(reference)
        train(reference, optimizer(reference, settings))
        shard(hsdp, mesh)
        for name, p in hsdp.named_parameters():  # the layout under test really is HSDP
            assert isinstance(p, DTensor) and p.device_mesh.ndim == 2, name
            assert tuple(p.placements) == (Replicate(), Shard(0)), (name, p.placements)
        opt = optimizer(hsdp, settings)
        train(hsdp, opt, rank, world)  # rank r trains on rows [3r, 3r + 3) of each batch

        for (name, p), q in zip(hsdp.named_parameters(), reference.parameters(), strict=True):
            diff = (p.full_tensor() - q).abs().max().item()
            assert diff <= 1e-5, f"{settings} rank {rank}: {name} differs by {diff:.2e}"
        moved = max(
            (p.full_tensor() - q).abs().max().item()
            for p, q in zip(hsdp.parameters(), make_model().parameters(), strict=True)
        )
        assert moved > 1e-3, moved

        sides = set()
        for name, p in hsdp.named_parameters():
            state = opt.state[p]
            if "galore.refreshes" in state:
                assert int(state["galore.refreshes"]) == 3, (name, int(state["galore.refreshes"]))
            # Replicas hold bitwise-identical bases (and every other state tensor).
            for key, value in state.items():
                local = value.to_local() if isinstance(value, DTensor) else value
                if key.startswith("proj."):
                    sides.add(key)
                    assert isinstance(value, DTensor) and value.device_mesh is p.device_mesh
                a, b = _gather(local, replicate_group)
                assert torch.equal(a, b), f"{settings} rank {rank}: {name} {key} differs"
        assert sides == {"proj.left", "proj.right"}, sides
