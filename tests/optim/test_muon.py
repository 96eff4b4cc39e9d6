"""Orthogonalized momentum (galore2.optim.muon) against float64 references.

Newton–Schulz is a matrix polynomial, so its exact result is known from an SVD of the
input: U·p(Σ/‖X‖_F)·Vᵀ with p the scalar quintic iterated; the polar factor is U·Vᵀ.
"""

from __future__ import annotations

import copy

import pytest
import torch

import galore2
from galore2.optim.muon import NS_COEFFICIENTS, newton_schulz, polar

from ..helpers import TinyNet, galore_groups, max_diff, train


def _matrix(rows: int, cols: int, cond: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(rows, rows, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(cols, rows, generator=g, dtype=torch.float64))
    s = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), rows, dtype=torch.float64)
    return (U * s) @ V.mT


def _quintic(x: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return x


@pytest.mark.parametrize(("rows", "cols", "cond"), [(8, 40, 10.0), (16, 64, 100.0), (1, 30, 1.0)])
def test_newton_schulz_is_the_quintic_applied_to_singular_values(rows, cols, cond):
    X = _matrix(rows, cols, cond, seed=rows)
    U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    expected = (U * _quintic(S / X.norm(), 5)) @ Vh
    got = newton_schulz(X, 5)
    assert got.dtype == torch.float64
    assert (got - expected).abs().max().item() <= 1e-12
    # the bound the docstring states: singular values in [0.68, 1.21] for σ/‖X‖_F >= 2e-3
    sv = torch.linalg.svdvals(got)
    assert (S / X.norm()).min() >= 2e-3
    assert sv.min().item() >= 0.68 and sv.max().item() <= 1.21


def test_newton_schulz_in_float32_is_close_to_float64():
    X = _matrix(16, 64, 100.0, seed=1)
    err = (newton_schulz(X.float(), 5).double() - newton_schulz(X, 5)).abs().max().item()
    assert err <= 1e-5


@pytest.mark.parametrize("cond", [1.0, 1e3, 1e5])
def test_polar_is_exact(cond):
    X = _matrix(12, 50, cond, seed=2)
    U, _, Vh = torch.linalg.svd(X, full_matrices=False)
    assert (polar(X) - U @ Vh).abs().max().item() <= 1e-9 * cond
    f32 = polar(X.float())
    assert f32.dtype == torch.float32
    assert (f32.double() - U @ Vh).abs().max().item() <= 1e-5 * cond


def test_polar_and_newton_schulz_are_finite_on_zero_and_rank_deficient_input():
    zero = torch.zeros(4, 10)
    assert torch.equal(polar(zero), zero) and torch.equal(newton_schulz(zero), zero)
    X = _matrix(4, 10, 1.0, seed=3)
    X[2:] = 0  # rank 2
    P = polar(X)
    assert torch.isfinite(P).all()
    assert torch.allclose(torch.linalg.svdvals(P), torch.tensor([1.0, 1, 0, 0], dtype=X.dtype))


def test_full_rank_galore_muon_is_torch_muon(monkeypatch):
    """rank ≥ min(m, n): a matrix gets full-rank Muon — torch.optim.Muon's update, once
    torch's Newton–Schulz runs in float32 as ours does (torch's runs in bfloat16)."""

    def float32_ns(grad, ns_coefficients, ns_steps, eps):
        assert ns_coefficients == NS_COEFFICIENTS
        tall = grad.size(0) > grad.size(1)
        out = newton_schulz(grad.mT if tall else grad, ns_steps)
        return out.mT if tall else out

    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", float32_ns)
    torch.manual_seed(0)
    a = torch.nn.Linear(24, 40, bias=False)
    b = copy.deepcopy(a)
    start = copy.deepcopy(a)
    ours = galore2.GaLoreMuon([{"params": [a.weight], "rank": 64}], lr=1e-2, weight_decay=0.1)
    ref = torch.optim.Muon([b.weight], lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    x = torch.randn(16, 24)
    for _ in range(5):
        for model, opt in ((a, ours), (b, ref)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    assert (a.weight - b.weight).abs().max().item() <= 1e-6
    assert (a.weight - start.weight).abs().max().item() > 1e-2


@pytest.mark.parametrize("orthogonalize", ["newton_schulz", "polar"])
def test_galore_muon_trains_and_keeps_one_low_rank_moment(orthogonalize):
    torch.manual_seed(0)
    model = TinyNet()
    start = copy.deepcopy(model)
    opt = galore2.GaLoreMuon(
        galore_groups(model, rank=6, update_proj_gap=5, orthogonalize=orthogonalize), lr=1e-2
    )
    losses = train(model, opt, range(20))
    assert losses[-1] < losses[0]
    for p in (model.up.weight, model.mid.weight, model.down.weight):
        state = opt.state[p]
        muon_keys = {k for k in state if k.startswith(("muon.", "adam."))}
        assert muon_keys == {"muon.momentum", "muon.split_dim"}  # no Adam moments
        m, n = p.shape
        assert state["muon.momentum"].shape == ((m, 6) if m >= n else (6, n))
    assert "adam.exp_avg" in opt.state[model.norm.weight]  # groups without rank: AdamW
    assert max_diff(model, start) > 1e-2


def test_polar_and_newton_schulz_are_different_updates():
    results = []
    for orthogonalize in ("newton_schulz", "polar"):
        torch.manual_seed(0)
        model = TinyNet()
        opt = galore2.GaLoreMuon(galore_groups(model, rank=6, orthogonalize=orthogonalize), lr=1e-2)
        train(model, opt, range(3))
        results.append(model)
    assert max_diff(*results) > 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_polar_of_a_rank_deficient_product_drops_the_null_directions(dtype):
    """(4 × 2) @ (2 × 10) has rank 2, but rounding leaves σ₃, σ₄ tiny rather than zero (rows
    set to zero, above, are exactly zero): the relative eigenvalue cutoff must drop them."""
    g = torch.Generator().manual_seed(7)
    X = torch.randn(4, 2, generator=g, dtype=dtype) @ torch.randn(2, 10, generator=g, dtype=dtype)
    sigma = torch.linalg.svdvals(polar(X).double())
    expected = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    assert torch.allclose(sigma, expected, atol=1e-5 if dtype == torch.float32 else 1e-10)
