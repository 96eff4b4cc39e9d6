"""A finite gradient whose square overflows the state dtype is handled like a NaN one.

Issue 16 item 6: one entry ≥ 1e20 made GaLoreAdafactor's weights NaN (under ``skip`` and
``raise``) and GaLoreAdamW's ``exp_avg_sq`` Inf (those coordinates then never move);
float16 state froze elements whose gradient was around 8e3.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import galore2

HUGE = 1e22  # finite in float32; its square (even times 1 − β₂) is not

CASES = [
    pytest.param(galore2.GaLoreAdamW, {}, id="adamw"),
    pytest.param(galore2.GaLoreAdamW, {"rank": 2}, id="adamw-rank"),
    pytest.param(galore2.GaLoreAdafactor, {}, id="adafactor"),
    pytest.param(galore2.GaLoreAdafactor, {"rank": 2}, id="adafactor-rank"),
]


def _setup(cls, kw, policy):
    torch.manual_seed(0)
    w, b = nn.Parameter(torch.randn(8, 6)), nn.Parameter(torch.randn(6))
    opt = cls([{"params": [w], **kw}, {"params": [b]}], lr=1e-2, nonfinite=policy)
    w.grad, b.grad = torch.randn(8, 6), torch.randn(6)
    opt.step()  # a normal first step (and the first refresh)
    w.grad, b.grad = torch.randn(8, 6), torch.randn(6)
    w.grad[3, 2] = HUGE
    return opt, w, b


def _snapshot(opt, params):
    return [p.detach().clone() for p in params], [
        {k: v.clone() for k, v in opt.state[p].items()} for p in params
    ]


def _all_finite(opt, w):
    return torch.isfinite(w).all() and all(
        torch.isfinite(v).all() for v in opt.state[w].values() if v.is_floating_point()
    )


@pytest.mark.parametrize(("cls", "kw"), CASES)
def test_skip_leaves_parameter_and_state_untouched(cls, kw):
    opt, w, b = _setup(cls, kw, "skip")
    (w0,), (s0,) = _snapshot(opt, [w])
    b0 = b.detach().clone()
    opt.step()
    assert torch.equal(w, w0)
    assert all(torch.equal(opt.state[w][k], v) for k, v in s0.items() if k != "nonfinite.skips")
    assert opt.nonfinite_skips == 1
    assert not torch.equal(b, b0)  # the other parameter was stepped
    for _ in range(3):  # and training goes on with finite weights and state
        w.grad, b.grad = torch.randn(8, 6), torch.randn(6)
        opt.step()
    assert _all_finite(opt, w) and not torch.equal(w, w0)


@pytest.mark.parametrize(("cls", "kw"), CASES)
def test_raise_names_the_overflow_before_any_change(cls, kw):
    opt, w, b = _setup(cls, kw, "raise")
    params, states = _snapshot(opt, [w, b])
    with pytest.raises(FloatingPointError, match=r"sum of squares overflows float32.*\(8, 6\)"):
        opt.step()
    for p, p0, s0 in zip([w, b], params, states, strict=True):
        assert torch.equal(p, p0)
        assert all(torch.equal(opt.state[p][k], v) for k, v in s0.items())


@pytest.mark.parametrize(("cls", "kw"), CASES)
def test_ignore_still_steps_without_a_look(cls, kw):
    opt, w, _ = _setup(cls, kw, "ignore")
    w0 = w.detach().clone()
    opt.step()
    assert opt.nonfinite_skips == 0
    assert not torch.equal(w, w0)


def test_a_nan_gradient_is_still_reported_as_non_finite():
    w = nn.Parameter(torch.randn(4, 4))
    opt = galore2.GaLoreAdamW([w], nonfinite="raise")
    w.grad = torch.full((4, 4), float("nan"))
    with pytest.raises(FloatingPointError, match="non-finite gradient") as err:
        opt.step()
    assert "overflows" not in str(err.value)


def test_float16_state_warns_and_never_stores_inf():
    """|g| ≈ 9e3 once made (1 − β₂)·g² > 65504: exp_avg_sq Inf, the element frozen."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    opt = galore2.GaLoreAdamW([w], lr=1e-2, state_dtype="float16")
    w.grad = torch.randn(4, 4)  # ‖g‖ ≈ 4 ≤ 255.9: stepped
    with pytest.warns(UserWarning, match="float16.*bfloat16"):
        opt.step()
    w.grad = torch.randn(4, 4)
    w.grad[1, 1] = 9e3
    w0 = w.detach().clone()
    opt.step()
    assert opt.nonfinite_skips == 1 and torch.equal(w, w0)
    for _ in range(3):
        w.grad = torch.randn(4, 4)
        opt.step()
    assert _all_finite(opt, w)
    assert (w != w0).all()  # every element still moves


def test_groups_checked_together_keep_their_own_bounds_and_flags():
    """One check for every group that shares a state dtype (``NonFinitePolicy.check_many``):
    each group gets its own parameters' flags; a group whose state is float16 keeps its own
    bound (a norm above √65504 ≈ 256 is unusable there, not with float32 state); an
    ``ignore`` group gets none."""
    from galore2.core.nonfinite import NonFinitePolicy
    from galore2.placement import LOCAL

    def group(**kw):
        return {"nonfinite": "skip", "foreach": True} | kw

    grads = [
        [torch.ones(3), torch.full((2,), float("nan"))],  # float32 state
        [torch.tensor([HUGE]), torch.ones(4)],  # float32 state: checked with the first
        [torch.tensor([100.0]), torch.tensor([1e3])],  # float16 state: 1e3² overflows
        [torch.full((2,), float("inf"))],  # ignore
    ]
    groups = [group(), group(), group(state_dtype="float16"), group(nonfinite="ignore")]
    flags = NonFinitePolicy.check_many(
        [(g, gs, [LOCAL] * len(gs)) for g, gs in zip(groups, grads, strict=True)]
    )
    assert [None if f is None else f.tolist() for f in flags] == [
        [True, False], [False, True], [True, False], None
    ]  # fmt: skip
