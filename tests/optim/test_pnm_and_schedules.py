"""ScaleByPNM (positive-negative momentum) and the Ranger21 lr schedules."""

from __future__ import annotations

import io
import math

import pytest
import torch

from galore2.core.transform import Context
from galore2.optim import ChainOptimizer, GaLore, ScaleByAdam
from galore2.optim.pnm import ScaleByPNM
from galore2.optim.schedules import (
    LinearWarmup,
    Ranger21Schedule,
    WarmdownToMin,
    ranger21_lr,
    warmup_length,
)


def _group(**kw):
    group = {"betas": (0.9, 0.999), "eps": 1e-8, "state_dtype": "float64", "pnm_beta0": 1.0}
    group["softplus_beta"] = 50.0
    group.update(kw)
    return group


def _run(transform, grads, **kw):
    """Feed ``grads`` (lists of floats) through ``transform``; returns outputs and state."""
    group = _group(**kw)
    transform.validate(group)
    ref = torch.zeros(len(grads[0]), dtype=torch.float64)
    ctx, state = Context(param=ref, index=0), {}
    transform.init(ref.shape, ref, group, state, ctx)
    outs = []
    for g in grads:
        outs.append(transform.update(torch.tensor(g, dtype=torch.float64), state, group, ctx))
    return outs, state


def test_pnm_matches_hand_computed_three_steps():
    g1, g2, g3 = [0.5, -1.0, 2.0], [0.25, 3.0, -1.5], [-0.75, 0.5, 1.0]
    b1, b2, b0, eps = 0.9, 0.999, 1.0, 1e-8
    a = b1 * b1  # the momentum coefficient of each buffer
    norm = math.sqrt((1 + b0) ** 2 + b0**2)  # √5
    outs, _ = _run(ScaleByPNM(), [g1, g2, g3], pnm_beta0=b0)
    for i in range(3):
        x1, x2, x3 = g1[i], g2[i], g3[i]
        # t=1: exp_avg = (1−a)·x1, corrected by 1 − a¹; neg_exp_avg empty.
        v1 = (1 - b2) * x1 * x1
        e1 = (1 + b0) * x1 / norm / (math.sqrt(v1 / (1 - b2)) + eps)
        # t=2: neg_exp_avg = (1−a)·x2 (1 update); exp_avg holds x1 (1 update).
        v2 = b2 * v1 + (1 - b2) * x2 * x2
        e2 = ((1 + b0) * x2 - b0 * x1) / norm / (math.sqrt(v2 / (1 - b2**2)) + eps)
        # t=3: exp_avg = a(1−a)x1 + (1−a)x3, two updates: / (1 − a²) = (a·x1 + x3)/(1 + a).
        v3 = b2 * v2 + (1 - b2) * x3 * x3
        m_pos = (a * x1 + x3) / (1 + a)
        e3 = ((1 + b0) * m_pos - b0 * x2) / norm / (math.sqrt(v3 / (1 - b2**3)) + eps)
        for out, expected in zip(outs, (e1, e2, e3), strict=True):
            assert float(out[i]) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("beta0", [0.0, 1.0, 0.3])
def test_pnm_constant_gradient_bias_correction(beta0):
    g = [0.5, -2.0, 1e-3]
    outs, state = _run(ScaleByPNM(), [g] * 9, pnm_beta0=beta0, betas=(0.8, 0.99))
    norm = math.sqrt((1 + beta0) ** 2 + beta0**2)
    for t, out in enumerate(outs, start=1):
        # Both buffers, once used, are unbiased estimates of g: numerator g·(1+β₀−β₀)/norm
        # (at t = 1 the negative buffer is empty: (1+β₀)/norm). v̂ = g² exactly.
        factor = ((1 + beta0) if t == 1 else 1.0) / norm
        for x, o in zip(g, out.tolist(), strict=True):
            assert o * (abs(x) + 1e-8) == pytest.approx(factor * x, rel=1e-12)
    assert int(state["pnm.step"]) == 9
    # Σ v̂ = Σ g² (stable weight decay's statistic).
    expected = sum(x * x for x in g)
    assert float(ScaleByPNM().second_moment_sum(state, _group(betas=(0.8, 0.99)))) == (
        pytest.approx(expected, rel=1e-12)
    )


def test_pnm_beta0_zero_is_adam_on_each_parity_with_squared_beta1():
    # β₂ = 0 makes v̂ = g_t² in both, so only the first moments are compared: at step t
    # PNM(β₀=0) is Adam with β₁² run on the gradients of t's parity (the odd steps feed
    # exp_avg, the even ones neg_exp_avg), including the bias correction 1 − β₁^(2n).
    torch.manual_seed(0)
    grads = [torch.randn(5, dtype=torch.float64).tolist() for _ in range(10)]
    outs, _ = _run(ScaleByPNM(), grads, pnm_beta0=0.0, betas=(0.9, 0.0))
    odd, _ = _run(ScaleByAdam(), grads[0::2], betas=(0.81, 0.0))
    even, _ = _run(ScaleByAdam(), grads[1::2], betas=(0.81, 0.0))
    expected = [x for pair in zip(odd, even, strict=True) for x in pair]
    for out, exp in zip(outs, expected, strict=True):
        torch.testing.assert_close(out, exp, rtol=1e-12, atol=0)


def test_pnm_amsgrad_stores_and_uses_the_running_max():
    grads = [[3.0, -1.0], [0.1, 0.2], [0.05, 4.0], [0.0, 0.0]]
    t_max = ScaleByPNM(amsgrad=True)
    assert t_max.quadratic_keys == ("pnm.exp_avg_sq", "pnm.max_exp_avg_sq")
    group = _group(betas=(0.9, 0.9))
    ref = torch.zeros(2, dtype=torch.float64)
    ctx, state = Context(param=ref, index=0), {}
    t_max.init(ref.shape, ref, group, state, ctx)
    plain_outs, _ = _run(ScaleByPNM(), grads, betas=(0.9, 0.9))
    history = []
    for t, g in enumerate(grads, start=1):
        out = t_max.update(torch.tensor(g, dtype=torch.float64), state, group, ctx)
        history.append(state["pnm.exp_avg_sq"].clone())
        running_max = torch.stack(history).amax(0)
        torch.testing.assert_close(state["pnm.max_exp_avg_sq"], running_max, rtol=0, atol=0)
        # The output divides by the max: out·(√(v_max/bc2) + eps) is amsgrad-free.
        den_max = (running_max / (1 - 0.9**t)).sqrt() + 1e-8
        den = (state["pnm.exp_avg_sq"] / (1 - 0.9**t)).sqrt() + 1e-8
        torch.testing.assert_close(out * den_max, plain_outs[t - 1] * den, rtol=1e-12, atol=0)
    assert (state["pnm.max_exp_avg_sq"] > state["pnm.exp_avg_sq"]).all()  # max kept
    t_max.reset(state, group)
    assert int(state["pnm.step"]) == 0 and not state["pnm.max_exp_avg_sq"].any()


def test_pnm_softplus_denominator():
    # √v̂ = 0.2 (constant gradient): softplus_50(0.2) = 0.2 + log(1 + e^-10)/50 ≈ 0.2.
    outs, _ = _run(ScaleByPNM(softplus=True), [[0.2, -0.2]] * 3, pnm_beta0=0.0)
    for out in outs:
        torch.testing.assert_close(out.abs(), torch.ones(2, dtype=torch.float64), rtol=1e-3, atol=0)
    # Zero / tiny gradients: the denominator is ≥ log(2)/β, never ~0.
    outs, _ = _run(ScaleByPNM(softplus=True), [[0.0, 1e-30]] * 3)
    for out in outs:
        assert torch.isfinite(out).all() and out.abs().max() < 1e-25


def test_pnm_adamd_skips_first_moment_correction():
    outs, _ = _run(ScaleByPNM(adamd=True), [[1.0]] * 2, pnm_beta0=0.0, betas=(0.9, 0.999))
    # t=1: m = (1 − 0.81)·1 uncorrected, v̂ = 1.
    assert float(outs[0][0]) == pytest.approx(0.19 / (1 + 1e-8), rel=1e-12)


@pytest.mark.parametrize(
    ("key", "value"),
    [("pnm_beta0", -0.1), ("pnm_beta0", float("nan")), ("softplus_beta", 0.0)],
)
def test_pnm_options_name_the_key(key, value):
    params = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(ValueError, match=key):
        ChainOptimizer(params, chain=[ScaleByPNM()], defaults={key: value})
    with pytest.raises(ValueError, match=key):
        ChainOptimizer([{"params": params, key: value}], chain=[ScaleByPNM()], defaults={})


def _defaults(**kw):
    d = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    d.update(pnm_beta0=1.0, softplus_beta=50.0)
    d.update(kw)
    return d


@pytest.mark.parametrize(("mode", "amsgrad"), [("keep", False), ("project", True)])
def test_pnm_inside_galore_trains_at_low_rank(mode, amsgrad):
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.zeros(16, 32))
    X = torch.randn(32, 64)
    target = 0.3 * torch.randn(16, 4) @ torch.randn(4, 32) @ X  # reachable by a low-rank W
    defaults = _defaults(lr=0.1, rank=4, update_proj_gap=5, scale=1.0, moments_on_refresh=mode)
    opt = ChainOptimizer([W], [GaLore(ScaleByPNM(amsgrad=amsgrad))], defaults)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = (W @ X - target).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.1 * losses[0]
    state = opt.state[W]
    assert int(state["galore.refreshes"]) >= 12
    for key in ("pnm.exp_avg", "pnm.neg_exp_avg", "pnm.exp_avg_sq"):
        assert state[key].shape == (4, 32) and torch.isfinite(state[key]).all()
    assert ("pnm.max_exp_avg_sq" in state) == amsgrad
    assert opt.state_bytes()["moments"] == (4 if amsgrad else 3) * 4 * 32 * 4


# ---- schedules ------------------------------------------------------------------------


def test_warmup_length_rules():
    assert warmup_length(10000, beta2=0.999) == 2000  # ⌈2/(1 − β₂)⌉
    assert warmup_length(3000, beta2=0.999) == 660  # 2000 > 0.45·3000 → 0.22·3000
    assert warmup_length(1000, beta2=0.99) == 200
    assert warmup_length(10, warmup_iterations=7) == 7


def test_ranger21_lr_hand_computed_points():
    base, lo, n = 1e-3, 3e-5, 10000
    assert ranger21_lr(base, 0, n) == pytest.approx(base / 2000, rel=1e-12)
    assert ranger21_lr(base, 999, n) == pytest.approx(base / 2, rel=1e-12)
    assert ranger21_lr(base, 1999, n) == base  # end of warmup
    assert ranger21_lr(base, 5000, n) == base
    assert ranger21_lr(base, 7200, n) == base  # 72%: warmdown starts
    assert ranger21_lr(base, 8600, n) == pytest.approx((base + lo) / 2, rel=1e-12)
    assert ranger21_lr(base, n, n) == pytest.approx(lo, rel=1e-12)
    assert ranger21_lr(base, n + 500, n) == pytest.approx(lo, rel=1e-12)
    # 22% rule: W = 660, S = 2160, halfway down at 2580.
    assert ranger21_lr(base, 329, 3000) == pytest.approx(base / 2, rel=1e-12)
    assert ranger21_lr(base, 659, 3000) == base
    assert ranger21_lr(base, 2580, 3000) == pytest.approx((base + lo) / 2, rel=1e-12)
    assert ranger21_lr(1e-5, 9999, n) == 1e-5  # base ≤ min_lr: no warmdown
    assert ranger21_lr(base, 0, n, warmup=False) == base
    assert ranger21_lr(base, n, n, warmdown=False) == base


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_iterations": 0}, "num_iterations"),
        ({"warmdown_start": 1.0}, "warmdown_start"),
        ({"warmdown_start": 0.0}, "warmdown_start"),
        ({"min_lr": -1.0}, "min_lr"),
        ({"beta2": 1.0}, "beta2"),
        ({"warmup_iterations": -1}, "warmup_iterations"),
        ({"step": -1}, "step"),
    ],
)
def test_ranger21_lr_validation(kwargs, name):
    args = {"base_lr": 1e-3, "step": 0, "num_iterations": 100, **kwargs}
    with pytest.raises(ValueError, match=name):
        ranger21_lr(**args)


def _model_opt(kind):
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))
    groups = [{"params": [a], "lr": 1e-3}, {"params": [b], "lr": 1e-2}]
    if kind == "sgd":
        return [a, b], torch.optim.SGD(groups, momentum=0.9)
    return [a, b], torch.optim.AdamW(groups, betas=(0.9, 0.99))


def _train(params, opt, sched, steps):
    lrs = []
    for _ in range(steps):
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.zero_grad()
        sum(p.pow(2).sum() for p in params).backward()
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_schedule_per_group_curves_with_torch_optimizers(kind):
    params, opt = _model_opt(kind)
    sched = Ranger21Schedule(opt, 1000)  # β₂ = 0.99 from AdamW (W = 200); SGD: 0.999 → 220
    beta2 = 0.99 if kind == "adamw" else 0.999
    assert sched.settings["beta2"] == beta2
    lrs = _train(params, opt, sched, 1010)
    for step, pair in enumerate(lrs):
        for base, lr in zip((1e-3, 1e-2), pair, strict=True):
            assert lr == pytest.approx(ranger21_lr(base, step, 1000, beta2=beta2), rel=1e-12)
    assert lrs[0][1] == pytest.approx(10 * lrs[0][0])  # each group its own curve
    assert lrs[-1] == pytest.approx([3e-5, 3e-5])


def test_schedule_state_dict_round_trip_resumes_identically():
    params, opt = _model_opt("adamw")
    sched = Ranger21Schedule(opt, 600, warmup_iterations=100, min_lr=1e-4)
    _train(params, opt, sched, 350)
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    expected = _train(params, opt, sched, 200)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    params2, opt2 = _model_opt("adamw")
    sched2 = Ranger21Schedule(opt2, 600, warmup_iterations=100, min_lr=1e-4)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    with torch.no_grad():
        for p in params2:
            p.zero_()
    assert _train(params2, opt2, sched2, 200) == expected


def test_warmup_and_warmdown_alone():
    params, opt = _model_opt("sgd")
    sched = LinearWarmup(opt, 100, warmup_iterations=10)
    lrs = _train(params, opt, sched, 120)
    assert lrs[0][0] == pytest.approx(1e-4) and lrs[9][0] == 1e-3 and lrs[119][0] == 1e-3
    params, opt = _model_opt("sgd")
    sched = WarmdownToMin(opt, 100, warmdown_start=0.5, min_lr=0.0)
    lrs = _train(params, opt, sched, 101)
    assert lrs[0][1] == 1e-2 and lrs[75][1] == pytest.approx(5e-3) and lrs[100][1] == 0.0


def test_schedule_drives_a_galore2_optimizer():
    W = torch.nn.Parameter(torch.randn(8, 16))
    opt = ChainOptimizer([W], [GaLore(ScaleByPNM())], _defaults(rank=2))
    sched = Ranger21Schedule(opt, 50, warmup_iterations=5)
    lrs = _train([W], opt, sched, 10)
    assert [x[0] for x in lrs[:5]] == pytest.approx([2e-3, 4e-3, 6e-3, 8e-3, 1e-2])
