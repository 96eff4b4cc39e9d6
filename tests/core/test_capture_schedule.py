"""``CapturedStep`` runs eagerly exactly the steps that refresh, whatever edits the refresh
schedule gets between steps (issue 39 item 6), and checks ``warmup`` (item 12).

``CapturedStep._refresh_due()`` read ``galore.next_refresh`` as the last step left it; an
edit of ``update_proj_gap`` is re-planned only when the next step starts, so it said "no
refresh" for a step that refreshes (a warm CapturedStep would then record a refresh into
its graph). It now asks the optimizer's ``due_for_refresh``, which re-plans first as the
step does. Checked on the CPU (the predicate needs no CUDA): before every step, the
parameters it reports are exactly those whose ``galore.refreshes`` the step increments.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import galore2

from ..helpers import TinyNet, batch

ZERO = "zero projected gradients"  # not an option: that step finds them all zero
#: step → edits of the projected group before it (every watched option of the schedule)
EDITS = {
    "gap_down": {9: {"update_proj_gap": 3}},
    "gap_up": {7: {"update_proj_gap": 11}},
    "down_then_up": {8: {"update_proj_gap": 2}, 13: {"update_proj_gap": 9}},
    "down_on_a_refresh": {6: {"update_proj_gap": 4}},
    "schedule_flip": {10: {"refresh_schedule": "other"}},
    "adaptive_on": {8: {"adaptive_refresh": True, "update_proj_gap": 3}},
    "cap_edit": {5: {"adaptive_refresh": True}, 12: {"max_update_proj_gap": 7}},
    # item 25: edits when a refresh is due at the very next step (together: 5), or pending
    # (the projected gradients all zero at 5 and 6: no usable basis, retried)
    "up_when_due": {5: {"update_proj_gap": 11}},
    "up_when_pending": {5: {ZERO: True}, 6: {ZERO: True}, 7: {"update_proj_gap": 11}},
}


class Twins(nn.Module):
    """Three matrices of one shape (stacked by the batched path) and one of another."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(24, 24) for _ in range(3))
        self.d = nn.Linear(24, 12)

    def forward(self, x):
        return self.d(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


def _refreshes(opt) -> dict[int, int]:
    return {
        id(p): int(s["galore.refreshes"]) for p, s in opt.state.items() if "galore.refreshes" in s
    }


@pytest.mark.parametrize("schedule", ["together", "staggered"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("edits", list(EDITS))
def test_refresh_due_is_exactly_the_steps_that_refresh(schedule, adaptive, edits):
    torch.manual_seed(0)
    model = Twins()
    mats = [model.a.weight, model.b.weight, model.c.weight, model.d.weight]
    rest = [p for p in model.parameters() if all(p is not m for m in mats)]
    groups = [{"params": mats}, {"params": rest}]
    settings = dict(rank=4, update_proj_gap=5, refresh_schedule=schedule,
                    adaptive_refresh=adaptive, refresh_threshold=1e-6, refresh_patience=1)  # fmt: skip
    groups[0].update(settings)
    opt = galore2.GaLoreAdamW(groups, lr=1e-3, capturable=True)
    captured = galore2.CapturedStep(opt, warmup=1)
    projected = {id(p) for p in groups[0]["params"]}
    refreshed_steps = 0
    pending: set[int] = set()
    for step in range(24):
        edit = dict(EDITS[edits].get(step, {}))
        zero = edit.pop(ZERO, False)
        for key, value in edit.items():
            if value == "other":
                value = "staggered" if schedule == "together" else "together"
            opt.param_groups[0][key] = value
        x, y = batch(step, d_out=12)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        if zero:  # a due refresh finds no usable gradient: it stays due (pending)
            for p in mats:
                p.grad.zero_()
        said = captured._refresh_due()  # first: it must see the edit by itself
        due = {id(p) for p in opt.due_for_refresh()} & projected
        before = _refreshes(opt)
        opt.step()
        after = _refreshes(opt)
        refreshed = {i for i in after if after[i] > before.get(i, 0)}
        if zero:  # due ones try (eagerly) and keep their basis
            assert not refreshed and said == bool(due), step
            pending |= due
            continue
        assert said == bool(refreshed), step
        assert due == refreshed, (step, sorted(due), sorted(refreshed))
        assert pending <= refreshed, step  # a pending refresh is the next step's, edit or not
        pending = set()
        refreshed_steps += bool(refreshed)
    assert 2 <= refreshed_steps < 24  # the schedule ran, and left steps to replay


@pytest.mark.parametrize("warmup", ["3", 2.5, True, None, 0, -1])
def test_warmup_must_be_an_int_of_at_least_one(warmup):
    opt = galore2.GaLoreAdamW(galore2.param_groups(TinyNet(), rank=4), capturable=True)
    with pytest.raises(ValueError, match=rf"warmup must be an int >= 1, got {warmup!r}"):
        galore2.CapturedStep(opt, warmup=warmup)
