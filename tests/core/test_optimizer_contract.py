"""The ``torch.optim.Optimizer`` contract, for every public galore2 optimizer.

In the spirit of torch's ``OptimizerInfo`` (``torch/testing/_internal/common_optimizers.py``):
one table, :data:`OPTIMIZERS`, lists each optimizer with a plain group (``rank`` None) and,
for the GaLore ones, with a GaLore group; every ``test_*`` below runs over the whole table.
The tests after the table compare GaLoreAdamW with ``torch.optim.AdamW`` (closures, lr
schedules, per-group lr, maximize, hooks).
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

import galore2

from ..helpers import F32_EPS, TinyNet, assert_f32_close, batch, galore_groups, max_diff

# ---- the table -----------------------------------------------------------------------------

RANK, GAP = 8, 2  # refreshes at steps 0, 2, 4, …


@dataclass(frozen=True)
class OptimizerInfo:
    name: str
    cls: Callable[..., torch.optim.Optimizer]
    rank: int | None  # the matrices' group: None = plain
    kwargs: dict[str, Any] = field(default_factory=dict)  # needed beyond lr
    step_key: str = "adam.step"  # the per-parameter step counter in the state
    # counters that tick on every step(), skipped updates included (a group's lr clock)
    clock_keys: tuple[str, ...] = ()
    # (kwargs, the argument the error must name): each must raise, as a constructor argument
    # and as a key of a group added later; init_errors: as a constructor argument
    errors: tuple[tuple[dict[str, Any], str], ...] = ()
    init_errors: tuple[tuple[dict[str, Any], str], ...] = ()

    @property
    def id(self) -> str:
        return f"{self.name}-{'plain' if self.rank is None else 'galore'}"

    def groups(self, params: list[nn.Parameter], **matrix_keys: Any) -> list[dict[str, Any]]:
        """Matrices in one group (GaLore when ``rank`` is set), vectors in another."""
        mats = [p for p in params if p.dim() >= 2]
        vecs = [p for p in params if p.dim() < 2]
        galore = {"rank": self.rank, "update_proj_gap": GAP} if self.rank else {}
        return [{"params": mats, **galore, **matrix_keys}, {"params": vecs}]

    def build(self, params: list[nn.Parameter], **overrides: Any) -> torch.optim.Optimizer:
        return self.cls(self.groups(params), **{"lr": 1e-2, **self.kwargs, **overrides})


COMMON_ERRORS = (
    ({"lr": -1e-3}, "lr"),
    ({"weight_decay": -0.1}, "weight_decay"),
    ({"nonfinite": "sometimes"}, "nonfinite"),
    ({"state_dtype": "int3"}, "state_dtype"),
)
ADAM_ERRORS = (
    ({"betas": (1.0, 0.999)}, "betas"),
    ({"betas": (0.9, -0.1)}, "betas"),
    ({"betas": 0.9}, "betas"),
    ({"eps": 0.0}, "eps"),
    ({"eps": -1e-8}, "eps"),
)
ADAFACTOR_ERRORS = (
    ({"eps": 1e-8}, "eps"),  # Adam's form: Adafactor's eps is a pair
    ({"eps": (0.0, 1e-3)}, "eps"),
    ({"beta2_decay": 0.5}, "beta2_decay"),
    ({"d": 0.5}, "d"),
    ({"beta1": 1.0}, "beta1"),
)
GALORE_ERRORS = (
    ({"rank": 0}, "rank"),
    ({"rank": -2}, "rank"),
    ({"rank": 2.5}, "rank"),
    ({"proj_type": "diagonal"}, "proj_type"),
    ({"projector": "qr"}, "projector"),
    ({"update_proj_gap": 0}, "update_proj_gap"),
    ({"scale": 0.0}, "scale"),
    ({"moments_on_refresh": "rotate"}, "moments_on_refresh"),
)
# Constructor-only checks: the Ranger21 presets' switches, and Ranger21's refusal of GaLore
# options. As group keys these are not validated today (a group {"num_iterations": 0} is
# accepted and fails at step(); Ranger21 accepts and ignores a group "rank").
RANGER_INIT_ERRORS = (
    ({"num_iterations": 0}, "num_iterations"),
    ({"lookahead_dtype": "int8"}, "lookahead_dtype"),
    ({"use_pnm": False}, "softplus"),  # softplus (on by default) modifies PNM
)
NOT_GALORE_ERRORS = (({"rank": 4}, "rank"), ({"proj_type": "left"}, "proj_type"))
RANGER = {"num_iterations": 20, "warmup_iterations": 2}

OPTIMIZERS = [
    OptimizerInfo(
        "GaLoreAdamW", galore2.GaLoreAdamW, rank,
        errors=COMMON_ERRORS + ADAM_ERRORS + GALORE_ERRORS,
    )
    for rank in (None, RANK)
] + [
    OptimizerInfo(
        "GaLoreAdamW8bit", galore2.GaLoreAdamW8bit, rank,
        errors=COMMON_ERRORS + ADAM_ERRORS + GALORE_ERRORS,
    )
    for rank in (None, RANK)
] + [
    OptimizerInfo(
        "GaLoreAdafactor", galore2.GaLoreAdafactor, rank, step_key="adafactor.step",
        errors=COMMON_ERRORS + ADAFACTOR_ERRORS + GALORE_ERRORS,
    )
    for rank in (None, RANK)
] + [
    OptimizerInfo(
        "Ranger21", galore2.Ranger21, None, RANGER, step_key="pnm.step",
        clock_keys=("schedule.step",),
        errors=COMMON_ERRORS + ADAM_ERRORS,
        init_errors=RANGER_INIT_ERRORS + NOT_GALORE_ERRORS,
    )
] + [
    OptimizerInfo(
        "GaLoreRanger21", galore2.GaLoreRanger21, rank, RANGER, step_key="pnm.step",
        clock_keys=("schedule.step",),
        errors=COMMON_ERRORS + ADAM_ERRORS + GALORE_ERRORS,
        init_errors=RANGER_INIT_ERRORS,
    )
    for rank in (None, RANK)
]  # fmt: skip

each_optimizer = pytest.mark.parametrize("info", OPTIMIZERS, ids=lambda i: i.id)

# ---- parameters and gradients --------------------------------------------------------------

# 16×512: its own moments (8192) and a rank-8 left moment (8 × 512 = 4096) are large enough
# for GaLoreAdamW8bit's 8-bit storage (>= 4096 elements); 10×12 and the vectors are not.
SHAPES = [(16, 512), (16,), (10, 12), (10,)]


def make_params(dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter((0.5 * torch.randn(s, generator=g)).to(dtype)) for s in SHAPES]


def clone(params: list[nn.Parameter]) -> list[nn.Parameter]:
    return [nn.Parameter(p.detach().clone()) for p in params]


def set_grads(params: list[nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def run(opt: torch.optim.Optimizer, params: list[nn.Parameter], steps: range) -> None:
    for step in steps:
        set_grads(params, step)
        opt.step()


def roundtrip(opt: torch.optim.Optimizer) -> dict:
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def snapshot(opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[dict]:
    """Each parameter and its state, cloned."""
    out = []
    for p in params:
        state = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
        out.append({"param": p.detach().clone(), **state})
    return out


def assert_same(a: list[dict], b: list[dict]) -> None:
    """Bitwise equal snapshots: same keys, dtypes, shapes, values (NaN equal to NaN)."""
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert sorted(x) == sorted(y), (i, sorted(x), sorted(y))
        for key, value in x.items():
            other = y[key]
            if torch.is_tensor(value):
                assert value.dtype == other.dtype and value.shape == other.shape, (i, key)
                assert torch.equal(value, other) or (
                    value.is_floating_point()
                    and torch.equal(value.nan_to_num(), other.nan_to_num())
                ), (i, key)
            else:
                assert value == other, (i, key)


# ---- state_dict, resume ------------------------------------------------------------------


def save_and_load(info: OptimizerInfo, dtype: torch.dtype = torch.float32):
    """3 steps (across a refresh), then a state_dict through ``torch.save`` /
    ``torch.load(weights_only=True)`` into a fresh optimizer over copies of the weights."""
    params = make_params(dtype)
    opt = info.build(params)
    run(opt, params, range(3))
    saved = roundtrip(opt)
    params2 = clone(params)
    opt2 = info.build(params2)
    opt2.load_state_dict(saved)
    return (opt, params), (opt2, params2), saved


def settings(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


@each_optimizer
def test_state_dict_roundtrip_through_torch_save(info):
    """The loaded optimizer holds every state tensor (dtype, shape, value) and every group
    setting of the saved one."""
    (opt, params), (opt2, params2), saved = save_and_load(info)
    assert_same(snapshot(opt, params), snapshot(opt2, params2))
    for g, h in zip(opt.param_groups, opt2.param_groups, strict=True):
        assert settings(g) == settings(h)
    assert opt2.state_dict()["state"].keys() == saved["state"].keys()


@each_optimizer
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_resume_is_bit_identical(info, dtype):
    """Saved after 3 steps, loaded, trained 4 more: parameters and state equal an
    uninterrupted run's bit for bit."""
    (opt, params), (opt2, params2), _ = save_and_load(info, dtype)
    run(opt, params, range(3, 7))
    run(opt2, params2, range(3, 7))
    assert_same(snapshot(opt, params), snapshot(opt2, params2))
    assert all(p.dtype == dtype for p in params2)


# ---- bad arguments -------------------------------------------------------------------------


def _error_cases():
    for info in OPTIMIZERS:
        for errors, in_group in ((info.errors, True), (info.init_errors, False)):
            for kwargs, name in errors:
                key, value = next(iter(kwargs.items()))
                yield pytest.param(info, kwargs, name, in_group, id=f"{info.id}-{key}={value!r}")


@pytest.mark.parametrize(("info", "kwargs", "name", "in_group"), list(_error_cases()))
def test_bad_argument_raises_naming_it_and_changes_nothing(info, kwargs, name, in_group):
    """As a constructor argument and (``in_group``) as a key of a group added after steps:
    ValueError or TypeError whose message names the argument; the optimizer keeps its groups,
    its state and its parameters' values."""
    params = make_params()
    with pytest.raises((ValueError, TypeError), match=name):
        info.build(params, **kwargs)
    if not in_group:
        return
    opt = info.build(params)
    run(opt, params, range(1))
    before = snapshot(opt, params)
    groups = [{**g, "params": list(g["params"])} for g in opt.param_groups]
    extra = nn.Parameter(torch.randn(6, 16))
    with pytest.raises((ValueError, TypeError), match=name):
        opt.add_param_group({"params": [extra], **kwargs})
    assert len(opt.param_groups) == len(groups)
    for g, h in zip(opt.param_groups, groups, strict=True):
        assert [id(p) for p in g["params"]] == [id(p) for p in h["params"]]
        assert settings(g) == settings(h)
    assert extra not in opt.state
    assert_same(snapshot(opt, params), before)


# ---- non-finite gradients, zero and missing gradients --------------------------------------


@each_optimizer
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_skip_leaves_param_and_state_untouched(info, bad):
    """``nonfinite="skip"`` (the default): the parameter with the bad gradient and its state
    keep their values (but for the lr schedule's step clock, which ticks), the skip is
    counted, the other parameters train on."""
    params = make_params()
    opt = info.build(params)
    run(opt, params, range(1))
    set_grads(params, 1)
    params[0].grad[3, 5] = bad
    before = snapshot(opt, params)
    opt.step()
    after = snapshot(opt, params)
    counters = ("nonfinite.skips", *info.clock_keys)
    kept = [{k: v for k, v in s[0].items() if k not in counters} for s in (before, after)]
    assert_same(kept[:1], kept[1:])
    assert int(opt.state[params[0]]["nonfinite.skips"]) == 1
    for key in info.clock_keys:
        assert int(after[0][key]) == int(before[0][key]) + 1, key
    assert opt.nonfinite_skips == 1
    for old, new in zip(before[1:], after[1:], strict=True):
        assert not torch.equal(old["param"], new["param"])
    run(opt, params, range(2, 4))  # and it trains on
    assert all(torch.isfinite(p).all() for p in params)


@each_optimizer
def test_nonfinite_raise_changes_nothing(info):
    """``nonfinite="raise"``: FloatingPointError before any parameter (or state) changes,
    the bad gradient being in the last parameter."""
    params = make_params()
    opt = info.build(params, nonfinite="raise")
    run(opt, params, range(1))
    set_grads(params, 1)
    params[-1].grad[0] = float("nan")
    before = snapshot(opt, params)
    with pytest.raises(FloatingPointError):
        opt.step()
    assert_same(snapshot(opt, params), before)


@each_optimizer
def test_nonfinite_ignore_propagates(info):
    """``nonfinite="ignore"``: no check, the NaN reaches the parameter (as torch.optim's)."""
    params = make_params()
    opt = info.build(params, nonfinite="ignore")
    run(opt, params, range(1))
    set_grads(params, 1)
    params[1].grad[0] = float("nan")
    opt.step()
    assert torch.isnan(params[1]).any()
    assert opt.nonfinite_skips == 0


@each_optimizer
def test_zero_gradients_stay_finite(info):
    """All-zero gradients from the first step on, refreshes included: parameters and state
    stay finite; without weight decay the Adam / Adafactor update of a zero gradient is zero."""
    params = make_params()
    opt = info.build(params, weight_decay=0.0)
    for _ in range(4):  # steps 0 and 2 refresh
        before = [p.detach().clone() for p in params]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        for p, old in zip(params, before, strict=True):
            assert torch.isfinite(p).all()
            if info.step_key != "pnm.step":  # Ranger21's norm loss and lookahead move weights
                assert torch.equal(p.detach(), old)
    for state in opt.state.values():
        for value in state.values():
            assert not value.is_floating_point() or torch.isfinite(value).all()


@each_optimizer
def test_step_without_gradients_creates_nothing(info):
    """``zero_grad(set_to_none=False)`` zeroes, ``zero_grad()`` drops gradients; a step with
    no gradient at all moves nothing and creates no state."""
    params = make_params()
    opt = info.build(params)
    set_grads(params, 0)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    before = [p.detach().clone() for p in params]
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
    assert len(opt.state) == 0


# ---- groups, init_state, dtypes ------------------------------------------------------------


@each_optimizer
def test_add_param_group_after_steps(info):
    """A group added after 3 steps gets its state at its first step (counter 1, the others at
    4); a GaLore group added late is projected (left side: an n-wide moment, an m×r basis)."""
    params = make_params()
    opt = info.build(params)
    run(opt, params, range(3))
    W = nn.Parameter(torch.randn(10, 16))
    galore = {"rank": 4, "proj_type": "left"} if info.rank else {}
    opt.add_param_group({"params": [W], **galore})
    assert W not in opt.state
    set_grads(params, 3)
    W.grad = torch.randn_like(W)
    before = W.detach().clone()
    opt.step()
    assert int(opt.state[W][info.step_key]) == 1
    assert all(int(opt.state[p][info.step_key]) == 4 for p in params)
    assert not torch.equal(W.detach(), before)
    if info.rank:
        state = opt.state[W]
        assert int(state["galore.side"]) == 1
        assert state["proj.left"].shape == (10, 4)
        moment = {"adam.step": "adam.exp_avg", "pnm.step": "pnm.exp_avg"}.get(info.step_key)
        assert moment is None or state[moment].shape == (4, 16)


@each_optimizer
def test_init_state_on_meta_matches_first_step(info):
    """``init_state()`` on meta parameters creates what a real first step creates: the same
    keys, shapes and dtypes per parameter, and the same ``state_bytes``."""
    with torch.device("meta"):
        meta = make_params()
    opt = info.build(meta)
    opt.init_state()
    params = make_params()
    real = info.build(params)
    run(real, params, range(1))
    for p, q in zip(meta, params, strict=True):
        assert sorted(opt.state[p]) == sorted(real.state[q])
        for key, value in real.state[q].items():
            got = opt.state[p][key]
            assert (got.shape, got.dtype) == (value.shape, value.dtype), key
            assert got.device.type in ("meta", "cpu"), key
        assert any(v.device.type == "meta" for v in opt.state[p].values())
    assert opt.state_bytes() == real.state_bytes()


@each_optimizer
def test_bf16_parameters(info):
    """bf16 parameters stay bf16, train, and stay finite; the state is finite."""
    params = make_params(torch.bfloat16)
    init = [p.detach().clone() for p in params]
    opt = info.build(params)
    run(opt, params, range(4))
    for p, p0 in zip(params, init, strict=True):
        assert p.dtype == torch.bfloat16 and torch.isfinite(p).all()
        assert not torch.equal(p.detach(), p0)
    for state in opt.state.values():
        for value in state.values():
            assert not value.is_floating_point() or torch.isfinite(value).all()


@each_optimizer
def test_unknown_group_key_raises_naming_it(info):
    params = make_params()
    with pytest.raises((ValueError, TypeError), match="bogus_key"):
        info.cls([{"params": params, "bogus_key": 1}], lr=1e-2, **info.kwargs)
    opt = info.build(params)
    with pytest.raises((ValueError, TypeError), match="bogus_key"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3))], "bogus_key": 1})


# ---- GaLoreAdamW against torch.optim.AdamW -----------------------------------------------

#: The claim is that the algorithm is torch's AdamW, so both run in float64 (a float32
#: comparison would measure the two implementations' rounding — fused vs unfused arithmetic,
#: one CPU's vector kernels — not the algorithm). What is left: GaLoreAdamW's step count and
#: bias corrections are float32 tensors (capturable), so each step's update (|Δw| ≲ lr ≤
#: 3e-2 here) carries a few float32 ulps of relative rounding, over ≤ 10 steps (measured
#: 3.6e-9); a wrong coefficient moves the weights by ≥ 1e-4.
TOL = 10 * 3e-2 * 4 * F32_EPS  # ≈ 1.4e-7


def clone_params(params) -> list[nn.Parameter]:
    return [nn.Parameter(p.detach().clone()) for p in params]


def clone64(params) -> list[nn.Parameter]:
    """float64 copies (the AdamW comparisons, see ``TOL``)."""
    return [nn.Parameter(p.detach().double()) for p in params]


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


# ---- closures -------------------------------------------------------


def test_closure_returns_loss_and_matches_adamw():
    torch.manual_seed(0)
    ours_model = TinyNet().double()
    ref_model = copy.deepcopy(ours_model)
    ours = galore2.GaLoreAdamW(ours_model.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    calls = []

    def closure_for(model, opt):
        def closure():
            calls.append(torch.is_grad_enabled())
            opt.zero_grad()
            x, y = batch(len(calls))
            loss = (model(x.double()) - y.double()).pow(2).mean()
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


# ---- learning rates ---------------------------------------------------------------


def test_lambda_lr_matches_adamw():
    torch.manual_seed(0)
    params = [torch.randn(6, 5), torch.randn(5)]
    ours_p, ref_p = clone64(params), clone64(params)
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
    (oa, ob, oc), (ra, rb, rc) = clone64([a, b, c]), clone64([a, b, c])
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
    assert not torch.equal(oc.detach(), c.double())


# ---- maximize ---------------------------------------------------------------------


def test_maximize_matches_adamw():
    torch.manual_seed(0)
    params = [torch.randn(5, 7), torch.randn(7)]
    ours_p, ref_p = clone64(params), clone64(params)
    ours = galore2.GaLoreAdamW(ours_p, lr=1e-2, maximize=True)
    ref = torch.optim.AdamW(ref_p, lr=1e-2, maximize=True)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        feed(gen, ours_p, ref_p)
        ours.step()
        ref.step()
    assert max_abs(ours_p, ref_p) <= TOL
    assert not torch.allclose(ours_p[0], params[0].double())


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
    # the same kernels on a negated gradient (negation is exact): to the last bit, nearly
    assert torch.allclose(up, down, rtol=0, atol=1e-7)
    assert not torch.allclose(up, W)


# ---- dtypes and state_dict --------------------------------------------------------


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
    assert_f32_close(ours.state[ours_p]["adam.exp_avg"], ref_m, steps=3)  # another kernel


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
