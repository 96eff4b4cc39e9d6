"""The Ranger21 presets: composition, AdamW equivalence, switches, GaLore placement, resume."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import galore2
from galore2.core.modules import compute_stats

from ..helpers import TinyNet, batch, galore_groups, max_diff, train

ALL_OFF = dict(
    use_agc=False, use_gc=False, use_gn=False, use_pnm=False, softplus=False,
    use_norm_loss=False, use_stable_weight_decay=False, use_lookahead=False,
    use_warmup=False, use_warmdown=False,
)  # fmt: skip
SWITCHES = ["use_agc", "use_gc", "use_gn", "use_pnm", "softplus", "use_norm_loss",
            "use_stable_weight_decay", "use_lookahead", "use_warmup", "use_warmdown"]  # fmt: skip


def ranger(model, cls=galore2.Ranger21, params=None, **kw):
    settings = {"lr": 1e-2, "weight_decay": 1e-2, "num_iterations": 40, **kw}
    return cls(params if params is not None else model.parameters(), **settings)


@pytest.mark.parametrize("cls", [galore2.Ranger21, galore2.GaLoreRanger21])
def test_every_component_off_is_adamw(cls):
    a, b = TinyNet(), TinyNet()
    b.load_state_dict(a.state_dict())
    train(a, torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=1e-2), range(12))
    train(b, ranger(b, cls, **ALL_OFF), range(12))
    assert max_diff(a, b) < 1e-6


@pytest.mark.parametrize("switch", SWITCHES)
def test_every_switch_changes_the_run(switch):
    """Regression for flags that the reference stores but never reads."""
    base = {**ALL_OFF, "use_pnm": True}  # softplus / amsgrad switches act on PNM
    on, off = dict(base), dict(base)
    on[switch], off[switch] = True, False
    a, b = TinyNet(), TinyNet()
    b.load_state_dict(a.state_dict())
    # num_iterations 14: warmup 4 steps (22% rule), warmdown from step 10 — both reached
    train(a, ranger(a, num_iterations=14, **on), range(12))
    train(b, ranger(b, num_iterations=14, **off), range(12))
    assert max_diff(a, b) > 1e-6, switch


def test_impossible_combinations_raise_at_construction():
    model = TinyNet()
    with pytest.raises(ValueError, match="need use_pnm=True"):
        galore2.Ranger21(model.parameters(), num_iterations=10, use_pnm=False)
    with pytest.raises(ValueError, match="num_iterations"):
        galore2.Ranger21(model.parameters())
    with pytest.raises(ValueError, match="lookahead_dtype"):
        galore2.Ranger21(model.parameters(), num_iterations=10, lookahead_dtype="int8")
    with pytest.raises(TypeError, match="GaLoreRanger21"):
        galore2.Ranger21(model.parameters(), num_iterations=10, rank=4)


def test_default_ranger21_trains_and_resumes_bit_identically():
    """Mid-lookahead-cycle and mid-warmup resume through a weights_only checkpoint."""
    model = TinyNet()
    twin = copy.deepcopy(model)
    opt = ranger(model, warmup_iterations=10)
    losses = train(model, opt, range(20))
    assert losses[-1] < losses[0]

    first = ranger(twin, warmup_iterations=10)
    train(twin, first, range(7))  # lookahead k=5: 2 steps into the second cycle
    buf = io.BytesIO()
    torch.save({"model": twin.state_dict(), "opt": first.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed_model = TinyNet()
    resumed_model.load_state_dict(saved["model"])
    resumed = ranger(resumed_model, warmup_iterations=10)
    resumed.load_state_dict(saved["opt"])
    train(resumed_model, resumed, range(7, 20))
    assert max_diff(model, resumed_model) == 0.0


def test_galore_ranger21_moments_are_low_rank_and_sigma_uses_full_counts():
    model = TinyNet()
    groups = galore_groups(model, rank=4, update_proj_gap=5)
    opt = ranger(model, galore2.GaLoreRanger21, params=groups)
    start = copy.deepcopy(model)
    losses = train(model, opt, range(15))
    assert all(torch.isfinite(torch.tensor(losses))) and max_diff(model, start) > 1e-3
    for p in groups[0]["params"]:
        shape = tuple(opt.state[p]["pnm.exp_avg_sq"].shape)
        assert 4 in shape and shape != tuple(p.shape), shape
    # σ²: low-rank second moments summed as stored, divided by the full element count
    items = [
        (g, opt.state[p], opt._engine.context(p, 0)) for g in opt.param_groups for p in g["params"]
    ]
    expected = torch.zeros((), dtype=torch.float64)
    for g, state, _ in items:
        t = int(state["pnm.step"])
        expected += state["pnm.exp_avg_sq"].double().sum() / (1 - g["betas"][1] ** t)
    numel = sum(p.numel() for p in model.parameters())
    got = compute_stats(opt._chain, items).second_moment_mean
    assert torch.allclose(got, expected / numel, rtol=1e-10)


def test_builtin_schedule_keeps_per_group_lr():
    model = TinyNet()
    opt = galore2.Ranger21(
        [{"params": [model.up.weight], "lr": 1e-3}, {"params": [model.mid.weight], "lr": 1e-2}],
        num_iterations=100, warmup_iterations=10, **{k: False for k in SWITCHES[:-2]},
    )  # fmt: skip
    ups, mids = [], []
    for p, out in ((model.up.weight, ups), (model.mid.weight, mids)):
        before = p.detach().clone()
        p.grad = torch.ones_like(p)
        opt.step()
        out.append((before - p.detach()).abs().max().item())
        p.grad = None
    assert opt.param_groups[0]["lr"] == 1e-3 and opt.param_groups[1]["lr"] == 1e-2  # unchanged
    assert mids[0] / ups[0] == pytest.approx(10.0, rel=1e-3)  # each group its own base lr


def test_per_layer_refuses_stable_weight_decay_but_runs_without_it():
    model = TinyNet()
    opt = ranger(model)
    updates = galore2.per_layer(model, opt)
    x = torch.randn(4, 24)
    with pytest.raises(ValueError, match="per-layer"):
        updates.backward(model(x).pow(2).mean())
    model = TinyNet()
    opt = ranger(model, use_stable_weight_decay=False)
    updates = galore2.per_layer(model, opt)
    before = model.up.weight.detach().clone()
    updates.backward(model(x).pow(2).mean())
    assert not torch.equal(before, model.up.weight)


def test_state_bytes_reports_lookahead_and_bf16_halves_it():
    model = TinyNet()
    n = sum(p.numel() for p in model.parameters())
    for dtype, size in ((None, 4), ("bfloat16", 2)):
        opt = ranger(model, lookahead_dtype=dtype)
        opt.init_state()
        assert opt.state_bytes()["lookahead"] == n * size


def test_gradient_modules_act_on_the_full_gradient_before_projection():
    """GaLoreRanger21 with only centralization on = GaLoreAdamW fed centralized gradients."""
    a, b = TinyNet(), TinyNet()
    b.load_state_dict(a.state_dict())
    settings = {"rank": 4, "update_proj_gap": 5, "projector": "svd"}
    opt_a = ranger(a, galore2.GaLoreRanger21, params=galore_groups(a, **settings),
                   **{**ALL_OFF, "use_gc": True})  # fmt: skip
    opt_b = galore2.GaLoreAdamW(galore_groups(b, **settings), lr=1e-2, weight_decay=1e-2)
    for step in range(12):
        for model, opt in ((a, opt_a), (b, opt_b)):
            x, y = batch(step)
            opt.zero_grad()
            (model(x) - y).pow(2).mean().backward()
            if opt is opt_b:  # centralize by hand: subtract each row's mean (≥2-D only)
                for p in model.parameters():
                    if p.dim() > 1:
                        p.grad -= p.grad.mean(dim=tuple(range(1, p.dim())), keepdim=True)
            opt.step()
    assert max_diff(a, b) < 1e-6
    assert int(opt_a.state[a.up.weight]["galore.refreshes"]) == 3  # projected throughout


def test_galore_keys_give_the_hint_once():
    """Issue 30 item 7: one hint for all the GaLore keys, not one per key."""
    p = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(TypeError, match=r"\['rank', 'update_proj_gap'\]") as e:
        galore2.Ranger21([p], num_iterations=10, rank=8, update_proj_gap=5)
    assert str(e.value).count("need GaLoreRanger21") == 1
    opt = galore2.Ranger21([p], num_iterations=10)
    with pytest.raises(ValueError) as e:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "rank": 2, "scale": 1})
    assert str(e.value).count("need GaLoreRanger21") == 1
