"""Plain groups, and GaLore groups with rank ≥ min(m, n), are torch.optim.AdamW."""

from __future__ import annotations

import copy

import pytest
import torch

import galore2

from ..helpers import TinyNet, galore_groups, max_diff, train


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.8, 0.95)])
def test_plain_group_matches_torch_adamw(wd, betas):
    model = TinyNet()
    ref_model = copy.deepcopy(model)
    ours = galore2.GaLoreAdamW(model.parameters(), lr=1e-2, betas=betas, eps=1e-8, weight_decay=wd)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, betas=betas, eps=1e-8, weight_decay=wd)
    train(model, ours, range(30))
    train(ref_model, ref, range(30))
    assert max_diff(model, ref_model) <= 1e-6
    assert max_diff(model, TinyNet()) > 1e-2  # it trained


@pytest.mark.parametrize("proj_type", ["std", "reverse_std", "left", "right", "full"])
def test_rank_at_least_min_dim_is_plain_adamw(proj_type):
    model = TinyNet()
    ref_model = copy.deepcopy(model)
    # min dims are 24, 40, 12: rank 40 ≥ all of them.
    groups = galore_groups(model, rank=40, update_proj_gap=3, proj_type=proj_type, projector="svd")
    with pytest.warns(UserWarning, match="without projection"):
        ours = galore2.GaLoreAdamW(groups, lr=1e-2, weight_decay=0.05)
        train(model, ours, range(1))
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.05)
    train(ref_model, ref, range(1))
    train(model, ours, range(1, 20))
    train(ref_model, ref, range(1, 20))
    assert max_diff(model, ref_model) <= 1e-6
    assert all("proj.left" not in s and "proj.right" not in s for s in ours.state.values())


def test_rank_warning_is_given_once():
    model = TinyNet()
    opt = galore2.GaLoreAdamW(galore_groups(model, rank=100), lr=1e-3)
    with pytest.warns(UserWarning) as record:
        train(model, opt, range(3))
    messages = [str(w.message) for w in record if "without projection" in str(w.message)]
    assert len(messages) == len(set(messages)) == 3  # one per distinct shape, not per step


def test_galore_actually_differs_from_adamw_when_projecting():
    model = TinyNet()
    ref_model = copy.deepcopy(model)
    ours = galore2.GaLoreAdamW(galore_groups(model, rank=4), lr=1e-2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    train(model, ours, range(5))
    train(ref_model, ref, range(5))
    assert max_diff(model, ref_model) > 1e-4
