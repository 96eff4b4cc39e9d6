"""``proj_precision``: the projection matmuls in fp32, TF32 (CUDA) or bf16 (issue 28 item 4).

bf16 rounds both operands to 8 significant bits (unit roundoff 2⁻⁹ ≈ 2e-3): the projected
gradient stays within 5e-3 (relative, Frobenius; measured ≈ 2.2e-3) of the fp32 one, and
10 AdamW steps of a small MLP within 3e-2 of fp32's weight change (measured 1.7e-2: Adam's
first steps normalize R, which amplifies the rounding of its small entries). fp32 is the default and bitwise what the projection
was before the option existed; on a CPU TF32 does not exist and ``tf32`` is fp32, bitwise.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import galore2
from galore2.projectors import FULL, LEFT, RIGHT, TUCKER, Plan, TuckerProjector, get_projector
from galore2.projectors.base import projection_precision, tf32_matmuls

BF16_PROJECTION_TOL = 5e-3  # ‖R_bf16 − R_fp32‖ / ‖R_fp32‖
BF16_TRAINING_TOL = 3e-2  # ‖ΔW_bf16 − ΔW_fp32‖ / ‖ΔW_fp32‖ after 10 steps


def _state(plan: Plan, G: torch.Tensor) -> dict:
    proj = get_projector("svd")
    state: dict = {}
    proj.init_state(state, plan, {})
    proj.store(state, proj.refresh(G, state, plan, {}, seed=0), plan)
    return state


@pytest.mark.parametrize("side", [LEFT, RIGHT, FULL])
def test_bf16_projection_is_close_to_fp32_and_tf32_is_fp32_on_cpu(side):
    gen = torch.Generator().manual_seed(0)
    G = torch.randn(48, 64, generator=gen)
    plan = Plan(side, 48, 64, 8, G.device)
    state = _state(plan, G)
    proj = get_projector("svd")
    exact = proj.project(G, state, plan)
    assert exact.dtype == torch.float32
    assert torch.equal(proj.project(G, state, plan._replace(precision="tf32")), exact)
    low = proj.project(G, state, plan._replace(precision="bf16"))
    assert low.dtype == torch.float32  # the inner rule still runs in fp32
    error = float((low - exact).norm() / exact.norm())
    assert 0 < error < BF16_PROJECTION_TOL


def test_bf16_tucker_core_is_close_to_fp32():
    gen = torch.Generator().manual_seed(1)
    G = torch.randn(6, 5, 3, 3, generator=gen)
    proj = TuckerProjector(get_projector("svd"), G.shape)
    plan = Plan(TUCKER, 6, 45, 2, G.device)
    state: dict = {}
    proj.init_state(state, plan, {})
    proj.store(state, proj.refresh(G, state, plan, {}, seed=0), plan)
    exact = proj.project(G, state, plan)
    low = proj.project(G, state, plan._replace(precision="bf16"))
    assert low.dtype == torch.float32
    assert 0 < float((low - exact).norm() / exact.norm()) < BF16_PROJECTION_TOL


def _train(precision: str | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 16))
    start = [p.detach().clone() for p in model.parameters()]
    extra = {} if precision is None else {"proj_precision": precision}
    opt = galore2.GaLoreAdamW(galore2.param_groups(model, rank=4, **extra), lr=1e-3)
    gen = torch.Generator().manual_seed(2)
    for _ in range(10):
        x, y = torch.randn(8, 24, generator=gen), torch.randn(8, 16, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach() - s for p, s in zip(model.parameters(), start, strict=True)]


def test_training_with_bf16_projection_stays_close_to_fp32():
    default, fp32, bf16 = _train(None), _train("fp32"), _train("bf16")
    assert all(torch.equal(a, b) for a, b in zip(default, fp32, strict=True))  # the default
    num = sum(float((a - b).square().sum()) for a, b in zip(bf16, fp32, strict=True)) ** 0.5
    den = sum(float(a.square().sum()) for a in fp32) ** 0.5
    assert 0 < num / den < BF16_TRAINING_TOL


def test_a_bf16_gradient_is_projected_in_bf16_whatever_the_option():
    G = torch.randn(16, 24, dtype=torch.bfloat16)
    for precision in ("fp32", "tf32", "bf16"):
        dtype, _ = projection_precision(G, precision)
        assert dtype == torch.bfloat16


def test_unknown_precision_is_refused_naming_the_option():
    model = nn.Linear(16, 16)
    allowed = r"one of \('fp32', 'tf32', 'bf16'\), got 'fp16'"
    with pytest.raises(ValueError, match=f"proj_precision must be {allowed}"):
        galore2.GaLoreAdamW(galore2.param_groups(model, rank=4, proj_precision="fp16"))
    with pytest.raises(ValueError, match=f"proj_precision must be {allowed}"):
        projection_precision(torch.zeros(2, 2), "fp16")


def test_tf32_switch_is_put_back():
    flags = torch.backends.cuda.matmul
    before = flags.allow_tf32
    with tf32_matmuls(not before):
        assert flags.allow_tf32 is (not before)
    assert flags.allow_tf32 is before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TF32 exists on CUDA only")
def test_cuda_tf32_and_fp32_differ_and_leave_the_global_setting_alone():
    gen = torch.Generator().manual_seed(3)
    G = torch.randn(512, 768, generator=gen).cuda()
    plan = Plan(LEFT, 512, 768, 64, G.device)
    state = _state(plan, G)
    proj = get_projector("svd")
    before = torch.backends.cuda.matmul.allow_tf32
    fp32 = proj.project(G, state, plan)
    tf32 = proj.project(G, state, plan._replace(precision="tf32"))
    assert torch.backends.cuda.matmul.allow_tf32 is before
    P = state["proj.left"].double()
    exact = P.mT @ G.double()
    assert float((fp32 - exact).norm() / exact.norm()) < 1e-6
    assert 1e-6 < float((tf32 - exact).norm() / exact.norm()) < 5e-3
