"""Fira's residual compensation and APOLLO's scaling (galore2.optim.residual): the limiter,
finite updates from degenerate gradients, clear errors, composition with other storage."""

from __future__ import annotations

import copy

import pytest
import torch

import galore2
from galore2.optim.residual import LIMIT_KEY
from galore2.projectors import LEFT

from ..helpers import TinyNet, galore_groups, max_diff, train

VARIANTS = {
    "fira": (galore2.Fira, {}),
    "apollo": (galore2.APOLLO, {}),
    "apollo_mini": (galore2.APOLLOMini, {}),
}


def _step(p: torch.nn.Parameter, opt: torch.optim.Optimizer, grad: torch.Tensor) -> None:
    p.grad = grad.clone()
    opt.step()


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("shape", [(40, 24), (12, 40)])  # a right and a left basis
@pytest.mark.parametrize("limit", [1.01, None])
def test_degenerate_gradients_give_finite_bounded_updates(name, shape, limit):
    """A zero gradient (R = 0 and no residual) and a gradient orthogonal to the basis (R = 0,
    φ = ‖N‖/ε huge) never put a non-finite value into weights or state; with the limiter the
    second one's update grows at most γ× over the previous step's."""
    cls, kw = VARIANTS[name]
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(shape))
    rank = 1 if name == "apollo_mini" else 4
    opt = cls([{"params": [p], "rank": rank, "update_proj_gap": 100,
                "norm_growth_limit": limit}], lr=1e-2, **kw)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        _step(p, opt, torch.randn(shape, generator=g))
    state = opt.state[p]
    _step(p, opt, torch.zeros(shape))
    assert torch.isfinite(p).all() and float(state[LIMIT_KEY]) == 0.0  # S = 0
    _step(p, opt, torch.randn(shape, generator=g))  # prev = 0: no limit, a fresh start
    before = p.detach().clone()
    prev = float(state[LIMIT_KEY])
    # a gradient the basis does not see: R = PᵀG = 0 (left) / G·Q = 0 (right)
    G = torch.randn(shape, generator=g)
    if int(state["galore.side"]) == LEFT:
        P = _basis(opt, p, "left")
        G = G - P @ torch.linalg.lstsq(P, G).solution
    else:
        Q = _basis(opt, p, "right")
        G = G - torch.linalg.lstsq(Q, G.mT).solution.mT @ Q.mT
    _step(p, opt, G)
    assert torch.isfinite(p).all()
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    if limit is not None:
        assert float(state[LIMIT_KEY]) <= limit * prev * (1 + 1e-6)
        assert (p - before).norm() < 10 * before.norm()


def _basis(opt: torch.optim.Optimizer, p: torch.Tensor, side: str) -> torch.Tensor:
    """The dense basis (a stored one, or the random projector's regenerated one)."""
    galore = opt._chain[0]
    state = opt.state[p]
    plan = galore.plan(state, opt.param_groups[0], opt._engine.context(p, 0))
    P, Q = galore2.projectors.get_projector(opt.param_groups[0]["projector"]).bases(state, plan)
    return P if side == "left" else Q


def test_limiter_holds_the_growth_to_gamma():
    """A 100× gradient spike: the residual's (bias-free) norm grows by exactly γ that step."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(40, 24))
    opt = galore2.Fira([{"params": [p], "rank": 4, "update_proj_gap": 100}], lr=1e-3)
    g = torch.Generator().manual_seed(2)
    norms = []
    for step in range(6):
        grad = torch.randn(40, 24, generator=g) * (100.0 if step == 4 else 1.0)
        _step(p, opt, grad)
        norms.append(float(opt.state[p][LIMIT_KEY]))
    assert norms[4] == pytest.approx(1.01 * norms[3], rel=1e-9)
    assert all(n > 0 for n in norms)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"residual": "fira", "scale_type": "channel"}, "two alternatives"),
        ({"residual": "fira", "proj_type": "full"}, "one-sided projection"),
        ({"scale_type": "tensor", "proj_type": "full"}, "one-sided projection"),
        ({"residual": "fira", "projector": "random"}, "orthonormal basis"),
        ({"residual": "bogus"}, "residual must be one of"),
        ({"norm_growth_limit": 0.5}, "norm_growth_limit must be"),
    ],
)
def test_bad_settings_raise_naming_them(settings, match):
    model = TinyNet()
    with pytest.raises(ValueError, match=match):
        galore2.GaLoreAdamW(galore_groups(model, rank=4, **settings))


def test_a_tensor_weight_under_tucker_is_refused_before_any_state():
    conv = torch.nn.Conv2d(4, 8, 3)
    with pytest.raises(ValueError, match="tensor_projection='matrix'"):
        galore2.Fira([{"params": [conv.weight], "rank": 2}])
    opt = galore2.Fira([{"params": [conv.weight], "rank": 2, "tensor_projection": "matrix"}])
    conv.weight.grad = torch.randn_like(conv.weight)
    opt.step()
    assert LIMIT_KEY in opt.state[conv.weight]


@pytest.mark.parametrize(
    "settings",
    [
        {"residual": "fira", "basis_dtype": "int4", "basis_hadamard": True},
        {"residual": "fira", "basis_dtype": "int8"},
        {"projector": "random", "scale_type": "channel", "scale": 1.0},
        {"projector": "random", "scale_type": "tensor", "scale": 128**0.5, "rank": 1},
    ],
    ids=["fira-int4-hadamard", "fira-int8", "apollo", "apollo_mini"],
)
def test_composes_with_8bit_moments_and_quantized_bases(settings):
    """With 8-bit moments on matrices big enough to be quantized (≥ 4096 low-rank elements)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 8))
    start = copy.deepcopy(model)
    settings = {"rank": 16, "update_proj_gap": 4, **settings}
    mats = [model[0].weight, model[2].weight]
    rest = [model[0].bias, model[2].bias]
    opt = galore2.GaLoreAdamW8bit([{"params": mats, **settings}, {"params": rest}], lr=3e-3)
    x, y = torch.randn(64, 256), torch.randn(64, 8)
    losses = []
    for _ in range(12):
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]
    state = opt.state[model[0].weight]
    # really 8-bit (rank-1 moments are blocked along the rank axis, length 1: they stay fp32)
    assert state["adam.exp_avg"].dtype == (torch.uint8 if settings["rank"] > 1 else torch.float32)
    assert LIMIT_KEY in state
    assert max_diff(model, start) > 1e-3


def test_limit_norm_is_counted_and_resumes():
    torch.manual_seed(0)
    model = TinyNet()
    opt = galore2.Fira(galore_groups(model, rank=4), lr=1e-3)
    train(model, opt, range(3))
    assert opt.state_bytes()["other"] > 0
    saved = copy.deepcopy(opt.state_dict())
    twin = copy.deepcopy(model)
    opt2 = galore2.Fira(galore_groups(twin, rank=4), lr=1e-3)
    opt2.load_state_dict(saved)
    train(model, opt, range(3, 6))
    train(twin, opt2, range(3, 6))
    assert max_diff(model, twin) == 0.0
    with pytest.raises(ValueError, match="residual"):
        galore2.GaLoreAdamW(galore_groups(TinyNet(), rank=4)).load_state_dict(saved)

