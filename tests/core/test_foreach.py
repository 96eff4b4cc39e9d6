"""The ``foreach`` option: the batched path (foreach kernels), forced on the CPU, is the
per-tensor path and ``torch.optim.AdamW`` to rounding.

The batched path otherwise runs only on accelerators, so these tests are what check it
in a CPU-only run (its second moment, its weight decay).
"""

from __future__ import annotations

import copy

import pytest
import torch

import galore2
from galore2.core.apply import chunks as _chunks
from galore2.optim import ScaleByAdam

from ..helpers import (
    TinyNet,
    assert_f32_close,
    max_diff,
    step_on_weight_dependent_grads,
    train,
)

SETTINGS = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


def test_chunks_honour_foreach():
    cpu = [torch.zeros(2) for _ in range(3)]
    assert _chunks(cpu) == [[0], [1], [2]]  # automatic: per tensor on the CPU
    assert _chunks(cpu, None) == [[0], [1], [2]]
    assert _chunks(cpu, False) == [[0], [1], [2]]
    assert _chunks(cpu, True) == [[0, 1, 2]]


def test_foreach_is_a_declared_option():
    opt = galore2.GaLoreAdamW(TinyNet().parameters())
    assert opt.param_groups[0]["foreach"] is None
    with pytest.raises(ValueError, match="foreach"):
        galore2.GaLoreAdamW(TinyNet().parameters(), foreach="yes")


def test_foreach_true_runs_the_foreach_kernels_on_cpu(monkeypatch):
    calls = []
    original = ScaleByAdam._directions

    def spy(self, us, states, group, ctxs, batched):
        if batched:
            calls.append(len(us))
        return original(self, us, states, group, ctxs, batched)

    monkeypatch.setattr(ScaleByAdam, "_directions", spy)
    model = TinyNet()
    # galore2's own Adam (fused=False: a batched plain group otherwise runs torch's fused
    # AdamW kernel, tests/optim/test_torch_adamw.py)
    train(model, galore2.GaLoreAdamW(model.parameters(), foreach=True, fused=False), range(2))
    assert calls == [8, 8]  # one batch of every parameter per step
    calls.clear()
    train(model, galore2.GaLoreAdamW(model.parameters()), range(2))
    assert calls == []  # automatic on the CPU: per tensor


@pytest.mark.parametrize("foreach", [True, False])
def test_plain_group_matches_torch_adamw(foreach):
    model = TinyNet()
    ref_model = copy.deepcopy(model)
    # galore2's own Adam (fused=False; with foreach=True the default takes torch's fused kernel)
    ours = galore2.GaLoreAdamW(model.parameters(), foreach=foreach, fused=False, **SETTINGS)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=foreach, **SETTINGS)
    train(model, ours, range(20))
    train(ref_model, ref, range(20))
    assert max_diff(model, ref_model) <= 1e-6
    assert max_diff(model, TinyNet()) > 1e-2  # it trained


def test_plain_foreach_matches_torch_adamw_foreach_float64():
    torch.manual_seed(0)
    model = TinyNet().double()
    ref_model = copy.deepcopy(model)
    ours = galore2.GaLoreAdamW(
        model.parameters(), foreach=True, fused=False, state_dtype="float64", **SETTINGS
    )
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=True, **SETTINGS)
    train(model, ours, range(20))
    train(ref_model, ref, range(20))
    assert max_diff(model, ref_model) <= 1e-12
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        s, r = ours.state[p], ref.state[q]
        torch.testing.assert_close(s["adam.exp_avg"], r["exp_avg"], rtol=0, atol=1e-14)
        torch.testing.assert_close(s["adam.exp_avg_sq"], r["exp_avg_sq"], rtol=0, atol=1e-14)


def _galore_params():
    g = torch.Generator().manual_seed(0)
    shapes = [(24, 16), (24, 16), (16, 24), (20, 20), (12, 30), (30,), (16,)]
    return [torch.randn(s, generator=g) for s in shapes]


def _run_galore(foreach: bool, steps: int = 8) -> tuple[list[torch.Tensor], galore2.GaLoreAdamW]:
    params = [p.requires_grad_() for p in _galore_params()]
    mats, vecs = params[:5], params[5:]
    opt = galore2.GaLoreAdamW(
        [
            {"params": mats, "rank": 4, "update_proj_gap": 3, "scale": 0.5},
            {"params": vecs},
        ],
        foreach=foreach,
        **SETTINGS,
    )
    step_on_weight_dependent_grads(opt, params, steps)
    return params, opt


def test_galore_groups_foreach_match_per_tensor():
    batched, opt_b = _run_galore(True)
    looped, opt_l = _run_galore(False)
    assert all(r["refreshes"] == 3 for r in opt_b.refresh_stats().values())  # across refreshes
    start = _galore_params()
    for b, l_, p0 in zip(batched, looped, start, strict=True):
        assert (b.detach() - p0).abs().max() > 1e-2  # it trained
        assert_f32_close(b.detach(), l_.detach(), steps=8)  # _run_galore's 8 steps
    for pb, pl in zip(batched, looped, strict=True):
        sb, sl = opt_b.state[pb], opt_l.state[pl]
        assert sb.keys() == sl.keys()
        for key in ("adam.exp_avg", "adam.exp_avg_sq"):
            torch.testing.assert_close(sb[key], sl[key], rtol=1e-5, atol=1e-7)
