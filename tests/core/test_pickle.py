"""``copy.deepcopy`` and pickle give an optimizer that steps exactly like the original.

Issue 16 item 14: torch's ``Optimizer.__getstate__`` keeps only defaults, state and
param_groups, so a copy's ``step()`` raised AttributeError '_param_transforms'.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import galore2

from ..helpers import TinyNet, galore_groups, train

GALORE = {"rank": 4, "update_proj_gap": 3}

CASES = {
    "adamw-rank": lambda m: galore2.GaLoreAdamW(galore_groups(m, **GALORE), lr=1e-2),
    # full rank: the 72×72 weight's moments are 8-bit (≥ 4096 elements)
    "adamw8bit": lambda m: galore2.GaLoreAdamW8bit(m.parameters(), lr=1e-2),
    "adafactor": lambda m: galore2.GaLoreAdafactor(m.parameters(), beta1=0.9),
    "ranger21-rank": lambda m: galore2.GaLoreRanger21(
        galore_groups(m, **GALORE), lr=1e-2, num_iterations=20
    ),
}

COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
}


def _grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("name", CASES)
def test_a_copy_steps_bitwise_like_the_original(name, how):
    torch.manual_seed(0)
    model = TinyNet(d_hidden=72)
    opt = CASES[name](model)
    train(model, opt, range(2))
    if name == "adamw8bit":
        assert any(v.dtype == torch.uint8 for s in opt.state.values() for v in s.values())
    model2, opt2 = COPIES[how]((model, opt))  # together, so the copy's params are model2's
    assert type(opt2) is type(opt)
    for step in range(4):  # across a subspace refresh (every 3 steps)
        for m, o in ((model, opt), (model2, opt2)):
            _grads(m, seed=step)
            o.step()
        for p, q in zip(model.parameters(), model2.parameters(), strict=True):
            assert torch.equal(p, q), (name, step)
            assert opt.state[p].keys() == opt2.state[q].keys()
            assert all(torch.equal(v, opt2.state[q][k]) for k, v in opt.state[p].items())
    assert opt2.state_bytes() == opt.state_bytes()


def test_a_copy_is_independent_of_the_original():
    model = TinyNet()
    opt = CASES["adamw-rank"](model)
    train(model, opt, range(2))
    opt2 = copy.deepcopy(opt)  # its own copies of the parameters
    p2 = opt2.param_groups[0]["params"][0]
    assert p2 is not opt.param_groups[0]["params"][0]
    before = {k: v.clone() for k, v in opt.state[opt.param_groups[0]["params"][0]].items()}
    p2.grad = torch.randn_like(p2)
    opt2.step()
    after = opt.state[opt.param_groups[0]["params"][0]]
    assert all(torch.equal(before[k], after[k]) for k in before)
