"""Decoupled weight decay is a module: it declares ``weight_decay``, the step applies its
factor and hands it to the chain (GaLore folds it); stable weight decay replaces it."""

from __future__ import annotations

import copy

import pytest
import torch

import galore2
from galore2.core.modules import WEIGHT_DECAY, DecoupledWeightDecay
from galore2.core.transform import walk
from galore2.optim import ChainOptimizer, GaLore, ScaleByAdam
from galore2.optim.weights import NormLoss, StableWeightDecay
from galore2.presets import PRESETS

from ..helpers import TinyNet, galore_groups, train

ADAM = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8}


def test_weight_decay_is_declared_once_by_the_decay_module():
    assert DecoupledWeightDecay.options == (WEIGHT_DECAY,)
    assert all(o.name != "weight_decay" for o in ChainOptimizer.options)  # not the loop's
    assert any(o is WEIGHT_DECAY for o in StableWeightDecay.options)  # the same object
    for cls in (ChainOptimizer, *PRESETS.values()):
        assert cls.declared_options()["weight_decay"] is WEIGHT_DECAY, cls.__name__
        declared = {id(o) for m in walk(cls.modules) for o in m.options if o.name == "weight_decay"}
        assert declared == {id(WEIGHT_DECAY)}, cls.__name__
    # a preset still takes it as a keyword, with its default, and validates it
    assert galore2.GaLoreAdamW([torch.nn.Parameter(torch.ones(2))]).defaults["weight_decay"] == 1e-2
    with pytest.raises(ValueError, match="weight_decay"):
        galore2.Ranger21([torch.nn.Parameter(torch.ones(2))], weight_decay=-1.0)


def test_chain_optimizer_has_decoupled_decay_unless_a_weight_module_reads_weight_decay():
    p = torch.nn.Parameter(torch.ones(3))
    mine = ChainOptimizer([p], [ScaleByAdam()], {**ADAM, "weight_decay": 0.1})
    assert isinstance(mine._decay, DecoupledWeightDecay)
    swd = ChainOptimizer(
        [p], [ScaleByAdam()], {**ADAM, "weight_decay": 0.1}, param_transforms=[StableWeightDecay()]
    )
    assert swd._decay is None and swd.declared["weight_decay"] is WEIGHT_DECAY
    with pytest.raises(ValueError, match="decay=None"):  # both would decay the weights
        ChainOptimizer(
            [p], [ScaleByAdam()], ADAM, param_transforms=[StableWeightDecay()],
            decay=DecoupledWeightDecay(),
        )  # fmt: skip
    with pytest.raises(TypeError, match="decay must be"):
        ChainOptimizer([p], [ScaleByAdam()], ADAM, decay=0.1)  # type: ignore[arg-type]
    # no module would apply it: refused, not ignored (0.0 is fine)
    with pytest.raises(ValueError, match=r"weight_decay=0.1 would be ignored"):
        ChainOptimizer([p], [ScaleByAdam()], {**ADAM, "weight_decay": 0.1}, decay=None)
    assert ChainOptimizer([p], [ScaleByAdam()], {**ADAM, "weight_decay": 0.0}, decay=None)
    ranger = galore2.Ranger21([p], num_iterations=10)
    assert ranger._decay is None  # stable weight decay (the default) replaces it
    assert isinstance(
        galore2.Ranger21([p], num_iterations=10, use_stable_weight_decay=False)._decay,
        DecoupledWeightDecay,
    )
    assert copy.deepcopy(mine)._decay is not None and copy.deepcopy(swd)._decay is None


def test_ranger21_step_with_stable_weight_decay_decays_once():
    """One Ranger21 step with only stable weight decay on is Adam's step times
    1 − lr·λ/σ, σ = √(Σ v̂ / Σ numel) — no decoupled decay on top (no double decay)."""
    torch.manual_seed(0)
    w = torch.randn(6, 5, dtype=torch.float64)
    b = torch.randn(5, dtype=torch.float64)
    g = [torch.randn(6, 5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)]
    off = {
        f"use_{k}": False
        for k in ("agc", "gc", "gn", "pnm", "norm_loss", "lookahead", "warmup", "warmdown")
    }
    off["softplus"] = False
    lr, lam = 1e-2, 0.5
    params = [torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())]
    opt = galore2.Ranger21(params, lr=lr, weight_decay=lam, state_dtype="float64", **off)
    ref = [torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())]
    adam = torch.optim.Adam(ref, lr=lr)
    for p, q, grad in zip(params, ref, g, strict=True):
        p.grad, q.grad = grad.clone(), grad.clone()
    opt.step()
    adam.step()
    v_hat = sum(s["exp_avg_sq"].sum() / (1 - 0.999) for s in adam.state.values())
    sigma = (v_hat / sum(p.numel() for p in ref)).sqrt().item()
    factor = 1 - lr * lam / sigma
    assert factor < 1 - 1e-4  # a visible decay
    for p, q in zip(params, ref, strict=True):
        torch.testing.assert_close(p.detach(), q.detach() * factor, rtol=1e-14, atol=0)
        # decoupled decay on top would be off by a factor 1 − lr·λ
        assert not torch.allclose(p.detach(), q.detach() * factor * (1 - lr * lam), rtol=1e-6)


class _Spy(GaLore):
    """GaLore recording the decay factor the step hands it."""

    def __init__(self, inner, seen: list[float]) -> None:
        super().__init__(inner)
        self.seen = seen

    def update(self, u, state, group, ctx, decay=1.0):
        self.seen.append(decay)
        return super().update(u, state, group, ctx, decay=decay)

    def update_many(self, us, states, group, ctxs, decay=1.0):
        self.seen.append(decay)
        return super().update_many(us, states, group, ctxs, decay=decay)


@pytest.mark.parametrize("foreach", [False, True])
def test_galore_receives_the_step_decay_factor_and_one_without_a_decay_module(foreach):
    lr, lam = 1e-2, 0.1
    runs = {}
    for name, settings, transforms, decay in (
        ("decoupled", {"weight_decay": lam}, [], "auto"),
        ("none", {}, [], None),
        ("zero", {"weight_decay": 0.0}, [], "auto"),  # what the loop's group mutation gave
        ("stable", {"weight_decay": lam}, [StableWeightDecay()], "auto"),
        ("stable_zero", {"weight_decay": 0.0}, [StableWeightDecay()], "auto"),
    ):
        torch.manual_seed(0)
        model = TinyNet().double()
        seen: list[float] = []
        opt = ChainOptimizer(
            galore_groups(model, rank=4, update_proj_gap=2),
            [_Spy(ScaleByAdam(), seen)],
            {**ADAM, "lr": lr, "foreach": foreach, "state_dtype": "float64", **settings},
            param_transforms=[NormLoss(), *transforms],
            decay=decay,
        )
        train(model, opt, range(3))
        runs[name] = (seen, [p.detach().clone() for p in model.parameters()])
    assert set(runs["decoupled"][0]) == {1.0 - lr * lam}
    for name in ("none", "zero", "stable", "stable_zero"):
        assert set(runs[name][0]) == {1.0}, name
    # no decay module: the same bits as weight_decay=0 (the step and GaLore both fold 1.0)
    for a, b in zip(runs["none"][1], runs["zero"][1], strict=True):
        assert torch.equal(a, b)
    # stable weight decay with λ = 0: nothing decays either
    for a, b in zip(runs["stable_zero"][1], runs["zero"][1], strict=True):
        assert torch.equal(a, b)
