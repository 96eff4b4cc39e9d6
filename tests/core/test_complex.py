"""Complex parameters: AdamW on the real view (as torch.optim.AdamW), refused elsewhere.

Issue 16 item 8: the default settings crashed ("value cannot be converted to type double
without overflow") and ``nonfinite="ignore"`` dropped the imaginary part.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import galore2


def _params():
    torch.manual_seed(0)
    return [
        nn.Parameter(torch.randn(5, 4, dtype=torch.complex64)),
        nn.Parameter(torch.randn(3, dtype=torch.complex64)),
        nn.Parameter(torch.randn(4)),  # a real one beside them
    ]


@pytest.mark.parametrize("nonfinite", ["skip", "raise", "ignore"])
@pytest.mark.parametrize("maximize", [False, True])
def test_plain_galore_adamw_matches_torch_adamw_on_complex_parameters(nonfinite, maximize):
    ours, ref = _params(), _params()
    kw = {"lr": 1e-2, "betas": (0.8, 0.9), "weight_decay": 0.1, "maximize": maximize}
    opt = galore2.GaLoreAdamW(ours, nonfinite=nonfinite, **kw)
    ref_opt = torch.optim.AdamW(ref, foreach=False, **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        for p, q in zip(ours, ref, strict=True):
            p.grad = torch.randn(p.shape, dtype=p.dtype, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    for p, q, start in zip(ours, ref, _params(), strict=True):
        assert p.dtype == q.dtype
        assert (p - q).abs().max().item() <= 1e-6
        if p.is_complex():  # the imaginary part moved (it was once dropped)
            assert (p.imag - start.imag).abs().max().item() > 1e-2


def test_a_complex_nan_gradient_is_skipped():
    (p, *_) = _params()
    opt = galore2.GaLoreAdamW([p])
    p.grad = torch.full_like(p, complex(0.0, float("nan")))
    before = p.detach().clone()
    opt.step()
    assert torch.equal(p, before) and opt.nonfinite_skips == 1


def _refused(make):
    with pytest.raises(
        ValueError, match=r"complex parameters \(\(5, 4\) complex64, \(3,\) complex64\)"
    ) as err:
        make(_params())
    return str(err.value)


def test_complex_parameters_are_refused_where_the_math_is_not_defined():
    assert "rank=2" in _refused(lambda ps: galore2.GaLoreAdamW(ps, rank=2))
    assert "Adafactor" in _refused(lambda ps: galore2.GaLoreAdafactor(ps))
    assert "8-bit" in _refused(lambda ps: galore2.GaLoreAdamW8bit(ps))
    assert "rank=None" in _refused(lambda ps: galore2.Ranger21(ps, num_iterations=10))


def test_add_param_group_refuses_a_projected_complex_group_and_adds_nothing():
    ps = _params()
    opt = galore2.GaLoreAdamW([ps[2]])
    with pytest.raises(ValueError, match="rank=4"):
        opt.add_param_group({"params": ps[:1], "rank": 4})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": (p for p in ps[:2])})  # rank None: fine (a generator)
    assert len(opt.param_groups[1]["params"]) == 2


def test_named_complex_parameters_are_refused_too():
    named = list(zip(("a", "b", "c"), _params(), strict=True))  # as named_parameters() gives
    with pytest.raises(ValueError, match="rank=2"):
        galore2.GaLoreAdamW(named, rank=2)


def test_complex_state_round_trips_through_state_dict():
    ours, resumed = _params(), _params()
    opt = galore2.GaLoreAdamW(ours, lr=1e-2)
    for p in ours:
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state[ours[0]]["adam.exp_avg"].shape == (5, 4, 2)  # the real view's
    with torch.no_grad():
        for p, q in zip(ours, resumed, strict=True):
            q.copy_(p)
    opt2 = galore2.GaLoreAdamW(resumed, lr=1e-2)
    opt2.load_state_dict(opt.state_dict())
    for o, ps in ((opt, ours), (opt2, resumed)):
        for p in ps:
            p.grad = torch.full_like(p, 0.5)
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(ours, resumed, strict=True))
