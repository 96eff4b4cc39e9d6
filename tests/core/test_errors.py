"""Invalid arguments, sparse gradients, and robustness to non-finite / zero gradients."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch import nn

import galore2
from galore2.optim import GaLore, ScaleByAdam
from galore2.projectors import Plan

from ..helpers import assert_f32_close

PROJECTORS = ["svd", "randomized", "power", "random"]
PROJ_TYPES = ("std", "reverse_std", "left", "right", "full")

# (keyword arguments, argument named in the message, fragments naming what is allowed)
INVALID = [
    ({"lr": -1e-3}, "lr", [">= 0"]),
    ({"lr": float("nan")}, "lr", [">= 0"]),
    ({"betas": (0.9, 1.0)}, "betas", ["[0, 1)"]),
    ({"betas": (-0.1, 0.999)}, "betas", ["[0, 1)"]),
    ({"betas": (0.9,)}, "betas", ["pair", "[0, 1)"]),
    ({"betas": (0.9, 0.99, 0.999)}, "betas", ["pair", "[0, 1)"]),
    ({"eps": 0.0}, "eps", ["> 0"]),
    ({"eps": -1e-8}, "eps", ["> 0"]),
    ({"weight_decay": -0.1}, "weight_decay", [">= 0"]),
    ({"maximize": "yes"}, "maximize", ["bool"]),
    ({"rank": 0}, "rank", ["int", ">= 1"]),
    ({"rank": -3}, "rank", ["int", ">= 1"]),
    ({"rank": 2.5}, "rank", ["int", ">= 1"]),
    ({"rank": "4"}, "rank", ["int", ">= 1"]),
    ({"rank": True}, "rank", ["int", ">= 1"]),
    ({"rank": 2, "update_proj_gap": 0}, "update_proj_gap", ["int", ">= 1"]),
    ({"rank": 2, "update_proj_gap": 1.5}, "update_proj_gap", ["int", ">= 1"]),
    ({"rank": 2, "scale": 0.0}, "scale", ["> 0"]),
    ({"rank": 2, "scale": -0.25}, "scale", ["> 0"]),
    ({"rank": 2, "proj_type": "diag"}, "proj_type", list(PROJ_TYPES)),
    ({"rank": 2, "projector": "qr"}, "projector", PROJECTORS),
    ({"rank": 2, "moments_on_refresh": "zero"}, "moments_on_refresh", ["keep", "reset", "project"]),
    ({"nonfinite": "warn"}, "nonfinite", ["skip", "raise", "ignore"]),
    ({"state_dtype": "int8"}, "state_dtype", ["float32", "bfloat16"]),
    ({"state_dtype": torch.int32}, "state_dtype", ["float32", "bfloat16"]),
    ({"rank": 2, "projector": "power", "power_iters": 0}, "power_iters", [">= 1", "power"]),
    ({"rank": 2, "oversample": -1}, "oversample", [">= 0"]),
    ({"rank": 2, "seed": -1}, "seed", ["2**62"]),
]
IDS = [
    f"{name}={next(iter(kw.values())) if len(kw) == 1 else kw[name]!r}" for kw, name, _ in INVALID
]


def check_message(err: pytest.ExceptionInfo, name: str, allowed: list[str]) -> None:
    msg = str(err.value)
    assert re.search(rf"\b{re.escape(name)}\b", msg), f"{name!r} not named in: {msg}"
    for fragment in allowed:
        assert fragment in msg, f"{fragment!r} (allowed values) not in: {msg}"


@pytest.mark.parametrize(("kwargs", "name", "allowed"), INVALID, ids=IDS)
def test_invalid_at_construction(kwargs, name, allowed):
    p = nn.Parameter(torch.randn(6, 4))
    with pytest.raises(ValueError) as err:
        galore2.GaLoreAdamW([p], **kwargs)
    check_message(err, name, allowed)
    # the same value given as a per-group key
    with pytest.raises(ValueError) as err:
        galore2.GaLoreAdamW([{"params": [p], **kwargs}])
    check_message(err, name, allowed)


@pytest.mark.parametrize(("kwargs", "name", "allowed"), INVALID, ids=IDS)
def test_invalid_in_add_param_group_changes_nothing(kwargs, name, allowed):
    p0, p1 = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(5, 3))
    opt = galore2.GaLoreAdamW([p0], rank=2)
    p0.grad = torch.randn_like(p0)
    opt.step()
    before = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    before_params = [list(g["params"]) for g in opt.param_groups]
    with pytest.raises(ValueError) as err:
        opt.add_param_group({"params": [p1], **kwargs})
    check_message(err, name, allowed)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == before
    assert [list(g["params"]) for g in opt.param_groups] == before_params
    assert p1 not in opt.state
    # p1 was not half-registered: adding it properly now works (torch rejects duplicates)
    opt.add_param_group({"params": [p1]})
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize(
    ("kwargs", "normalized"),
    [
        (
            {"lr": 0.0, "betas": (0.0, 0.0), "weight_decay": 0.0, "rank": 1, "update_proj_gap": 1},
            {},
        ),
        ({"rank": 2, "projector": "randomized", "power_iters": 0}, {}),
        ({"state_dtype": "bf16"}, {"state_dtype": "bfloat16"}),
        ({"state_dtype": torch.float32}, {"state_dtype": "float32"}),
        ({"betas": [0.8, 0.9]}, {"betas": (0.8, 0.9)}),
    ],
)
def test_boundary_values_accepted(kwargs, normalized):
    p = nn.Parameter(torch.randn(6, 4))
    opt = galore2.GaLoreAdamW([p], **kwargs)
    for key, value in normalized.items():
        assert opt.param_groups[0][key] == value
    p.grad = torch.randn_like(p)
    opt.step()
    assert torch.isfinite(p).all()


@pytest.mark.parametrize("bad", ["rnak", "amsgrad", "differentiable"])
def test_unknown_kwargs_raise_type_error(bad):
    p = nn.Parameter(torch.randn(6, 4))
    with pytest.raises(TypeError) as err:
        galore2.GaLoreAdamW([p], **{bad: 1})
    assert bad in str(err.value)
    assert "rank" in str(err.value) and "update_proj_gap" in str(err.value)  # lists valid options


@pytest.mark.parametrize("how", ["constructor", "add_param_group"])
def test_misspelled_group_key_raises_naming_the_closest_option(how):
    """Issue 16 item 4: a hand-written group with 'rnak' used to run as full-rank AdamW."""
    p = nn.Parameter(torch.randn(6, 4))
    with pytest.raises(ValueError, match=r"\['rnak'\].*did you mean 'rank'") as err:
        if how == "constructor":
            galore2.GaLoreAdamW([{"params": [p], "rnak": 8}])
        else:
            opt = galore2.GaLoreAdamW([nn.Parameter(torch.randn(3))])
            opt.add_param_group({"params": [p], "rnak": 8})
            assert len(opt.param_groups) == 1  # nothing was added
    assert "rnak" in str(err.value)


def test_misspelled_keyword_names_the_closest_option():
    p = nn.Parameter(torch.randn(6, 4))
    with pytest.raises(TypeError, match=r"did you mean 'update_proj_gap'"):
        galore2.GaLoreAdamW([p], update_proj_gp=10)


def test_torch_group_keys_are_accepted():
    """torch.optim's own keys: named parameters (``param_names``) and LR schedulers' ``initial_lr``."""
    model = nn.Linear(4, 6)
    names, params = zip(*model.named_parameters(), strict=True)
    opt = galore2.GaLoreAdamW(
        [{"params": list(params), "param_names": list(names), "initial_lr": 0.1, "rank": 2}]
    )
    assert opt.param_groups[0]["param_names"] == ["weight", "bias"]
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert opt.state_dict()["param_groups"][0]["param_names"] == ["weight", "bias"]


# ---- sparse gradients -------------------------------------------------------------


@pytest.mark.parametrize("rank", [None, 2])
def test_sparse_gradient_raises_and_changes_nothing(rank):
    torch.manual_seed(0)
    lin = nn.Linear(4, 6)
    emb = nn.Embedding(10, 4, sparse=True)
    # the dense group comes first: it must not be updated before the sparse one is refused
    opt = galore2.GaLoreAdamW(
        [{"params": lin.parameters(), "rank": 2}, {"params": emb.parameters(), "rank": rank}]
    )
    before = [p.detach().clone() for p in (*lin.parameters(), emb.weight)]
    lin(emb(torch.tensor([1, 2, 3]))).sum().backward()
    assert emb.weight.grad.is_sparse
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    after = [p.detach() for p in (*lin.parameters(), emb.weight)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert len(opt.state) == 0


# ---- non-finite gradients ---------------------------------------------------------


def snapshot(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in opt.state[p].items()} if p in opt.state else {}


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def three_params():
    torch.manual_seed(0)
    W = nn.Parameter(torch.randn(8, 12))  # GaLore
    V = nn.Parameter(torch.randn(5, 7))  # plain matrix
    b = nn.Parameter(torch.randn(7))  # plain vector
    return W, V, b


BAD = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("target", ["galore", "plain"])
def test_nonfinite_skip_leaves_param_and_state_untouched(bad, target):
    W, V, b = three_params()
    opt = galore2.GaLoreAdamW(
        [{"params": [W], "rank": 3, "update_proj_gap": 10}, {"params": [V, b]}],
        lr=1e-2,
        weight_decay=0.1,
    )
    ref_params = [nn.Parameter(x.detach().clone()) for x in (W, V, b)]
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1)
    bad_p = W if target == "galore" else V
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        grads = [torch.randn(x.shape, generator=gen) for x in (W, V, b)]
        if step == 2:
            grads[0 if target == "galore" else 1][0, 1] = BAD[bad]
            kept, kept_state = bad_p.detach().clone(), snapshot(opt, bad_p)
        for x, g in zip((W, V, b), grads, strict=True):
            x.grad = g
        opt.step()
        for i, (x, g) in enumerate(zip(ref_params, grads, strict=True)):
            ok = torch.isfinite(g).all()
            x.grad = g if ok else None  # the reference just skips that parameter
            assert ok or (i == 0) == (target == "galore")
        ref.step()
        if step == 2:
            assert torch.equal(bad_p.detach(), kept)
            now = snapshot(opt, bad_p)
            assert now.pop("nonfinite.skips") == kept_state.pop("nonfinite.skips") + 1
            assert same_state(now, kept_state)
            assert opt.nonfinite_skips == 1
        # plain parameters follow torch.optim.AdamW, which never saw the bad gradient
        # (a skipped V is exactly a V without a gradient that step)
        for x, r in zip((V, b), ref_params[1:], strict=True):
            assert_f32_close(x.detach(), r.detach(), steps=4)  # 4 steps
    assert opt.nonfinite_skips == 1
    if target == "galore":
        assert int(opt.state[W]["galore.step"]) == 3  # the skipped step did not count
        assert int(opt.state[W]["adam.step"]) == 3
    else:
        assert int(opt.state[V]["adam.step"]) == 3
    assert all(torch.isfinite(x).all() for x in (W, V, b))


@pytest.mark.parametrize("first_step", [True, False])
def test_nonfinite_raise_changes_nothing(first_step):
    W, V, b = three_params()
    # the offending parameter is in the *last* group; the earlier one must not move either
    opt = galore2.GaLoreAdamW(
        [{"params": [W], "rank": 3, "nonfinite": "skip"}, {"params": [V, b], "nonfinite": "raise"}],
        lr=1e-2,
    )
    if not first_step:
        for x in (W, V, b):
            x.grad = torch.randn_like(x)
        opt.step()
    params = [x.detach().clone() for x in (W, V, b)]
    states = [snapshot(opt, x) for x in (W, V, b)]
    for x in (W, V, b):
        x.grad = torch.randn_like(x)
    b.grad[3] = float("nan")
    with pytest.raises(FloatingPointError):
        opt.step()
    assert all(torch.equal(x.detach(), y) for x, y in zip((W, V, b), params, strict=True))
    assert all(same_state(snapshot(opt, x), s) for x, s in zip((W, V, b), states, strict=True))
    if first_step:
        assert len(opt.state) == 0
    assert opt.nonfinite_skips == 0


def orthonormal(B: torch.Tensor) -> bool:
    return float(torch.linalg.norm(B.mT @ B - torch.eye(B.shape[1]))) <= 1e-4


def basis(opt, p) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in opt.state[p].items() if k.startswith("proj.")}


def galore_opt(p, projector, gap=2, **kw):
    return galore2.GaLoreAdamW(
        [p], lr=1e-2, rank=3, update_proj_gap=gap, projector=projector, proj_type="full", **kw
    )


@pytest.mark.parametrize("projector", PROJECTORS)
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_nonfinite_grad_at_refresh_keeps_basis(projector, bad):
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(8, 12))
    opt = galore_opt(p, projector)
    for _ in range(2):
        p.grad = torch.randn_like(p)
        opt.step()
    assert int(opt.state[p]["galore.next_refresh"]) == 2  # the next step refreshes
    kept, kept_state = basis(opt, p), snapshot(opt, p)
    p.grad = torch.randn_like(p)
    p.grad[2, 3] = BAD[bad]
    opt.step()
    assert all(torch.equal(v, kept[k]) for k, v in basis(opt, p).items())
    assert int(opt.state[p]["galore.refreshes"]) == 1
    # a skipped step leaves the whole state (schedule included) as it was
    now = snapshot(opt, p)
    assert now.pop("nonfinite.skips") == kept_state.pop("nonfinite.skips") + 1
    assert same_state(now, kept_state)
    # the refresh happens at the next usable step
    p.grad = torch.randn_like(p)
    opt.step()
    assert int(opt.state[p]["galore.refreshes"]) == 2
    assert any(not torch.equal(v, kept[k]) for k, v in basis(opt, p).items())
    assert torch.isfinite(p).all()


@pytest.mark.parametrize("projector", PROJECTORS)
def test_zero_grad_at_refresh_keeps_basis(projector):
    """A refresh from an all-zero gradient keeps the previous basis and is retried next step
    (galore/galore.py docstring) — for every projector."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(8, 12))
    opt = galore_opt(p, projector)
    for _ in range(2):
        p.grad = torch.randn_like(p)
        opt.step()
    kept = basis(opt, p)
    p.grad = torch.zeros_like(p)
    opt.step()  # refresh step: must not raise
    assert all(torch.equal(v, kept[k]) for k, v in basis(opt, p).items())
    assert int(opt.state[p]["galore.refreshes"]) == 1
    p.grad = torch.randn_like(p)
    opt.step()
    assert int(opt.state[p]["galore.refreshes"]) == 2
    assert torch.isfinite(p).all()


@pytest.mark.parametrize("projector", PROJECTORS)
def test_refresh_rejects_unusable_gradients(projector):
    """Called directly (bypassing the optimizer's non-finite skip), a refresh from a NaN,
    Inf or all-zero gradient returns False and keeps the basis — never a linalg error."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(8, 12))
    opt = galore_opt(p, projector)
    p.grad = torch.randn_like(p)
    opt.step()
    state, group = opt.state[p], opt.param_groups[0]
    plan = Plan(int(state["galore.side"]), 8, 12, 3, p.device)
    galore = GaLore(ScaleByAdam())
    for name, G in {
        "nan": torch.full((8, 12), float("nan")),
        "inf": torch.randn(8, 12).index_fill_(0, torch.tensor([1]), float("inf")),
        "zero": torch.zeros(8, 12),
    }.items():
        kept = basis(opt, p)
        assert galore.refresh(G, state, group, plan, step=5) is False, name
        assert all(torch.equal(v, kept[k]) for k, v in basis(opt, p).items()), name
        assert int(state["galore.next_refresh"]) <= 6, name  # due again at the next step
        assert int(state["galore.refreshes"]) == 1, name


@pytest.mark.parametrize("projector", PROJECTORS)
def test_first_step_with_nan_grad(projector):
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(8, 12))
    start = p.detach().clone()
    opt = galore_opt(p, projector)
    p.grad = torch.full_like(p, float("nan"))
    opt.step()  # state is created, the update skipped
    assert torch.equal(p.detach(), start)
    assert opt.nonfinite_skips == 1
    assert int(opt.state[p]["galore.refreshes"]) == 0
    p.grad = torch.randn_like(p)
    opt.step()
    assert int(opt.state[p]["galore.refreshes"]) == 1
    assert torch.isfinite(p).all() and not torch.equal(p.detach(), start)
    if projector != "random":
        assert orthonormal(opt.state[p]["proj.left"]) and orthonormal(opt.state[p]["proj.right"])


@pytest.mark.parametrize("projector", PROJECTORS)
@pytest.mark.parametrize("when", ["first", "later"])
def test_huge_finite_gradient_at_refresh(projector, when):
    """A finite gradient of magnitude 1e17 (a diverging fp32 run; its sum of squares still
    fits float32 — larger ones are skipped, tests/core/test_nonfinite_overflow.py) is usable:
    the refresh must not raise a linalg error and the basis must stay finite and orthonormal."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(8, 12))
    opt = galore_opt(p, projector, gap=1)
    if when == "later":
        p.grad = torch.randn_like(p)
        opt.step()
    p.grad = torch.randn_like(p) * 1e17
    opt.step()
    assert torch.isfinite(p).all()
    assert int(opt.state[p]["galore.refreshes"]) == (2 if when == "later" else 1)
    if projector != "random":
        assert orthonormal(opt.state[p]["proj.left"]) and orthonormal(opt.state[p]["proj.right"])


# ---- parameters without gradients -------------------------------------------------


def test_params_without_grad_are_skipped():
    torch.manual_seed(0)
    W1, W2 = nn.Parameter(torch.randn(8, 12)), nn.Parameter(torch.randn(8, 12))
    b = nn.Parameter(torch.randn(5))
    opt = galore2.GaLoreAdamW([{"params": [W1, W2], "rank": 3}, {"params": [b]}], weight_decay=0.5)
    untouched = [W2.detach().clone(), b.detach().clone()]
    W1.grad = torch.randn_like(W1)
    opt.step()
    assert W1 in opt.state and W2 not in opt.state and b not in opt.state
    assert torch.equal(W2.detach(), untouched[0])  # not even weight decay
    assert torch.equal(b.detach(), untouched[1])
    assert set(opt.state_dict()["state"]) == {0}


def test_warning_for_rank_above_min_dim_once():
    p = nn.Parameter(torch.randn(4, 6))
    q = nn.Parameter(torch.randn(4, 6))
    opt = galore2.GaLoreAdamW([p, q], rank=4)
    p.grad, q.grad = torch.randn_like(p), torch.randn_like(q)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        opt.step()
        opt.step()
    msgs = [str(w.message) for w in rec if "rank=4" in str(w.message)]
    assert len(msgs) == 1 and "(4, 6)" in msgs[0]
    assert "proj.left" not in opt.state[p] and opt.state[p]["adam.exp_avg"].shape == (4, 6)
    assert copy.deepcopy(opt.state_dict())["state"][0]["galore.side"] == 0


@pytest.mark.parametrize("rank", [None, 3])
def test_nonfinite_ignore_propagates_like_torch_adamw(rank):
    """nonfinite="ignore" does not check: NaN reaches the parameter, nothing is counted."""
    p = nn.Parameter(torch.randn(8, 12))
    opt = galore2.GaLoreAdamW([{"params": [p], "rank": rank}], nonfinite="ignore")
    p.grad = torch.randn_like(p)
    opt.step()
    p.grad = torch.full_like(p, float("nan"))
    opt.step()
    assert torch.isnan(p).any()
    assert opt.nonfinite_skips == 0
