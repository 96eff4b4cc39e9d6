"""APOLLO's update ``G ⊙ factor`` kept as its operands (:class:`galore2.core.ScaledUpdate`):
applied by one ``addcmul_`` into the weight, rounded once into a 16-bit weight, masked by
its factor on the capturable path, and the same as the dense update it replaces."""

from __future__ import annotations

import pytest
import torch

import galore2
from galore2.core.apply import apply_masked, apply_update
from galore2.core.masked import FlagBuffer
from galore2.core.transform import LowRankUpdate, ResidualUpdate, ScaledUpdate, dense

FACTORS = {"column": (1, 48), "row": (64, 1), "matrix": (1, 1)}


def _operands(factor_shape, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(7)
    p = torch.randn(64, 48, generator=g).to(dtype)
    G = torch.randn(64, 48, generator=g).to(dtype)
    f = torch.rand(*factor_shape, generator=g) + 0.5  # float32, as APOLLO's φ
    return p, G, f


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of bf16 (8 significant bits) at each |x|."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


@pytest.mark.parametrize("kind", FACTORS)
@pytest.mark.parametrize("decay", [1.0, 0.9])
def test_a_16_bit_weight_takes_the_update_rounded_once(kind, decay):
    """p ← decay·p − lr·G·f for a bf16 weight: within two bf16 ulps of the float64 result
    (the product formed in float32 and rounded into the weight once gives one; the second
    allows a CPU kernel that rounds an intermediate; decay is its own rounding, as for a
    dense update)."""
    p, G, f = _operands(FACTORS[kind])
    lr = 0.37
    decayed = p.double() if decay == 1.0 else (p * decay).double()  # the weight's own rounding
    want = decayed - lr * G.double() * f.double()
    apply_update(p, ScaledUpdate(G, f, p.shape), lr, decay)
    assert p.dtype == torch.bfloat16
    assert ((p.double() - want).abs() <= 2 * _bf16_ulp(want)).all()


@pytest.mark.parametrize("kind", FACTORS)
def test_dense_is_the_product_it_stands_for(kind):
    _, G, f = _operands(FACTORS[kind])
    u = ScaledUpdate(G, f, torch.Size([8, 8, 48]))
    out = dense(u)
    assert out.dtype == torch.float32 and out.shape == (8, 8, 48)
    assert torch.equal(out, torch.mul(G, f).view(8, 8, 48))


def test_a_float32_weight_agrees_with_the_dense_update_to_float32_rounding():
    p, G, f = _operands(FACTORS["column"], torch.float32)
    dense_p = p.clone()
    lr = 0.37
    apply_update(p, ScaledUpdate(G, f, p.shape), lr, 1.0)
    apply_update(dense_p, torch.mul(G, f), lr, 1.0)
    eps = torch.finfo(torch.float32).eps
    bound = 2 * eps * (dense_p.abs() + lr * (G * f).abs())
    assert ((p - dense_p).abs() <= bound).all()


def test_a_non_contiguous_weight_takes_the_dense_update():
    p, G, f = _operands(FACTORS["column"], torch.float32)
    base = p.t().contiguous().t()  # the same values, transposed strides
    assert not base.is_contiguous()
    apply_update(base, ScaledUpdate(G, f, p.shape), 0.5, 1.0)
    apply_update(p, torch.mul(G, f), 0.5, 1.0)
    assert torch.equal(base, p)


def test_masked_apply_leaves_a_masked_weight_and_steps_the_other():
    """The capturable path multiplies the factor by the parameter's device flag: 0 leaves the
    weight bitwise, 1 gives apply_update's bits."""
    (p0, G0, f0), (p1, G1, f1) = _operands((1, 48)), _operands((64, 1))
    want0, want1 = p0.clone(), p1.clone()
    apply_update(want1, ScaledUpdate(G1, f1, p1.shape), 0.25, 1.0)
    flags = FlagBuffer(2, torch.device("cpu"))
    flags.write(torch.tensor([False, True]), torch.tensor([True, False]), same=False)
    updates = [ScaledUpdate(G0, f0, p0.shape), ScaledUpdate(G1, f1, p1.shape)]
    apply_masked([p0, p1], updates, 0.25, flags, [0, 1], None)
    assert torch.equal(p0, want0) and torch.equal(p1, want1)


def _residual(m: int, n: int, seed: int) -> tuple[torch.Tensor, ResidualUpdate]:
    g = torch.Generator().manual_seed(seed)
    p, A, B, G = (torch.randn(s, generator=g) for s in ((m, n), (m, 2), (2, n), (m, n)))
    f = torch.rand(1, n, generator=g)
    return p, ResidualUpdate(LowRankUpdate(A, B, p.shape, 0.5), ScaledUpdate(G, f, p.shape))


def test_a_residual_update_is_its_two_parts():
    """Fira's update along the data, ``scale·A@B + G ⊙ f`` (ResidualUpdate): applied alone
    (``p ← decay·p − lr·u``) and made dense, within float32's rounding of the float64
    result; on the capturable path a masked parameter keeps its bits and the other gets
    apply_update's."""
    p, u = _residual(6, 5, 0)
    low, high = u.low, u.scaled
    want = 0.5 * low.A.double() @ low.B.double() + high.G.double() * high.factor.double()
    torch.testing.assert_close(u.dense().double(), want, rtol=1e-6, atol=1e-6)
    q = p.clone()
    apply_update(q, u, 0.1, 0.9)
    torch.testing.assert_close(q.double(), 0.9 * p.double() - 0.1 * want, rtol=1e-6, atol=1e-6)
    (p0, u0), (p1, u1) = _residual(6, 5, 1), _residual(6, 5, 2)
    want0, want1 = p0.clone(), p1.clone()
    apply_update(want1, u1, 0.25, 1.0)
    flags = FlagBuffer(2, torch.device("cpu"))
    flags.write(torch.tensor([False, True]), torch.tensor([True, False]), same=False)
    apply_masked([p0, p1], [u0, u1], 0.25, flags, [0, 1], None)
    assert torch.equal(p0, want0) and torch.equal(p1, want1)


@pytest.mark.parametrize("preset", [galore2.APOLLO, galore2.APOLLOMini])
def test_apollo_batched_bf16_weights_match_the_per_tensor_path(preset):
    """APOLLO / APOLLO-Mini over bf16 weights, foreach=True (the update applied as its
    operands) against foreach=False (a dense float32 update): 5 steps, every element within
    2 bf16 ulps per step of its magnitude (the two paths round the product in another order
    before the weight's rounding), and each weight moved."""
    torch.manual_seed(0)
    weights = [torch.randn(96, 64), torch.randn(64, 96), torch.randn(96, 64)]
    runs = []
    for foreach in (True, False):
        ps = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in weights]
        opt = preset([{"params": ps, "rank": 8, "update_proj_gap": 3}], lr=1e-2,
                     weight_decay=0.1, foreach=foreach)  # fmt: skip
        for step in range(5):
            g = torch.Generator().manual_seed(step)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            opt.step()
        runs.append([p.detach().double() for p in ps])
    for a, b, w in zip(*runs, weights, strict=True):
        assert (a - w.to(torch.bfloat16).double()).abs().max() > 1e-3
        assert ((a - b).abs() <= 2 * 5 * _bf16_ulp(b)).all()
