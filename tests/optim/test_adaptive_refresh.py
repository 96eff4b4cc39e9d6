"""Adaptive refresh: the gap grows while a parameter's subspace stays put, shrinks when it moves."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

import galore2
from galore2.projectors import LEFT, RIGHT, Plan, get_projector

from ..dist import spawn
from ..fsdp import fsdp_cases


def _optimizer(p: nn.Parameter, **settings) -> galore2.GaLoreAdamW:
    group = {"params": [p], "rank": 4, "update_proj_gap": 2, "adaptive_refresh": True,
             "refresh_patience": 2, "max_update_proj_gap": 8, **settings}  # fmt: skip
    return galore2.GaLoreAdamW([group], lr=1e-3)


def _refresh_steps(opt: torch.optim.Optimizer, p: nn.Parameter, grads) -> list[int]:
    steps, seen = [], 0
    for step, g in enumerate(grads):
        p.grad = g
        opt.step()
        done = int(opt.state[p]["galore.refreshes"])
        if done != seen:
            steps.append(step)
            seen = done
    return steps


def _steady(m: int = 32, n: int = 48, steps: int = 40):
    """Gradients of one fixed rank-4 structure plus small noise: the subspace never moves."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(m, 4, generator=gen) @ torch.randn(4, n, generator=gen)
    return [base + 1e-3 * torch.randn(m, n, generator=gen) for _ in range(steps)]


def test_gap_doubles_after_patience_similar_refreshes_up_to_the_cap():
    p = nn.Parameter(torch.zeros(32, 48))
    opt = _optimizer(p, projector="svd")
    # T=2, patience 2, cap 8: 0 (first), 2 (streak 1), 4 (streak 2: gap 4), 8, 12 (gap 8), 20, 28, 36
    assert _refresh_steps(opt, p, _steady()) == [0, 2, 4, 8, 12, 20, 28, 36]
    stats = opt.refresh_stats()
    assert stats[0]["gap"] == 8 and stats[0]["refreshes"] == 8
    assert stats[0]["similarity"] > 0.99


def test_fixed_schedule_when_off_and_for_independent_gradients():
    gen = torch.Generator().manual_seed(1)
    noise = [torch.randn(32, 48, generator=gen) for _ in range(20)]
    p = nn.Parameter(torch.zeros(32, 48))
    opt = _optimizer(p, projector="svd")
    assert _refresh_steps(opt, p, noise) == list(range(0, 20, 2))  # overlap ≈ r/m, far below 0.4
    assert opt.refresh_stats()[0]["similarity"] < 0.4
    q = nn.Parameter(torch.zeros(32, 48))
    fixed = _optimizer(q, projector="svd", adaptive_refresh=False)
    assert _refresh_steps(fixed, q, _steady(steps=20)) == list(range(0, 20, 2))
    assert "galore.gap" not in fixed.state[q]
    assert fixed.refresh_stats()[0]["gap"] == 2 and math.isnan(
        fixed.refresh_stats()[0]["similarity"]
    )


def test_gap_halves_when_the_subspace_moves():
    gen = torch.Generator().manual_seed(2)
    steady = _steady(steps=13)  # refreshes 0, 2, 4, 8, 12: gap 8 after step 12
    moved = [torch.randn(32, 48, generator=gen) for _ in range(12)]
    p = nn.Parameter(torch.zeros(32, 48))
    opt = _optimizer(p, projector="svd")
    # step 20 finds a new subspace → gap 4; step 24 → gap 2 (never below T)
    assert _refresh_steps(opt, p, steady + moved) == [0, 2, 4, 8, 12, 20, 24]
    assert int(opt.state[p]["galore.gap"]) == 2


@pytest.mark.parametrize("side", [LEFT, RIGHT])
def test_similarity_is_subspace_overlap(side):
    proj = get_projector("svd")
    m, n, r = 12, 20, 3
    plan = Plan(side, m, n, r, torch.device("cpu"))
    key = "left" if side == LEFT else "right"
    dim = m if side == LEFT else n
    basis, _ = torch.linalg.qr(torch.randn(dim, dim, dtype=torch.float64))
    state = {f"proj.{key}": basis[:, :r].float().contiguous()}
    rot, _ = torch.linalg.qr(torch.randn(r, r, dtype=torch.float64))
    same = {key: (basis[:, :r] @ rot).float() * torch.tensor([-1.0, 1.0, -1.0])}
    assert proj.similarity(same, state, plan) == pytest.approx(1.0, abs=1e-5)
    other = {key: basis[:, r : 2 * r].float()}
    assert proj.similarity(other, state, plan) == pytest.approx(0.0, abs=1e-6)
    half = {key: torch.cat([basis[:, :1], basis[:, r : r + 2]], dim=1).float()}
    assert proj.similarity(half, state, plan) == pytest.approx(1 / 3, abs=1e-5)


def test_adaptive_state_round_trips_and_resumes_identically():
    grads = _steady(steps=30)
    p = nn.Parameter(torch.ones(32, 48))
    opt = _optimizer(p, projector="randomized")
    for g in grads[:14]:
        p.grad = g
        opt.step()
    buf = io.BytesIO()
    torch.save({"p": p.detach().clone(), "opt": opt.state_dict()}, buf)
    for g in grads[14:]:
        p.grad = g
        opt.step()
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    q = nn.Parameter(saved["p"])
    resumed = _optimizer(q, projector="randomized")
    resumed.load_state_dict(saved["opt"])
    for g in grads[14:]:
        q.grad = g
        resumed.step()
    assert torch.equal(p, q)
    assert resumed.refresh_stats() == opt.refresh_stats()


@pytest.mark.parametrize(
    ("key", "value"),
    [("refresh_threshold", 0.0), ("refresh_threshold", 1.5), ("refresh_patience", 0),
     ("max_update_proj_gap", 1), ("adaptive_refresh", "yes")],
)  # fmt: skip
def test_bad_adaptive_settings_name_the_key(key, value):
    p = nn.Parameter(torch.zeros(8, 8))
    with pytest.raises(ValueError, match=key):
        _optimizer(p, **{key: value})


def test_adaptive_refresh_under_fsdp_matches_one_process():
    spawn(fsdp_cases.adaptive_matches_single_process, 2)


def test_random_projection_never_lengthens_its_gap():
    p = nn.Parameter(torch.zeros(32, 48))
    opt = _optimizer(p, projector="random")
    assert _refresh_steps(opt, p, _steady(steps=20)) == list(range(0, 20, 2))  # fresh draws
    assert opt.refresh_stats()[0]["similarity"] < 0.4
