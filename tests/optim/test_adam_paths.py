"""Adam's execution paths (galore2/optim/adam_paths.py) and their one dispatcher
(``ScaleByAdam._directions``), and the one bias-correction helper
(``galore2.optim.moments.bias_correction``) that Adam, PNM and the moments mixin share.

The single-tensor and foreach paths run the same elementwise operations with the same
scalars in the same order, so on float64 moments they agree bit for bit; float32 batches
take torch's fused kernel (compared to rounding in tests/optim/test_lowrank_update.py).
"""

from __future__ import annotations

import math

import pytest
import torch

import galore2
from galore2.optim import adam as adam_module
from galore2.optim.adam_paths import adam_foreach, adam_single, corrections
from galore2.optim.moments import bias_correction

from ..helpers import TinyNet, galore_groups, train

GROUP = {"betas": (0.9, 0.999), "eps": 1e-8}


def _tensors(dtype: torch.dtype, seed: int = 0) -> tuple[list[torch.Tensor], ...]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (11,), (3, 4, 2)]
    us = [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]
    ms = [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) * 0.1 for s in shapes]
    vs = [torch.rand(s, generator=g, dtype=torch.float64).to(dtype) * 0.01 for s in shapes]
    return us, ms, vs


@pytest.mark.parametrize("t", [1, 2, 37, 10_000])
def test_bias_correction_is_one_minus_beta_to_the_t(t):
    """Host counts: exactly the Python float 1 − βᵗ. Device counts (float64 tensors): the
    same value up to the last bit of torch's pow."""
    for beta in (0.9, 0.999, 0.81):
        assert bias_correction(beta, t) == 1 - beta**t
        got = bias_correction(beta, torch.tensor([t], dtype=torch.float64))
        want = 1 - beta**t
        assert got.dtype == torch.float64
        assert abs(float(got) - want) <= 2 * math.ulp(want) + 2 * math.ulp(beta**t)
    assert bias_correction(0.9, 0) == 0.0


def test_corrections_fold_both_bias_corrections():
    """(scale, shift) = ((1 − β₁ᵗ)/√(1 − β₂ᵗ), (1 − β₁ᵗ)·eps): m/(√v·scale + shift) is
    m̂/(√v̂ + eps)."""
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    for t in (1, 5, 300):
        scale, shift = corrections(beta1, beta2, eps, t)
        bc1, bc2 = 1 - beta1**t, 1 - beta2**t
        assert scale == bc1 / math.sqrt(bc2)
        assert shift == bc1 * eps


@pytest.mark.parametrize("t", [1, 4])
def test_single_tensor_and_foreach_paths_are_the_same_arithmetic(t):
    """float64: adam_single per tensor and adam_foreach over the list give the same bits
    (moments and directions), and both match Adam's definition in float64 to rounding."""
    us, ms, vs = _tensors(torch.float64)
    m1, v1 = [m.clone() for m in ms], [v.clone() for v in vs]
    m2, v2 = [m.clone() for m in ms], [v.clone() for v in vs]
    single = [adam_single(u, m, v, t, GROUP) for u, m, v in zip(us, m1, v1, strict=True)]
    scale, shift = corrections(0.9, 0.999, 1e-8, t)
    n = len(us)
    many = adam_foreach(us, m2, v2, 1 - 0.9, 0.999, 1 - 0.999, [scale] * n, [shift] * n)
    for a, b in zip(single + m1 + v1, many + m2 + v2, strict=True):
        assert torch.equal(a, b)
    for u, m0, v0, d in zip(us, ms, vs, single, strict=True):
        m = 0.9 * m0 + 0.1 * u
        v = 0.999 * v0 + 0.001 * u * u
        want = (m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + 1e-8)
        torch.testing.assert_close(d, want, rtol=1e-12, atol=0)


def _spy(monkeypatch, names):
    """Record which of adam.py's path functions a step calls (by name)."""
    calls: list[str] = []
    for name in names:
        real = getattr(adam_module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(adam_module, name, spy)
    return calls


@pytest.mark.parametrize(
    ("state_dtype", "foreach", "want"),
    [
        ("float32", None, "adam_single"),  # the CPU's default: per tensor
        ("float32", True, "adam_fused"),  # float32 moments: torch's fused Adam kernel
        ("float64", True, "adam_foreach"),  # not fusable: foreach kernels
    ],
)
def test_the_dispatcher_picks_one_path_per_step(monkeypatch, state_dtype, foreach, want):
    """Each projected step of a GaLore group runs exactly one of the paths, the one its
    batch allows; the other paths are not called."""
    calls = _spy(monkeypatch, ("adam_single", "adam_fused", "adam_foreach", "adam_rounded"))
    model = TinyNet()
    groups = galore_groups(model, rank=4, state_dtype=state_dtype)
    groups[1].update(fused=False, state_dtype=state_dtype)  # the plain group: galore2's Adam
    opt = galore2.GaLoreAdamW(groups, lr=1e-2, foreach=foreach)
    train(model, opt, range(2))
    assert calls and set(calls) == {want}
