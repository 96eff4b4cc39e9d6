"""Workers for test_fsdp.py: FSDP2 runs compared with a single-process run of the same data."""

from __future__ import annotations

import copy

import torch
from torch import nn

import galore2

STEPS, GAP, RANK, BATCH = 20, 8, 3, 12  # refreshes at steps 0, 8, 16

CONFIGS = [
    {"projector": "svd"},
    {"projector": "randomized"},
    {"projector": "randomized", "moments_on_refresh": "project"},
    {"projector": "power"},
    {"projector": "random"},
]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # 7×10 (left, uneven for 2 and 3 ranks), 13×7 (right), 5×13 (left), biases plain.
    return nn.Sequential(nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))


def shard(model: nn.Module, mesh) -> nn.Module:
    """``fully_shard`` every Linear, then the root (FSDP2 on a 1-D mesh, HSDP on a 2-D one)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 10, generator=g), torch.randn(BATCH, 5, generator=g)


def optimizer(model: nn.Module, settings: dict) -> galore2.GaLoreAdamW:
    groups = galore2.param_groups(model, rank=RANK, update_proj_gap=GAP, **settings)
    return galore2.GaLoreAdamW(groups, lr=1e-2, weight_decay=0.05)


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int = 0, world: int = 1) -> None:
    per = BATCH // world
    for step in range(STEPS):
        x, y = data(step)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def fsdp_matches_single_process(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    for settings in CONFIGS:
        reference = make_model()
        sharded = copy.deepcopy(reference)
        train(reference, optimizer(reference, settings))
        shard(sharded, mesh)
        opt = optimizer(sharded, settings)
        train(sharded, opt, rank, world)
        for (name, p), q in zip(sharded.named_parameters(), reference.parameters(), strict=True):
            diff = (p.full_tensor() - q).abs().max().item()
            assert diff <= 1e-5, f"{settings} rank {rank}/{world}: {name} differs by {diff:.2e}"
        refreshes = [
            int(s["galore.refreshes"]) for s in opt.state.values() if "galore.refreshes" in s
        ]
        assert refreshes and all(r == 3 for r in refreshes), refreshes
        assert (
            max(
                (p.full_tensor() - q).abs().max().item()
                for p, q in zip(sharded.parameters(), make_model().parameters(), strict=True)
            )
            > 1e-3
        )


def exact_refresh_is_split_and_batched(rank: int, world: int) -> None:
    """Each due matrix is factored once, by its owner; gathers all precede the SVDs."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from galore2.fsdp.placement import ShardedPlacement
    from galore2.projectors.svd import SVDProjector

    events: list[str] = []
    real_svd, real_gather, real_bcast = (
        SVDProjector._svd,
        ShardedPlacement.gather_rows,
        ShardedPlacement.broadcast,
    )
    SVDProjector._svd = staticmethod(lambda *a: (events.append("svd"), real_svd(*a))[1])
    ShardedPlacement.gather_rows = lambda self, *a: (
        events.append("gather"),
        real_gather(self, *a),
    )[1]
    ShardedPlacement.broadcast = lambda self, *a: (events.append("bcast"), real_bcast(self, *a))[1]
    try:
        model = make_model()
        mesh = init_device_mesh("cpu", (world,))
        shard(model, mesh)
        opt = optimizer(model, {"projector": "svd"})
        x, y = data(0)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()  # step 0: every matrix refreshes
    finally:
        SVDProjector._svd, ShardedPlacement.gather_rows, ShardedPlacement.broadcast = (
            real_svd,
            real_gather,
            real_bcast,
        )
    matrices = 3
    assert events.count("gather") == matrices and events.count("bcast") == matrices
    last_gather = max(i for i, e in enumerate(events) if e == "gather")
    assert all(i > last_gather for i, e in enumerate(events) if e == "svd")
    counts = torch.tensor([events.count("svd")])
    dist.all_reduce(counts)
    assert int(counts) == matrices  # factored once each, not once per rank
