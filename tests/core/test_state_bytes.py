"""state_bytes() reports exactly what is stored; GaLore's footprint is r·min + 2·r·max."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import galore2

SCALARS = {
    "nonfinite.skips",
    "galore.side",
    "galore.step",
    "galore.next_refresh",
    "galore.refreshes",
    "galore.seed",
    "adam.step",
}


@pytest.mark.parametrize("shape", [(64, 96), (96, 64), (80, 80)])
@pytest.mark.parametrize("projector", ["svd", "randomized", "power"])
def test_galore_matrix_state_elements(shape, projector):
    m, n = shape
    r = 8
    p = nn.Parameter(torch.randn(m, n))
    opt = galore2.GaLoreAdamW([{"params": [p], "rank": r, "projector": projector}], lr=1e-3)
    p.grad = torch.randn(m, n)
    opt.step()
    state = opt.state[p]
    tensors = sum(v.numel() for k, v in state.items() if k not in SCALARS)
    assert tensors == r * min(m, n) + 2 * r * max(m, n)
    assert all(state[k].numel() == 1 for k in SCALARS)
    nbytes = opt.state_bytes()
    assert nbytes["basis"] == 4 * r * min(m, n)
    assert nbytes["moments"] == 4 * 2 * r * max(m, n)
    assert nbytes["other"] == 8 * len(SCALARS)
    assert nbytes["total"] == nbytes["basis"] + nbytes["moments"] + nbytes["other"]
    actual = sum(v.numel() * v.element_size() for v in state.values())
    assert nbytes["total"] == actual


def test_random_projector_stores_no_basis():
    p = nn.Parameter(torch.randn(64, 96))
    opt = galore2.GaLoreAdamW([{"params": [p], "rank": 8, "projector": "random"}], lr=1e-3)
    p.grad = torch.randn(64, 96)
    opt.step()
    assert opt.state_bytes()["basis"] == 8  # one int64 seed
    assert opt.state_bytes()["moments"] == 4 * 2 * 8 * 96


def test_bf16_state_halves_moment_bytes():
    p = nn.Parameter(torch.randn(64, 96))
    opt = galore2.GaLoreAdamW([{"params": [p], "rank": 8}], lr=1e-3, state_dtype="bfloat16")
    opt.init_state()
    assert opt.state_bytes()["moments"] == 2 * 2 * 8 * 96


def test_meta_device_sizing_allocates_nothing():
    with torch.device("meta"):
        layer = nn.Linear(4096, 11008, bias=False)
    opt = galore2.GaLoreAdamW([{"params": [layer.weight], "rank": 1024}], lr=1e-3)
    opt.init_state()
    assert opt.state[layer.weight]["adam.exp_avg"].is_meta
    assert opt.state_bytes()["moments"] + opt.state_bytes()["basis"] == 4 * 1024 * (
        4096 + 2 * 11008
    )


def test_plain_adamw_bytes_match_torch():
    model = nn.Linear(32, 16)
    opt = galore2.GaLoreAdamW(model.parameters(), lr=1e-3)
    opt.init_state()
    assert opt.state_bytes()["moments"] == 2 * 4 * sum(p.numel() for p in model.parameters())
