"""Workers for test_tucker.py: Tucker-projected 3-D / 4-D weights under FSDP2 equal one process."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

import galore2

from .. import dist as shared

STEPS, GAP, RANK, BATCH = 10, 4, 3, 8  # refreshes at steps 0, 4, 8

CONFIGS = [
    {"projector": "svd"},
    {"projector": "randomized", "moments_on_refresh": "project"},
    {"projector": "power"},
    {"projector": "random", "moments_on_refresh": "reset"},
]


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # (7, 4, 3, 3), rank 3: modes 0 and 1 cut (7 rows: uneven over 2 ranks), kernel kept
        self.weight = nn.Parameter(0.2 * torch.randn(7, 4, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(nn.functional.conv2d(x, self.weight)).mean(dim=(2, 3))  # (B, 7)


class Mix(nn.Module):
    def __init__(self, shape: tuple[int, ...], spec: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(0.3 * torch.randn(shape))
        self.spec = spec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.einsum(self.spec, x, self.weight).flatten(1))


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        Conv(),
        Mix((5, 7, 4), "bi,eio->beo"),  # every mode cut (5 = 3 + 2 rows)
        Mix((2, 20, 6), "bk,gko->bgo"),  # 2 ≤ rank: mode 0 kept, the core is row-sharded
        nn.Linear(12, 5),  # a matrix beside them
    )


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(BATCH, 4, 5, 5, generator=g), torch.randn(BATCH, 5, generator=g)


def groups(model: nn.Module, settings: dict) -> list[dict]:
    mats = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": mats, "rank": RANK, "update_proj_gap": GAP, **settings}, {"params": rest}]


def optimizer(model: nn.Module, settings: dict) -> galore2.GaLoreAdamW:
    return galore2.GaLoreAdamW(groups(model, settings), lr=1e-2, weight_decay=0.05)


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int = 0, world: int = 1) -> None:
    shared.train(model, opt, STEPS, rank, world, data=data)


def shard(model: nn.Sequential, mesh) -> nn.Sequential:
    return shared.shard(model, mesh, units=list(model))  # every layer a unit


def fsdp_tucker_matches_single_process(rank: int, world: int) -> None:
    mesh = shared.cpu_mesh(world)
    for settings in CONFIGS:
        sharded, opt, reference, _ = shared.sharded_vs_single(
            rank, world, lambda m: shard(m, mesh), partial(optimizer, settings=settings),
            model=make_model, run=train,
        )  # fmt: skip
        shared.assert_params_match(sharded, reference, 1e-5, f"{settings} rank {rank}/{world}")
        tucker = [s for s in opt.state.values() if int(s.get("galore.side", -1)) == 4]
        assert len(tucker) == 3
        assert all(int(s["galore.refreshes"]) == 3 for s in tucker)
        assert shared.max_change(sharded, make_model()) > 1e-3


TRAFFIC_CONFIGS = [
    {"projector": "randomized", "moments_on_refresh": "project", "update_proj_gap": 2},
    {"projector": "power", "update_proj_gap": 2},
    {"projector": "svd", "update_proj_gap": 2},
    {"projector": "random", "update_proj_gap": 2},
]


def traffic_matches_collective_bytes(rank: int, world: int) -> None:
    """``galore2.traffic.collective_bytes`` predicts the collectives a Tucker run issues."""
    from collections import Counter

    from galore2.traffic import collective_bytes

    from .test_fsdp_traffic import _SINK, _diff, _keys, _wrap_placement

    mesh = shared.cpu_mesh(world)
    undo = _wrap_placement()
    errors = []
    try:
        for settings in TRAFFIC_CONFIGS:
            with torch.device("meta"):
                meta = make_model()
                expected = collective_bytes(meta, world, groups=groups(meta, settings))
            model = shard(make_model(), mesh)
            opt = optimizer(model, settings)
            wants = [
                _keys(expected.step) + _keys(expected.first_refresh),
                _keys(expected.step),
                _keys(expected.step) + _keys(expected.refresh),
            ]
            for step, want in enumerate(wants):
                x, y = (shared.split(t, rank, world) for t in data(step))
                _SINK[0] = []
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                got = Counter(_SINK[0])
                if got != want:
                    errors.append(f"{settings} step {step}: {_diff(got, want)}")
    finally:
        undo()
    assert not errors, "\n".join(errors)


def run_all(rank: int, world: int) -> None:
    fsdp_tucker_matches_single_process(rank, world)
    traffic_matches_collective_bytes(rank, world)
