"""Every update rule's batched path (``foreach=True``: Fira's residual, APOLLO's scaling and
the norm-growth limiter, Muon's stacked Newton–Schulz and polar factor, Adafactor's factored
statistics, 8-bit moments concatenated per block layout) gives the per-tensor path's weights
(``foreach=False``) within 1e-6 (5e-6 for an exact-SVD variant and Ranger21, ``tools.batch_reference.LOOSE``) over 12 steps with three refreshes, on matrices of both
orientations with same-shape repeats (``tools.batch_reference``'s configs)."""

from __future__ import annotations

import pytest
import torch

from galore2.optim.muon import newton_schulz, polar
from tools.batch_reference import CONFIGS, params, run, tolerance

# the default run: one config per batched rule; the variants under -m slow
FAST = ("fira", "fira_reference", "apollo", "apollo_mini", "galore_muon", "galore_muon_polar",
        "galore_adamw8bit", "galore_adafactor_8bit", "galore_adafactor_beta1",
        "galore_adafactor_relative")  # fmt: skip
CASES = [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in sorted(CONFIGS)]


@pytest.fixture
def one_thread():
    """Both paths on one thread: tiny matrices, and no OpenMP spinning on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", CASES)
def test_batched_path_equals_per_tensor_path(name, one_thread):
    looped = run(CONFIGS[name], foreach=False)
    batched = run(CONFIGS[name], foreach=True)
    start = params()
    assert max(float((a - p).abs().max()) for a, p in zip(looped, start, strict=True)) > 1e-2
    for b, l_ in zip(batched, looped, strict=True):
        torch.testing.assert_close(b, l_, rtol=0, atol=tolerance(name))


@pytest.mark.parametrize("fn", [newton_schulz, polar], ids=["newton_schulz", "polar"])
def test_orthogonalization_of_a_stack_is_each_matrix_s(fn):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(3, 4, 9, generator=g)
    if fn is polar:
        X[1, 3] = X[1, 0]  # rank deficient: a zero singular value gives zero
    stacked = fn(X)
    # Newton–Schulz: five float32 iterations (bmm and mm round differently); polar: float64
    atol = 1e-5 if fn is newton_schulz else 1e-6
    for k in range(3):
        torch.testing.assert_close(stacked[k], fn(X[k]), rtol=0, atol=atol)
