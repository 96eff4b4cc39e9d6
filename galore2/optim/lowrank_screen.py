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
no parameter of the list was skipped), they take the kept projections instead of
projecting again — the same ops on the same inputs, so the same bits. Otherwise (a
parameter was skipped: the lists lack it, their plan is another) what was kept is not
used, and the projections are made again as they were before the fold. The engine drops
what is left at the end of the step (:meth:`Screen.clear`).

Memory: the batched path held every R of a group at once already (projected before the
inner chain runs); the per-tensor path (the CPU default) now holds its group's R — r/m of
its gradients — from the check until each matrix's update, where it held one at a time.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import Tensor

from ..core.transform import Context, State
from . import lowrank_batch
from .lowrank_plan import Split, Stacked
from .projection import Projection
from .refresh import due

_NONE = 0  # galore.side of a matrix GaLore does not project


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


def screen_of(owner: Any) -> Screen:
    """``owner``'s :class:`Screen` (made on first use: an unpickled GaLore has none)."""
    screen = owner.__dict__.get("_screen")
    if screen is None:
        screen = owner.__dict__["_screen"] = Screen()
    return screen
