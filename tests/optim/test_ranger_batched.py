"""Ranger21's modules on the batched path (``foreach=True``): the per-tensor path's results.

AGC, centralization, normalization, PNM, norm loss, stable weight decay and lookahead each
run over a whole batch (segment reductions, foreach kernels; :mod:`galore2.optim.units`).
Forced on the CPU with ``foreach=True``, a run must equal the per-tensor one
(``foreach=False``) within 1e-6 over steps that cover the warmup, two lookahead syncs and
(GaLoreRanger21) three subspace refreshes; the state keeps its keys and dtypes.
"""

from __future__ import annotations

import pytest
import torch

import galore2
from galore2.optim.gradient import (
    AdaptiveGradientClipping,
    CentralizeGradient,
    NormalizeGradient,
)
from galore2.optim.units import layout

from ..helpers import TinyNet, assert_f32_close, galore_groups, train

STEPS = 12  # of num_iterations 20: warmup steps, lookahead syncs at 5 and 10, refreshes


def _run(cls, foreach: bool, dtype: torch.dtype = torch.float32, **switches):
    torch.manual_seed(0)
    model = TinyNet().to(dtype)
    settings = {"lr": 1e-2, "weight_decay": 1e-2, "num_iterations": 20, "foreach": foreach}
    if cls is galore2.GaLoreRanger21:
        params = galore_groups(model, rank=4, update_proj_gap=5)
    else:
        params = model.parameters()
    opt = cls(params, **settings, **switches)
    train(model, opt, range(STEPS))
    return model, opt


VARIANTS = [
    {},
    {"softplus": False, "amsgrad": True, "adamd": True, "lookahead_alpha": 0.3},
    {"pnm_beta0": 0.0, "lookahead_dtype": "bfloat16"},
]


@pytest.mark.parametrize("switches", VARIANTS, ids=["defaults", "amsgrad_adamd", "beta0_bf16"])
@pytest.mark.parametrize("cls", [galore2.Ranger21, galore2.GaLoreRanger21])
def test_batched_equals_per_tensor(cls, switches):
    batched, opt_b = _run(cls, True, **switches)
    looped, opt_l = _run(cls, False, **switches)
    torch.manual_seed(0)
    start = TinyNet()
    for b, l_, p0 in zip(
        batched.parameters(), looped.parameters(), start.parameters(), strict=True
    ):
        assert (b.detach() - p0.detach()).abs().max() > 1e-4  # it trained
        assert_f32_close(b.detach(), l_.detach(), steps=STEPS)
    if cls is galore2.GaLoreRanger21:
        assert all(r["refreshes"] == 3 for r in opt_b.refresh_stats().values())
    for pb, pl in zip(batched.parameters(), looped.parameters(), strict=True):
        sb, sl = opt_b.state[pb], opt_l.state[pl]
        assert sb.keys() == sl.keys()
        for key in sb:
            assert sb[key].dtype == sl[key].dtype, key
            assert sb[key].device == sl[key].device, key
            if sb[key].is_floating_point():  # moments of normalized gradients: O(1) values
                torch.testing.assert_close(sb[key], sl[key], rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(sb[key], sl[key]), key


@pytest.mark.parametrize("cls", [galore2.Ranger21, galore2.GaLoreRanger21])
def test_batched_equals_per_tensor_in_float64(cls):
    """In float64 the batched reductions differ from the per-tensor ones by their
    summation order only: the runs agree to ~1e-12."""
    batched, _ = _run(cls, True, torch.float64, state_dtype="float64")
    looped, _ = _run(cls, False, torch.float64, state_dtype="float64")
    for b, l_ in zip(batched.parameters(), looped.parameters(), strict=True):
        assert b.dtype == torch.float64
        torch.testing.assert_close(b.detach(), l_.detach(), rtol=0, atol=1e-12)


def test_batched_bfloat16_parameters_match_per_tensor_to_bfloat16_rounding():
    """bfloat16 parameters: the batch is gathered and reduced in float32, as the per-tensor
    path reduces; results agree but for the rare bfloat16 rounding flipped by a different
    summation order (one bfloat16 step of the weights' size)."""
    batched, _ = _run(galore2.Ranger21, True, torch.bfloat16)
    looped, _ = _run(galore2.Ranger21, False, torch.bfloat16)
    for b, l_ in zip(batched.parameters(), looped.parameters(), strict=True):
        assert b.dtype == torch.bfloat16
        torch.testing.assert_close(b.detach().float(), l_.detach().float(), rtol=0, atol=2e-2)
        assert (b != l_).float().mean() < 0.05  # almost every element bit for bit


def test_foreach_true_batches_every_module(monkeypatch):
    """With ``foreach=True`` no gradient module falls back to one tensor at a time."""
    for cls in (AdaptiveGradientClipping, CentralizeGradient, NormalizeGradient):

        def refuse(self, *args, **kwargs):
            raise AssertionError(f"{type(self).__name__}.apply_ ran per tensor")

        monkeypatch.setattr(cls, "apply_", refuse)
    model = TinyNet()
    # one group holding every parameter: every module sees a batch of several tensors
    train(model, galore2.Ranger21(model.parameters(), num_iterations=20, foreach=True), range(2))


def test_units_are_grouped_by_width():
    """Row units of ≥2-D tensors and whole ≤1-D tensors, ordered by width: one (units ×
    width) region per width; reductions, scaling and the write-back views follow it."""
    ts = [torch.arange(6.0).view(2, 3), torch.tensor([1.0, 2.0]), torch.tensor(5.0),
          torch.arange(3.0)]  # fmt: skip
    lay = layout(ts)
    assert [w[:2] for w in lay.widths] == [(1, 1), (2, 1), (3, 3)]  # (width, units)
    assert lay.order == (2, 1, 0, 3)
    values = lay.gather([ts], torch.float32)
    (sums,) = lay.reduce(values, lambda r: r.sum(dim=-1))
    assert sums.tolist() == [5.0, 3.0, 3.0, 12.0, 3.0]
    assert lay.tensor_reduce(sums).tolist() == [5.0, 3.0, 15.0, 3.0]
    assert lay.tensor_reduce(sums, "mean").tolist() == [5.0, 3.0, 7.5, 3.0]
    both = lay.gather([ts, ts], torch.float32)
    assert lay.reduce(both, lambda r: r.sum(dim=-1), copies=2).tolist() == [sums.tolist()] * 2
    lay.scale_(both, torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), copies=2)
    views = lay.views(both, copies=2)
    assert [v.shape for v in views] == [t.shape for t in lay.ordered(ts)]
    assert views[2].tolist() == [[0.0, 3.0, 6.0], [12.0, 16.0, 20.0]]
    assert views[3].tolist() == [0.0, 5.0, 10.0]


def test_batched_agc_keeps_unclipped_units_and_maps_nan_norms_to_one():
    """AGC's batched factor: units under the limit and units with a NaN norm are left bit
    for bit (as ``apply_``), units over it are scaled to the limit."""
    torch.manual_seed(0)
    ws = [torch.randn(4, 5), torch.randn(3)]
    gs = [torch.randn(4, 5) * 1e-4, torch.randn(3)]
    gs[0][1] *= 1e6  # row 1 over the limit
    gs[0][2, 0] = float("nan")  # row 2: NaN norm
    before = [g.clone() for g in gs]
    ctxs = [
        galore2.core.transform.Context(param=w, index=i, shape=w.shape) for i, w in enumerate(ws)
    ]
    group = {"agc_clip": 1e-2, "agc_eps": 1e-3}
    AdaptiveGradientClipping().apply_many(gs, group, [{}, {}], ctxs)
    expected = [g.clone() for g in before]
    for g, ctx in zip(expected, ctxs, strict=True):
        AdaptiveGradientClipping().apply_(g, group, {}, ctx)
    torch.testing.assert_close(gs, expected, rtol=1e-6, atol=0, equal_nan=True)
    assert torch.equal(gs[0][0], before[0][0])  # under the limit: unchanged
    assert torch.equal(gs[0][2].nan_to_num(), before[0][2].nan_to_num())
    limit = 1e-2 * ws[0][1].norm()
    torch.testing.assert_close(gs[0][1].norm(), limit, rtol=1e-5, atol=0)
