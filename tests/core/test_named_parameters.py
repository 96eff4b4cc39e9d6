"""torch's named-parameter form: ``GaLoreAdamW(model.named_parameters())`` and named groups."""

from __future__ import annotations

import copy

import torch

import galore2

from ..helpers import TinyNet, train


def test_named_parameters_train_like_parameters_and_keep_their_names():
    torch.manual_seed(0)
    model = TinyNet()
    named = copy.deepcopy(model)
    opt = galore2.GaLoreAdamW(model.parameters(), lr=1e-2)
    named_opt = galore2.GaLoreAdamW(named.named_parameters(), lr=1e-2)
    train(model, opt, range(3))
    train(named, named_opt, range(3))
    for p, q in zip(model.parameters(), named.parameters(), strict=True):
        assert torch.equal(p, q)
    names = [n for n, _ in named.named_parameters()]
    assert named_opt.param_groups[0]["param_names"] == names
    saved = named_opt.state_dict()
    assert saved["param_groups"][0]["param_names"] == names
    resumed = galore2.GaLoreAdamW(copy.deepcopy(named).named_parameters(), lr=1e-2)
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["param_names"] == names


def test_named_groups_with_galore_settings():
    torch.manual_seed(0)
    model = TinyNet()
    matrices = [(n, p) for n, p in model.named_parameters() if p.dim() == 2]
    rest = [(n, p) for n, p in model.named_parameters() if p.dim() < 2]
    opt = galore2.GaLoreAdamW(
        [{"params": matrices, "rank": 4, "update_proj_gap": 2}, {"params": rest}], lr=1e-2
    )
    train(model, opt, range(3))
    assert opt.param_groups[0]["param_names"] == ["up.weight", "mid.weight", "down.weight"]
    assert int(opt.state[model.up.weight]["galore.refreshes"]) == 2
