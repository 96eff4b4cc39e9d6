"""GaLore's refresh schedule: ``together`` / ``staggered``, and changed settings.

Issue 30 item 4: a changed ``update_proj_gap`` — on ``load_state_dict``, or by an edit of
``param_groups`` between steps — governs from the next step (the schedule used to stay on
the checkpoint's ``galore.next_refresh``); a changed ``rank`` (any ``resumable=False``
option) is refused, never ignored. Issue 28 item 3: ``refresh_schedule="staggered"`` puts
each matrix at its own phase of the T-step window (refreshes per step counted), and a
resume across it is bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import io
import math
import re
import warnings
from collections import Counter
from itertools import pairwise

import pytest
import torch
from torch import nn

import galore2
from galore2.optim.refresh import next_refresh, phase

N_MATRICES = 12  # each with a bias next to it: the projected indices are 0, 2, 4, …


def _params(seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(N_MATRICES):
        out.append(nn.Parameter(torch.randn(8, 12, generator=gen)))
        out.append(nn.Parameter(torch.randn(8, generator=gen)))
    return out


def _optimizer(params, **settings) -> galore2.GaLoreAdamW:
    group = {"params": params, "rank": 2, "update_proj_gap": 4, "projector": "svd", **settings}
    return galore2.GaLoreAdamW([group], lr=1e-2)


def _grads(params, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _refreshes(opt) -> dict[int, int]:
    return {i: int(s["refreshes"]) for i, s in opt.refresh_stats().items()}


def _train(opt, params, steps: range) -> dict[int, list[int]]:
    """Run ``steps`` (gradients seeded per step); per step, the indices refreshed."""
    out = {}
    before = _refreshes(opt)
    for step in steps:
        _grads(params, step)
        opt.step()
        now = _refreshes(opt)
        out[step] = sorted(i for i in now if now[i] != before.get(i, 0))
        before = now
    return out


def _save(opt) -> dict:
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# --- item 30.4: a changed gap governs from the next step --------------------------------------


def test_load_into_a_smaller_gap_refreshes_on_the_new_schedule():
    """Saved with T = 200 after 3 steps, loaded with T = 5: the next refresh is one new gap
    after the last (step 5), then every 5 — not at step 200 (today's main: 0 refreshes)."""
    params = _params()
    opt = _optimizer(params, update_proj_gap=200)
    _train(opt, params, range(3))
    saved = _save(opt)
    resumed = _optimizer(params, update_proj_gap=5)
    with pytest.warns(UserWarning, match="update_proj_gap 200 → 5"):
        resumed.load_state_dict(saved)
    done = _train(resumed, params, range(3, 15))  # 12 steps after the resume
    every = list(range(0, 2 * N_MATRICES, 2))
    assert {s: ix for s, ix in done.items() if ix} == {5: every, 10: every}
    assert resumed.state_dict()["param_groups"][0]["update_proj_gap"] == 5


def test_load_into_a_larger_gap_waits_one_new_gap_after_the_last_refresh():
    params = _params()
    opt = _optimizer(params, update_proj_gap=5)
    _train(opt, params, range(7))  # refreshed at 0 and 5; next due at 10 under T = 5
    resumed = _optimizer(params, update_proj_gap=20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed.load_state_dict(_save(opt))
    done = _train(resumed, params, range(7, 30))
    assert [s for s, ix in done.items() if ix] == [25]  # 5 + 20


def test_gap_overdue_after_a_resume_refreshes_at_the_next_step():
    params = _params()
    opt = _optimizer(params, update_proj_gap=200)
    _train(opt, params, range(30))  # last refresh at 0
    resumed = _optimizer(params, update_proj_gap=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed.load_state_dict(_save(opt))
    done = _train(resumed, params, range(30, 42))
    assert [s for s, ix in done.items() if ix] == [30, 40]


def test_gap_edited_between_steps_applies_from_the_next_step():
    params = _params()
    opt = _optimizer(params, update_proj_gap=200)
    _train(opt, params, range(3))
    opt.param_groups[0]["update_proj_gap"] = 5
    done = _train(opt, params, range(3, 15))
    assert [s for s, ix in done.items() if ix] == [5, 10]


def test_gap_edited_then_saved_keeps_the_new_schedule():
    """The edit is re-planned before ``state_dict`` saves it, so a resume with the same
    (new) gap continues on the new schedule."""
    params = _params()
    opt = _optimizer(params, update_proj_gap=200)
    _train(opt, params, range(3))
    opt.param_groups[0]["update_proj_gap"] = 5
    saved = _save(opt)
    resumed = _optimizer(params, update_proj_gap=5)
    resumed.load_state_dict(saved)
    assert [s for s, ix in _train(resumed, params, range(3, 12)).items() if ix] == [5, 10]


@pytest.mark.parametrize(
    ("key", "value"),
    [("rank", 3), ("rank", None), ("proj_type", "left"), ("projector", "random"), ("seed", 7)],
)
def test_state_shaping_option_edited_mid_run_is_refused_before_anything_changes(key, value):
    params = _params()
    opt = _optimizer(params)
    _train(opt, params, range(2))
    weights = [p.detach().clone() for p in params]
    state = {k: v.clone() for k, v in opt.state[params[0]].items()}
    old = opt.param_groups[0][key]
    opt.param_groups[0][key] = value
    _grads(params, 2)
    with pytest.raises(ValueError, match=rf"param_groups\[0\]\['{key}'\] changed from "
                       rf"{old!r} to {value!r}.*cannot change mid-run"):  # fmt: skip
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(weights, params, strict=True))
    assert all(torch.equal(v, opt.state[params[0]][k]) for k, v in state.items())
    with pytest.raises(ValueError, match=re.escape(f"['{key}'] changed")):  # per-layer steps too
        opt.step_param(params[0])
    opt.param_groups[0][key] = old  # put back: the run goes on
    opt.step()


def test_rank_edit_before_the_first_step_is_used():
    params = _params()
    opt = _optimizer(params)
    opt.param_groups[0]["rank"] = 3
    _train(opt, params, range(1))
    assert opt.state[params[0]]["proj.left"].shape == (8, 3)


def test_invalid_gap_edit_is_refused_naming_the_option():
    params = _params()
    opt = _optimizer(params)
    _train(opt, params, range(1))
    opt.param_groups[0]["update_proj_gap"] = 0
    with pytest.raises(ValueError, match=r"param_groups\[0\]: update_proj_gap must be an int >= 1"):
        opt.step()


# --- item 28.3: staggered refreshes -----------------------------------------------------------


def test_together_refreshes_every_matrix_at_steps_0_T_2T():
    params = _params()
    opt = _optimizer(params)  # refresh_schedule="together" is the default
    done = _train(opt, params, range(13))
    every = list(range(0, 2 * N_MATRICES, 2))
    assert {s: ix for s, ix in done.items() if ix} == {0: every, 4: every, 8: every, 12: every}


@pytest.mark.parametrize("gap", [3, 4, 5, 16])
def test_staggered_spreads_refreshes_over_the_window(gap):
    params = _params()
    opt = _optimizer(params, refresh_schedule="staggered", update_proj_gap=gap)
    done = _train(opt, params, range(6 * gap))
    every = list(range(0, 2 * N_MATRICES, 2))
    assert done[0] == every  # the first step needs a basis for every matrix
    bound = math.ceil(N_MATRICES / gap) + 1
    assert max(len(ix) for s, ix in done.items() if s > 0) <= bound
    steps_of = {i: [s for s, ix in done.items() if i in ix] for i in every}
    for i, steps in steps_of.items():
        gaps = [b - a for a, b in pairwise(steps)]
        assert (gap + 1) // 2 <= gaps[0] < gap + (gap + 1) // 2, (i, steps)  # onto its phase
        assert set(gaps[1:]) == {gap}, (i, steps)  # then every T steps
        assert all(s % gap == phase(i, gap) for s in steps[1:])
    per_window = Counter(s // gap for s, ix in done.items() if s >= gap for _ in ix)
    assert min(per_window.values()) >= N_MATRICES - bound  # all matrices, once a window


def test_phase_puts_about_n_over_t_matrices_on_a_step():
    """Fibonacci hashing: for every-k-th indices as for consecutive ones, each step of the
    window gets at most ⌈n/T⌉ + 2 (Llama-7B: 224 matrices, 9 parameters a layer)."""
    llama = [1 + 9 * layer + j for layer in range(32) for j in range(7)]
    for indices in (llama, list(range(224)), list(range(0, 100, 2))):
        for gap in (5, 50, 200, 500):
            load = Counter(phase(i, gap) for i in indices)
            assert max(load.values()) <= math.ceil(len(indices) / gap) + 2, (gap, len(indices))
    assert next_refresh(40, 10, "staggered", 3) == 40 + (phase(3, 10) - 45) % 10 + 5
    assert next_refresh(40, 10, "together", 3) == 50


def _run_model(steps, split=None, seed=0, **settings):
    """Train a tiny MLP ``steps`` steps; with ``split``, save at that step and continue in a
    fresh model + optimizer loaded from the checkpoint (weights_only round trip)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 16), nn.Tanh(),
                          nn.Linear(16, 10))  # fmt: skip
    make = lambda m: galore2.GaLoreAdamW(  # noqa: E731
        galore2.param_groups(m, rank=3, update_proj_gap=5, **settings), lr=1e-2
    )
    opt = make(model)
    gen = torch.Generator().manual_seed(5)
    data = [(torch.randn(6, 12, generator=gen), torch.randn(6, 10, generator=gen))
            for _ in range(steps)]  # fmt: skip
    for step, (x, y) in enumerate(data):
        if step == split:
            saved_model = {k: v.clone() for k, v in model.state_dict().items()}
            saved = _save(opt)
            torch.manual_seed(seed + 1)  # another init: everything comes from the checkpoint
            model = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 16), nn.Tanh(),
                                  nn.Linear(16, 10))  # fmt: skip
            model.load_state_dict(saved_model)
            opt = make(model)
            opt.load_state_dict(saved)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("split", [3, 7, 11])
def test_staggered_resume_mid_window_is_bit_identical(split):
    whole, opt_a = _run_model(16, refresh_schedule="staggered", projector="power")
    resumed, opt_b = _run_model(16, split=split, refresh_schedule="staggered", projector="power")
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for pid in sa:
        for key in sa[pid]:
            assert torch.equal(sa[pid][key], sb[pid][key]), (pid, key)
    # the staggered schedule really ran: the matrices are not all on the same steps
    nexts = {int(s["galore.next_refresh"]) for s in opt_a.state.values() if "galore.side" in s
             and "galore.next_refresh" in s}  # fmt: skip
    assert len(nexts) > 1


def test_gap_change_under_staggered_realigns_onto_the_new_phases():
    """T 16 → 4 mid-run at step 20: every matrix refreshes at its phase within the next new
    gap (at least half a gap after its last refresh: by step 24), no step carrying all of
    them, then every 4 steps on its phase."""
    params = _params()
    opt = _optimizer(params, refresh_schedule="staggered", update_proj_gap=16)
    _train(opt, params, range(20))
    opt.param_groups[0]["update_proj_gap"] = 4
    done = _train(opt, params, range(20, 36))
    every = list(range(0, 2 * N_MATRICES, 2))
    first = {i: min(s for s, ix in done.items() if i in ix) for i in every}
    assert max(first.values()) <= 24
    assert max(len(ix) for ix in done.values()) <= math.ceil(N_MATRICES / 4) + 1
    for i in every:
        later = [s for s, ix in done.items() if i in ix]
        assert all(s % 4 == phase(i, 4) for s in later), (i, later)
        assert set(b - a for a, b in pairwise(later)) == {4}


def _due_at(opt, params) -> dict[int, int]:
    """Each projected matrix's next refresh (``galore.next_refresh``), by index."""
    return {i: int(opt.state[params[i]]["galore.next_refresh"]) for i in range(0, len(params), 2)}


@pytest.mark.parametrize("schedule", ["together", "staggered"])
@pytest.mark.parametrize("new_gap", [2, 9])
@pytest.mark.parametrize("pending", [False, True], ids=["due_next", "pending"])
def test_gap_edit_keeps_a_due_or_pending_refresh_due(schedule, new_gap, pending):
    """Issue 39 item 25: ``update_proj_gap`` edited (4 → 2 or 9) while some matrices' refresh
    is due at the very next step — scheduled there, or pending since the last step found
    their gradient all zero (no usable basis: retried) — those refresh at the next step,
    as the old schedule owed (the edit never moves a due refresh, later or earlier), and
    from there every new gap (staggered: onto the phase of the new gap, then every gap)."""
    params = _params()
    opt = _optimizer(params, refresh_schedule=schedule, update_proj_gap=4)
    _train(opt, params, range(1))
    step = 1
    while True:  # the first step at which some matrix is due
        due = {i for i, at in _due_at(opt, params).items() if at <= step}
        if due:
            break
        _train(opt, params, range(step, step + 1))
        step += 1
    if pending:  # that step finds their gradients all zero: the refresh fails, stays due
        _grads(params, step)
        for i in due:
            params[i].grad.zero_()
        before = _refreshes(opt)
        opt.step()
        assert all(_refreshes(opt)[i] == before[i] for i in due)
        step += 1
        assert all(_due_at(opt, params)[i] < step for i in due)  # pending
    opt.param_groups[0]["update_proj_gap"] = new_gap
    horizon = step + 3 * new_gap + 2
    done = _train(opt, params, range(step, horizon))
    for i in sorted(due):
        expected, at = [], step
        while at < horizon:
            expected.append(at)
            at = next_refresh(at, new_gap, schedule, i)
        assert [s for s, ix in done.items() if i in ix] == expected, (i, step)


def test_cap_edit_while_a_refresh_is_pending_bounds_the_adaptive_gap():
    """Item 25, adaptive: the gap doubled to 16 (refreshes at 0, 4, 12, then due at 28);
    the refresh at 28 finds zero gradients (pending) and ``max_update_proj_gap`` is cut to
    4 before the next step: the pending refresh runs at 29 and the gap is within the new
    cap from it (29, 33, 37, 41 — it stayed 16 when a pending parameter's gap was not
    brought into the new range: next at 45)."""
    params = _params()
    opt = _optimizer(params, adaptive_refresh=True, refresh_threshold=1e-6, refresh_patience=1)
    done = _train(opt, params, range(28))
    every = list(range(0, 2 * N_MATRICES, 2))
    assert {s: ix for s, ix in done.items() if ix} == {0: every, 4: every, 12: every}
    _grads(params, 28)
    for i in every:
        params[i].grad.zero_()
    opt.step()
    assert all(s["gap"] == 16 and s["refreshes"] == 3 for s in opt.refresh_stats().values())
    opt.param_groups[0].update(max_update_proj_gap=4, refresh_patience=2)
    done = _train(opt, params, range(29, 42))
    assert {s: ix for s, ix in done.items() if ix} == {29: every, 33: every, 37: every, 41: every}
    assert all(s["gap"] == 4 for s in opt.refresh_stats().values())


def test_switching_to_staggered_mid_run_spreads_the_next_refreshes():
    params = _params()
    opt = _optimizer(params, update_proj_gap=8)
    _train(opt, params, range(3))
    opt.param_groups[0]["refresh_schedule"] = "staggered"
    done = _train(opt, params, range(3, 19))
    assert max(len(ix) for ix in done.values()) <= math.ceil(N_MATRICES / 8) + 1
    assert sum(len(ix) for ix in done.values()) >= N_MATRICES  # every matrix refreshed again


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match=r"refresh_schedule must be one of \('together', "
                       r"'staggered'\), got 'spread'"):  # fmt: skip
        _optimizer(_params(), refresh_schedule="spread")
