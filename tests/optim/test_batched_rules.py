"""Every update rule's batched path (``foreach=True``: Fira's residual, APOLLO's scaling and
the norm-growth limiter, Muon's stacked Newton–Schulz and polar factor, Adafactor's factored
statistics, 8-bit moments concatenated per block layout) gives the per-tensor path's weights
(``foreach=False``) within 1e-6 over 12 steps with three refreshes, on matrices of both
orientations with same-shape repeats (``tools.batch_reference``'s configs)."""

from __future__ import annotations

import pytest
import torch

from galore2.optim.muon import newton_schulz, polar
from tools.batch_reference import CONFIGS, TOL, params, run


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_batched_path_equals_per_tensor_path(name):
    looped = run(CONFIGS[name], foreach=False)
    batched = run(CONFIGS[name], foreach=True)
    start = params()
    assert max(float((a - p).abs().max()) for a, p in zip(looped, start, strict=True)) > 1e-2
    for b, l_ in zip(batched, looped, strict=True):
        torch.testing.assert_close(b, l_, rtol=0, atol=TOL)


@pytest.mark.parametrize("fn", [newton_schulz, polar], ids=["newton_schulz", "polar"])
def test_orthogonalization_of_a_stack_is_each_matrix_s(fn):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(3, 4, 9, generator=g)
    X[1, 3] = X[1, 0]  # rank deficient: polar's zero singular value
    stacked = fn(X)
    for k in range(3):
        torch.testing.assert_close(stacked[k], fn(X[k]), rtol=0, atol=1e-6)
