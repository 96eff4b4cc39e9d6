"""Workers for test_ranger_modules.py, and the ChainOptimizer builder its tests share."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from galore2.optim import ChainOptimizer, ScaleByAdam
from galore2.optim.gradient import AdaptiveGradientClipping, CentralizeGradient, NormalizeGradient
from galore2.optim.weights import Lookahead, NormLoss, StableWeightDecay

from ..dist import assert_params_match, cpu_mesh, make_model, shard, sharded_vs_single, train


def chain_optimizer(
    params, grad_transforms=(), param_transforms=(), **settings: Any
) -> ChainOptimizer:
    """``ChainOptimizer([ScaleByAdam()])`` with the defaults GaLoreAdamW builds plus the
    module keys; ``settings`` override any default."""
    defaults: dict[str, Any] = {
        "lr": 1e-2,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.0,
        **settings,
    }
    return ChainOptimizer(
        params,
        chain=[ScaleByAdam()],
        defaults=defaults,
        grad_transforms=list(grad_transforms),
        param_transforms=list(param_transforms),
    )


def all_modules(slow_dtype: str | None = None) -> dict[str, list]:
    return {
        "grad_transforms": [AdaptiveGradientClipping(), CentralizeGradient(), NormalizeGradient()],
        "param_transforms": [NormLoss(), StableWeightDecay(), Lookahead(slow_dtype)],
    }


def _optimizer(model: nn.Module) -> ChainOptimizer:
    """Matrices and vectors in separate groups with different settings; every module on,
    strong enough to matter (AGC clips, norm loss moves weights, lookahead syncs)."""
    mats = [p for p in model.parameters() if p.dim() >= 2]
    vecs = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": mats},
        {"params": vecs, "agc_clip": 0.2, "lookahead_alpha": 0.8, "lr": 2e-2},
    ]
    settings = {"agc_clip": 0.05, "norm_loss_factor": 0.05, "weight_decay": 0.1}
    return chain_optimizer(groups, **all_modules(), lookahead_k=3, **settings)


def _galore_ranger21(model: nn.Module) -> ChainOptimizer:
    """The GaLoreRanger21 preset, every component on: PNM + softplus in the subspace."""
    import galore2

    mats = [p for p in model.parameters() if p.dim() >= 2]
    vecs = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": mats, "rank": 3, "update_proj_gap": 3}, {"params": vecs}]
    return galore2.GaLoreRanger21(
        groups, lr=1e-2, num_iterations=8, weight_decay=0.1, lookahead_k=3,
        warmup_iterations=2, agc_clip=0.05, norm_loss_factor=0.05,
    )  # fmt: skip


BUILDERS = {"modules": lambda m: _optimizer(m), "galore_ranger21": _galore_ranger21}
STEPS = 8


def fsdp_matches_single_process(rank: int, world: int, which: str = "modules") -> None:
    mesh = cpu_mesh(world)
    sharded, opt, reference, _ = sharded_vs_single(
        rank, world, lambda m: shard(m, mesh), BUILDERS[which], run=partial(train, steps=STEPS)
    )
    assert_params_match(sharded, reference, 1e-5, f"rank {rank}/{world}")
    for (name, p), p0 in zip(sharded.named_parameters(), make_model().parameters(), strict=True):
        assert (p.full_tensor() - p0).abs().max().item() > 1e-3, name  # it did train
    steps = [int(s["lookahead.step"]) for s in opt.state.values()]
    assert steps == [STEPS] * len(steps), steps
    slow = [s["lookahead.slow"] for s in opt.state.values()]
    assert all(type(t).__name__ == "DTensor" for t in slow)  # sharded like the parameter
    torch.distributed.barrier()
