"""GaLore's projections made before the non-finite check, so the check reads R, not G.

On the default path (``nonfinite="skip"``, not ``capturable``; see
:mod:`galore2.core.nonfinite`) the step engine asks the chain's first rule, before its
one host read, for what that rule computes from each gradient anyway
(:meth:`~galore2.core.transform.Transform.screened`). GaLore answers for every matrix it
projects that is local (not sharded) and not due for a refresh: it projects it there and
then — one by one, or per shape batch (:func:`.lowrank_plan.project_live`: the very
projections its update makes) — keeps the results in a :class:`Screen`, and the engine
tests R = PᵀG (or G·Q), r/m of G's size, instead of reading G a second time.

When :meth:`GaLore.update <galore2.optim.galore.GaLore.update>` /
:meth:`~galore2.optim.galore.GaLore.update_many` then come with the same directions (the
same gradient tensors, the same state dicts, the same batch plan and split: a step where
no parameter of the list was skipped), they take the kept projections
(:func:`project_many` on the batched path) instead of
projecting again — the same ops on the same inputs, so the same bits. Otherwise (a
parameter was skipped: the lists lack it, their plan is another) what was kept is not
used, and the projections are made again as they were before the fold. The engine drops
what is left at the end of the step (:meth:`Screen.clear`).

Fira and APOLLO read G itself in their update, and are tested on R too: R = PᵀG (or G·Q)
of a whole matrix is non-finite wherever G is (a NaN or ±Inf entry of G makes its column of
R — its row, for Q — NaN or ±Inf, 0·Inf included), so testing R skips every matrix that
testing G would (and, conservatively, one whose R overflowed).

Memory: the batched path held every R of a group at once already (projected before the
inner chain runs); the per-tensor path (the CPU default) now holds its group's R — r/m of
its gradients — from the check until each matrix's update, where it held one at a time.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import Tensor

from ..core.transform import Context, Group, StackedState, State
from . import lowrank_batch, lowrank_plan
from .lowrank_plan import Split, Stacked
from .projection import Projection
from .refresh import due

_NONE = 0  # galore.side of a matrix GaLore does not project
#: the inner chain's inputs, the single projections by index, the stacked keys, the stacks
Projected = tuple[list[Tensor], dict[int, Projection], tuple[str, ...] | None, list[Stacked]]


class Kept(NamedTuple):
    """The projections made for one list of directions (batched: per plan)."""

    plan: lowrank_batch.BatchPlan
    split: Split
    us: list[Tensor]  # the directions they were made from (compared by identity)
    projections: dict[int, Projection]  # the singles projected (not due for a refresh)
    inner_in: list[Tensor]  # the inner chain's inputs so far (R where projected)
    stacks: list[Stacked]  # the live shape batches, projected
    keys: tuple[str, ...] | None  # the inner chain's stacked keys then


class Screen:
    """What :meth:`GaLore.screened` kept this step: per-tensor projections by state dict
    (``id``; the gradient they were made from, its projection and R), batched ones by plan."""

    __slots__ = ("many", "one")

    def __init__(self) -> None:
        self.one: dict[int, tuple[Tensor, Projection, Tensor]] = {}
        self.many: dict[int, Kept] = {}

    def clear(self) -> None:
        self.one.clear()
        self.many.clear()

    def take_one(self, u: Tensor, state: State) -> tuple[Projection, Tensor] | None:
        """The projection and R kept for ``state`` if made from ``u`` itself; None otherwise."""
        kept = self.one.pop(id(state), None)
        if kept is None or kept[0] is not u:
            return None
        return kept[1], kept[2]

    def take_many(
        self, plan: lowrank_batch.BatchPlan, split: Split, us: list[Tensor]
    ) -> Kept | None:
        """What was kept for ``plan`` if made from these very directions with this split."""
        kept = self.many.pop(id(plan), None)
        if kept is None or kept.plan is not plan or kept.split != split:
            return None
        if len(kept.us) != len(us) or any(a is not b for a, b in zip(kept.us, us, strict=True)):
            return None
        return kept


def foldable(state: State, ctx: Context) -> bool:
    """Is this matrix's non-finite test made on its projection this step: projected, local
    (a sharded one's flag is the whole matrix's, agreed by a collective of its own), not due
    for a refresh (a refresh reads G in full: its test stays on G)?"""
    return (
        int(state["galore.side"]) != _NONE
        and not ctx.placement.distributed
        and not ctx.refreshed
        and not due(state)
    )


def screen(
    galore: Any, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context]
) -> list[Tensor | None]:
    """:meth:`GaLore.screened <galore2.optim.galore.GaLore.screened>` for a group GaLore
    projects: each foldable matrix (:func:`foldable`) projected now — alone by
    ``galore._project``, or with its live shape batch as ``update_many`` would — and kept
    in ``galore``'s :class:`Screen`; its R returned, None for the others."""
    out: list[Tensor | None] = [None] * len(us)
    kept = screen_of(galore)
    if len(us) == 1 and type(states[0]) is not StackedState:  # update()'s path
        if foldable(states[0], ctxs[0]):
            projection, R = galore._project(us[0], states[0], group, ctxs[0])
            kept.one[id(states[0])] = (us[0], projection, R)
            out[0] = R
        return out
    plans = galore.__dict__.setdefault("_plans", {})
    plan = lowrank_plan.cached(plans, us, states, group, ctxs)
    split = lowrank_plan.split(plan, galore._counters)
    inner_in, projections = list(us), {}
    for i in split.singles:
        if foldable(states[i], ctxs[i]):
            projections[i], inner_in[i] = galore._project(us[i], states[i], group, ctxs[i])
            out[i] = inner_in[i]
    keys, stacks = lowrank_plan.project_batches(galore.inner, plan, split, us, group, ctxs,
                                                inner_in)  # fmt: skip
    for st in stacks:
        for i, r in zip(st.idx, st.R.unbind(0), strict=True):
            out[i] = r
    kept.many[id(plan)] = Kept(plan, split, list(us), projections, inner_in, stacks, keys)
    return out


def project_many(
    galore: Any, plan: lowrank_batch.BatchPlan, split: Split, us: list[Tensor],
    states: list[State], group: Group, ctxs: list[Context],
) -> Projected:  # fmt: skip
    """``GaLore.update_many``'s projections: the matrices projected one by one (due for a
    refresh, or never batched: by ``galore._project``), then the live shape batches — or
    what :func:`screen` kept for these very lists. Returns the inner chain's inputs (R where
    projected), the single projections by index, the stacked keys and the stacks."""
    kept = screen_of(galore).take_many(plan, split, us)
    inner_in = list(us if kept is None else kept.inner_in)
    projections: dict[int, Projection] = {} if kept is None else dict(kept.projections)
    for i in split.singles:
        if i not in projections:
            projections[i], inner_in[i] = galore._project(us[i], states[i], group, ctxs[i])
    if kept is not None:
        return inner_in, projections, kept.keys, kept.stacks
    keys, stacks = lowrank_plan.project_batches(galore.inner, plan, split, us, group, ctxs,
                                                inner_in)  # fmt: skip
    return inner_in, projections, keys, stacks


def screen_of(owner: Any) -> Screen:
    """``owner``'s :class:`Screen` (made on first use: an unpickled GaLore has none)."""
    screen = owner.__dict__.get("_screen")
    if screen is None:
        screen = owner.__dict__["_screen"] = Screen()
    return screen
