"""GaLoreAdamW honours the ``torch.optim.Optimizer`` contract (checked against torch.optim.AdamW)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import galore2

from .helpers import TinyNet, batch, galore_groups, max_diff, train

TOL = 1e-6


def clone_params(params) -> list[nn.Parameter]:
    return [nn.Parameter(p.detach().clone()) for p in params]


def feed(grads_from: torch.Generator, *param_lists) -> None:
    """Give each list the same random gradients."""
    for ps in zip(*param_lists, strict=True):
        g = torch.randn(ps[0].shape, generator=grads_from)
        for p in ps:
            p.grad = g.clone().to(p.dtype)


def max_abs(a, b) -> float:
    return max(
        float((x.detach().double() - y.detach().double()).abs().max())
        for x, y in zip(a, b, strict=True)
    )


# ---- closures and zero_grad -------------------------------------------------------


def test_closure_returns_loss_and_matches_adamw():
    torch.manual_seed(0)
    ours_model = TinyNet()
    ref_model = copy.deepcopy(ours_model)
    ours = galore2.GaLoreAdamW(ours_model.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    calls = []

    def closure_for(model, opt):
        def closure():
            calls.append(torch.is_grad_enabled())
            opt.zero_grad()
            x, y = batch(len(calls))
            loss = (model(x) - y).pow(2).mean()
            loss.backward()  # needs grad mode inside step()'s no_grad
            return loss

        return closure

    for _ in range(3):
        loss = ours.step(closure_for(ours_model, ours))
        calls.pop()
        ref_loss = ref.step(closure_for(ref_model, ref))
        assert isinstance(loss, torch.Tensor) and loss.ndim == 0
        assert torch.allclose(loss, ref_loss, rtol=0, atol=TOL)
    assert calls == [True] * 3
    assert max_diff(ours_model, ref_model) <= TOL
    assert ours.step() is None  # no closure → None


def test_zero_grad():
    torch.manual_seed(0)
    model = TinyNet()
    opt = galore2.GaLoreAdamW(galore_groups(model, rank=4), lr=1e-2)
    x, y = batch(0)
    (model(x) - y).pow(2).mean().backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # nothing has a gradient: nothing moves, no state
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert len(opt.state) == 0


# ---- learning rates ---------------------------------------------------------------


def test_lambda_lr_matches_adamw():
    torch.manual_seed(0)
    params = [torch.randn(6, 5), torch.randn(5)]
    ours_p, ref_p = clone_params(params), clone_params(params)
    ours = galore2.GaLoreAdamW(ours_p, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_p, lr=1e-2, weight_decay=0.1)
    factor = lambda s: [1.0, 0.5, 3.0, 0.1, 0.0, 2.0, 1.0, 0.25][s % 8]  # noqa: E731
    ours_s = torch.optim.lr_scheduler.LambdaLR(ours, factor)
    ref_s = torch.optim.lr_scheduler.LambdaLR(ref, factor)
    gen = torch.Generator().manual_seed(0)
    for step in range(10):
        feed(gen, ours_p, ref_p)
        before = [p.detach().clone() for p in ours_p]
        ours.step()
        ref.step()
        assert max_abs(ours_p, ref_p) <= TOL
        if factor(step) == 0.0:  # lr 0: not even weight decay moves the weights
            assert all(torch.equal(a, b) for a, b in zip(before, ours_p, strict=True))
        ours_s.step()
        ref_s.step()
        assert ours.param_groups[0]["lr"] == pytest.approx(1e-2 * factor(step + 1))


def test_scheduler_drives_galore_group():
    """The scheduler's lr reaches the projected update: a zero lr step changes nothing."""
    torch.manual_seed(0)
    W = nn.Parameter(torch.randn(12, 8))
    opt = galore2.GaLoreAdamW([W], lr=1e-2, rank=3, update_proj_gap=2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: [1.0, 0.0, 4.0][s % 3])
    gen = torch.Generator().manual_seed(0)
    moves = []
    for _ in range(3):
        W.grad = torch.randn(W.shape, generator=gen)
        before = W.detach().clone()
        opt.step()
        sched.step()
        moves.append(float((W.detach() - before).abs().max()))
    assert moves[1] == 0.0
    # same Adam direction magnitude (~scale) at lr 1e-2 vs 4e-2
    assert 2.0 < moves[2] / moves[0] < 8.0


def test_per_group_lr_and_add_param_group_after_steps_match_adamw():
    torch.manual_seed(0)
    a, b, c = torch.randn(4, 6), torch.randn(6), torch.randn(3, 3)
    (oa, ob, oc), (ra, rb, rc) = clone_params([a, b, c]), clone_params([a, b, c])
    ours = galore2.GaLoreAdamW([{"params": [oa]}, {"params": [ob], "lr": 3e-2}], lr=1e-2)
    ref = torch.optim.AdamW([{"params": [ra]}, {"params": [rb], "lr": 3e-2}], lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        if step == 3:
            ours.add_param_group({"params": [oc], "lr": 5e-3, "weight_decay": 0.0})
            ref.add_param_group({"params": [rc], "lr": 5e-3, "weight_decay": 0.0})
        live = 2 if step < 3 else 3
        feed(gen, [oa, ob, oc][:live], [ra, rb, rc][:live])
        ours.step()
        ref.step()
        assert max_abs([oa, ob, oc], [ra, rb, rc]) <= TOL
    assert [g["lr"] for g in ours.param_groups] == [1e-2, 3e-2, 5e-3]
    assert int(ours.state[oc]["adam.step"]) == 3
    assert not torch.equal(oc.detach(), c)


def test_add_galore_group_after_steps():
    torch.manual_seed(0)
    b = nn.Parameter(torch.randn(6))
    W = nn.Parameter(torch.randn(10, 16))
    opt = galore2.GaLoreAdamW([b], lr=1e-2)
    for _ in range(2):
        b.grad = torch.randn_like(b)
        opt.step()
    opt.add_param_group({"params": [W], "rank": 4, "proj_type": "left"})
    assert W not in opt.state
    b.grad, W.grad = torch.randn_like(b), torch.randn_like(W)
    opt.step()
    assert int(opt.state[W]["galore.side"]) == 1
    assert opt.state[W]["adam.exp_avg"].shape == (4, 16)
    assert opt.state[W]["proj.left"].shape == (10, 4)
    assert int(opt.state[b]["adam.step"]) == 3 and int(opt.state[W]["adam.step"]) == 1


# ---- maximize ---------------------------------------------------------------------


def test_maximize_matches_adamw():
    torch.manual_seed(0)
    params = [torch.randn(5, 7), torch.randn(7)]
    ours_p, ref_p = clone_params(params), clone_params(params)
    ours = galore2.GaLoreAdamW(ours_p, lr=1e-2, maximize=True)
    ref = torch.optim.AdamW(ref_p, lr=1e-2, maximize=True)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        feed(gen, ours_p, ref_p)
        ours.step()
        ref.step()
    assert max_abs(ours_p, ref_p) <= TOL
    assert not torch.allclose(ours_p[0], params[0])


@pytest.mark.parametrize("projector", ["svd", "randomized", "power", "random"])
def test_maximize_galore_equals_minimizing_negated_grad(projector):
    torch.manual_seed(0)
    W = torch.randn(12, 8)
    (up,), (down,) = clone_params([W]), clone_params([W])
    kw = {"lr": 1e-2, "rank": 3, "update_proj_gap": 2, "projector": projector}
    opt_up = galore2.GaLoreAdamW([up], maximize=True, **kw)
    opt_down = galore2.GaLoreAdamW([down], **kw)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        g = torch.randn(W.shape, generator=gen)
        up.grad, down.grad = g.clone(), -g
        opt_up.step()
        opt_down.step()
    assert torch.allclose(up, down, rtol=0, atol=1e-7)
    assert not torch.allclose(up, W)


# ---- dtypes and state_dict --------------------------------------------------------


def roundtrip(opt: torch.optim.Optimizer) -> dict:
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.mark.parametrize("state_dtype", list(STATE_DTYPES))
@pytest.mark.parametrize("rank", [None, 3])
def test_bf16_params_state_dtype_and_state_dict_roundtrip(state_dtype, rank):
    torch.manual_seed(0)
    init = [torch.randn(12, 8).bfloat16(), torch.randn(8).bfloat16()]
    params = clone_params(init)
    kw = {"lr": 1e-2, "rank": rank, "update_proj_gap": 2, "state_dtype": state_dtype}
    opt = galore2.GaLoreAdamW(params, **kw)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        feed(gen, params)
        opt.step()
    want = STATE_DTYPES[state_dtype]

    def check_dtypes(o, ps):
        for p in ps:
            st = o.state[p]
            assert st["adam.exp_avg"].dtype == want and st["adam.exp_avg_sq"].dtype == want
            assert st["adam.step"].dtype == torch.int64
            assert st["galore.side"].dtype == torch.int64
            for key in ("proj.left", "proj.right"):
                if key in st:
                    assert st[key].dtype == torch.float32
            assert p.dtype == torch.bfloat16

    check_dtypes(opt, params)
    if rank is not None:
        assert int(opt.state[params[0]]["galore.side"]) == 2  # 12×8 → right

    # resume into a fresh optimizer over fresh copies of the weights
    saved = roundtrip(opt)
    params2 = clone_params(params)
    opt2 = galore2.GaLoreAdamW(params2, **kw)
    opt2.load_state_dict(saved)
    check_dtypes(opt2, params2)
    for p, q in zip(params, params2, strict=True):
        for key, value in opt.state[p].items():
            assert torch.equal(opt2.state[q][key], value), key
    # and continue identically
    gen2 = torch.Generator().manual_seed(7)
    for _ in range(3):
        feed(gen2, params, params2)
        opt.step()
        opt2.step()
    assert all(torch.equal(a, b) for a, b in zip(params, params2, strict=True))
    check_dtypes(opt2, params2)


def test_bf16_param_fp32_state_step_matches_fp32_adamw():
    """With fp32 moments a bf16 weight gets the fp32 AdamW update, rounded once or twice."""
    torch.manual_seed(0)
    w = torch.randn(6, 10).bfloat16()
    (ours_p,), (ref_p,) = clone_params([w]), clone_params([w.float()])
    ours = galore2.GaLoreAdamW([ours_p], lr=1e-1, weight_decay=0.1)
    ref = torch.optim.AdamW([ref_p], lr=1e-1, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        g = torch.randn(w.shape, generator=gen).bfloat16()
        ours_p.grad, ref_p.grad = g, g.float()
        before = ours_p.detach().float()
        ours.step()
        ref.step()
        # bf16 spacing at the larger of |w| before / after: two roundings (decay, update)
        ulp = torch.maximum(before.abs(), ref_p.detach().abs()) * 2.0**-7
        assert ((ours_p.detach().float() - ref_p.detach()).abs() <= 2 * ulp).all()
        assert not torch.equal(ours_p.detach().float(), before)
        ref_p.data.copy_(ours_p.float())  # follow our rounding, compare the next step only
    assert ours.state[ours_p]["adam.exp_avg"].dtype == torch.float32
    ref_m = ref.state[ref_p]["exp_avg"]
    assert torch.allclose(ours.state[ours_p]["adam.exp_avg"], ref_m, rtol=0, atol=1e-6)


def test_state_dict_roundtrip_resumes_galore_training_exactly():
    torch.manual_seed(0)
    model = TinyNet()
    opt = galore2.GaLoreAdamW(galore_groups(model, rank=4, update_proj_gap=3), lr=1e-2)
    train(model, opt, range(4))
    model2 = copy.deepcopy(model)
    opt2 = galore2.GaLoreAdamW(galore_groups(model2, rank=4, update_proj_gap=3), lr=1e-2)
    opt2.load_state_dict(roundtrip(opt))
    train(model, opt, range(4, 9))
    train(model2, opt2, range(4, 9))
    assert max_diff(model, model2) == 0.0


# ---- laziness and hooks -----------------------------------------------------------


def test_state_created_lazily_in_step():
    torch.manual_seed(0)
    model = TinyNet()
    opt = galore2.GaLoreAdamW(galore_groups(model, rank=4), lr=1e-2)
    assert len(opt.state) == 0
    assert opt.state_dict()["state"] == {}
    assert opt.state_bytes()["total"] == 0
    x, y = batch(0)
    (model(x) - y).pow(2).mean().backward()
    assert len(opt.state) == 0  # backward alone creates nothing
    opt.step()
    assert len(opt.state) == len(list(model.parameters()))
    assert opt.state_bytes()["total"] > 0


def test_init_state_creates_everything_first_step_would():
    torch.manual_seed(0)
    model, model2 = TinyNet(), TinyNet()
    opt = galore2.GaLoreAdamW(galore_groups(model, rank=4), lr=1e-2)
    opt.init_state()
    opt2 = galore2.GaLoreAdamW(galore_groups(model2, rank=4), lr=1e-2)
    train(model2, opt2, range(1))
    assert opt.state_bytes() == opt2.state_bytes()
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert set(opt.state[p]) == set(opt2.state[q])


def test_step_hooks_are_called():
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(8, 6))
    opt = galore2.GaLoreAdamW([p], rank=2)
    events = []

    def pre(optimizer, args, kwargs):
        events.append(("pre", optimizer is opt, p in optimizer.state))

    def post(optimizer, args, kwargs):
        events.append(("post", optimizer is opt, p in optimizer.state))

    h1 = opt.register_step_pre_hook(pre)
    h2 = opt.register_step_post_hook(post)
    p.grad = torch.randn_like(p)
    opt.step()
    opt.step()
    assert events == [
        ("pre", True, False),  # before the first step: no state yet
        ("post", True, True),
        ("pre", True, True),
        ("post", True, True),
    ]
    h1.remove()
    h2.remove()
    opt.step()
    assert len(events) == 4


def test_is_a_torch_optimizer():
    p = nn.Parameter(torch.randn(4, 4))
    opt = galore2.GaLoreAdamW([p], lr=1e-3)
    assert isinstance(opt, torch.optim.Optimizer)
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"], g["maximize"]) == (
        1e-3,
        (0.9, 0.999),
        1e-8,
        1e-2,
        False,
    )
