"""GaLoreMuon's step on a projected matrix is α·lr·0.2·√max(A, B)·U·Vᵀ for the A×B low-rank
direction (adjust_lr_fn="match_rms_adamw"), on either side of either orientation."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import galore2

RANK, LR, ALPHA = 3, 1e-2, 0.25


@pytest.mark.parametrize("orthogonalize", ["polar", "newton_schulz"])
@pytest.mark.parametrize(
    ("shape", "proj_type", "longer"),
    [
        ((7, 10), "std", 10),  # LEFT: 3×10 direction
        ((7, 10), "reverse_std", 7),  # RIGHT: 7×3 — its longer side is the weight's shorter
        ((13, 7), "std", 13),  # RIGHT: 13×3
        ((13, 7), "reverse_std", 7),  # LEFT: 3×7
    ],
)
def test_projected_step_is_scaled_orthogonal_direction(shape, proj_type, longer, orthogonalize):
    m, n = shape
    layer = nn.Linear(n, m, bias=False).double()  # float64: the step's singular values exact
    before = layer.weight.detach().clone()
    group = {"params": [layer.weight], "rank": RANK, "proj_type": proj_type,
             "projector": "svd", "orthogonalize": orthogonalize}  # fmt: skip
    opt = galore2.GaLoreMuon([group], lr=LR, weight_decay=0.0, scale=ALPHA)
    g = torch.Generator().manual_seed(5)
    x, y = (torch.randn(16, d, generator=g, dtype=torch.float64) for d in (n, m))
    nn.functional.mse_loss(layer(x), y).backward()
    opt.step()
    sv = torch.linalg.svdvals(layer.weight.detach() - before)
    expected = LR * ALPHA * 0.2 * math.sqrt(longer)
    # rank-3 step; polar: singular values exactly 1 before scaling, Newton–Schulz: ~[0.7, 1.2]
    assert sv[RANK:].max() <= 1e-9 * expected
    if orthogonalize == "polar":
        torch.testing.assert_close(
            sv[:RANK], torch.full((RANK,), expected, dtype=torch.float64), rtol=1e-5, atol=0
        )
    else:
        assert 0.6 * expected <= sv[RANK - 1] <= sv[0] <= 1.25 * expected, (sv[:RANK], expected)
