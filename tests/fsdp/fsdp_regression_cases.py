"""Workers for test_fsdp_regressions.py (bugs found by the traffic audit)."""

from __future__ import annotations

import torch
from torch import nn

import galore2

from ..dist import full, shard


def _sharded(world: int, module: nn.Module) -> nn.Module:
    return shard(module, world, units=())  # the root only


def raise_is_collective(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = _sharded(world, nn.Linear(8, 6))
    before = model.weight.to_local().clone()
    opt = galore2.GaLoreAdamW(galore2.param_groups(model, rank=2), nonfinite="raise")
    model(torch.randn(16, 8)).square().mean().backward()
    if rank == 1:
        model.weight.grad.to_local()[0, 0] = float("nan")
    try:
        opt.step()
    except FloatingPointError:
        raised = True
    else:
        raised = False
    assert raised, f"rank {rank} did not raise"  # every rank raises, nobody hangs
    assert torch.equal(model.weight.to_local(), before)


def rank_deficient_gradient_refreshes(rank: int, world: int) -> None:
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(1))  # rank(G) ≤ 4 < k = 7

    def run(model: nn.Module) -> tuple[int, torch.Tensor]:
        opt = galore2.GaLoreAdamW(galore2.param_groups(model, rank=3, update_proj_gap=100), lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        w = model.weight
        return int(opt.state[w]["galore.refreshes"]), full(w)

    torch.manual_seed(0)
    ref = nn.Linear(10, 7)
    torch.manual_seed(0)
    sharded = _sharded(world, nn.Linear(10, 7))
    (n_ref, w_ref), (n, w) = run(ref), run(sharded)
    assert n_ref == n == 1
    assert (w - w_ref).abs().max().item() <= 1e-5


def float64_default_dtype(rank: int, world: int) -> None:
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = _sharded(world, nn.Linear(8, 12, dtype=torch.float32))
        opt = galore2.GaLoreAdamW(galore2.param_groups(model, rank=3, projector="svd"))
        model(torch.randn(6, 8, dtype=torch.float32)).square().mean().backward()
        opt.step()
        P = opt.state[model.weight]["proj.right"].to_local()
        assert P.dtype == torch.float32 and bool(torch.isfinite(P).all())
        assert (P.mT @ P - torch.eye(3, dtype=torch.float32)).norm() <= 1e-4
    finally:
        torch.set_default_dtype(torch.float32)
