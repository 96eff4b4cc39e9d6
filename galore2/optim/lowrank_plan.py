"""GaLore's batched step, planned: which matrices are due, live or skipped, and their stacks.

:meth:`GaLore.update_many <galore2.optim.galore.GaLore.update_many>` projects, runs the
inner chain and projects back; this module says over what. Its :class:`BatchPlan
<.lowrank_batch.BatchPlan>` of the lists (cached per GaLore: :func:`cached`) groups the
matrices into shape batches; at each step :func:`split` reads which of them are due for a
refresh (they leave their batch for that step and take the per-tensor path, which refreshes
them), :func:`project_live` projects the rest batch by batch into :class:`Stacked` entries,
:func:`run_inner` runs the inner chain with each stacked batch as one entry (its context's
mask the members' flags: :func:`~galore2.core.masked.member_flags`), and :func:`back_stacks`
(or :func:`.lowrank_combine.combine_many`, Fira / APOLLO) turns the stacks' results
into updates.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..core import masked, packing
from ..core.counters import Counters
from ..core.transform import (
    Context,
    Group,
    LowRankUpdate,
    StackedState,
    State,
    Transform,
    dense,
    run_chain,
    walk,
)
from ..projectors import NONE, TUCKER, Plan, Projector, get_projector
from . import lowrank_batch, residual
from . import refresh as schedule
from .projection import Projection, plan_for

#: at most this many cached batch plans per GaLore (one per group and device of a step)
_MAX_PLANS = 64


class Stacked(NamedTuple):
    """A shape batch's tensors of this step (the matrices ``idx`` projected together)."""

    batch: lowrank_batch.ShapeBatch
    idx: list[int]
    G: Tensor | None  # the stacked gradients (None: not stacked, see along)
    # the stacked bases, as stored; or the stored bases themselves, a list (the grouped
    # kernels read them where they are: lowrank_batch.ShapeBatch._stored_each)
    B: Tensor | list[Tensor]
    Y: Tensor | list[Tensor]  # B in the projection's operand dtype (B itself when in it)
    R: Tensor  # the stacked projected gradients
    state: StackedState | None  # the inner chain's state of them as one stacked entry
    along: bool  # along the data: G not stacked (see along)
    # Fira's channel norms of the residuals and of R, taken by the projection's launch
    # (.lowrank_batch.ShapeBatch.project); None otherwise
    norms: tuple[Tensor, Tensor] | None = None


class Split(NamedTuple):
    """This step's split of a plan's projected matrices."""

    singles: list[int]  # positions that take the per-tensor path (never batched, or due)
    live: list[tuple[lowrank_batch.ShapeBatch, list[int] | None]]  # batches, their live members
    skip: list[int]  # positions in ``plan.batched`` that step on their own this time
    due: list[list[int]] | None  # per batch, its members due for a refresh (None: none is)


def cached(
    plans: dict[Any, lowrank_batch.BatchPlan], us: list[Tensor], states: list[State],
    group: Group, ctxs: list[Context],
) -> lowrank_batch.BatchPlan:  # fmt: skip
    """The :class:`~.lowrank_batch.BatchPlan` of these lists: last step's (in ``plans``, a
    GaLore's cache) if it still holds (the same state dicts and contexts, the same
    group-level batchability, rank and ``proj_precision``), else a new one."""
    key = _key(states)
    plan = plans.get(key)
    can = lowrank_batch.group_batchable(group)
    if plan is None or not plan.fits(group, can) or not plan.holds(states, ctxs):
        plans.pop(key, None)
        if len(plans) >= _MAX_PLANS:  # the oldest goes (lists of a past step)
            plans.pop(next(iter(plans)))
        plan = plans[key] = lowrank_batch.BatchPlan(us, states, ctxs, group, can)
    return plan


def kept(
    plans: dict[Any, lowrank_batch.BatchPlan], states: list[State], ctxs: list[Context]
) -> lowrank_batch.BatchPlan | None:
    """Last step's plan of these lists in ``plans`` if it still holds, else None."""
    plan = plans.get(_key(states))
    return plan if plan is not None and plan.holds(states, ctxs) else None


def _key(states: list[State]) -> tuple[int, int]:
    return (len(states), id(states[0]) if states else 0)


def none_due(
    plans: dict[Any, lowrank_batch.BatchPlan], states: list[State], ctxs: list[Context],
    counters: Counters,
) -> bool:
    """Is none of these lists' matrices due for a refresh at this step, their host counters
    read as ``GaLore.update_many`` reads them (the lists' batch plan must be last step's:
    unknown, a new plan, is False)?"""
    plan = kept(plans, states, ctxs)
    if plan is None or any(schedule.due(states[i]) for i in plan.singles):
        return False
    return not (plan.batches and plan.due(counters) is not None)


def deferrable(
    plans: dict[Any, lowrank_batch.BatchPlan], inner: list[Transform], us: list[Tensor],
    states: list[State], group: Group, ctxs: list[Context], counters: Counters,
) -> bool:  # fmt: skip
    """May this step of a group's lists defer its non-finite flags
    (:mod:`galore2.core.deferred`): every matrix in a shape batch of last step's plan (no
    single, no plain tensor), none due for a refresh, each batch along the data on the
    grouped kernels (bf16 weights and gradients, factored updates — low-rank, APOLLO's
    scaled gradients, Fira's sums of both —, whose grouped launches take the flags, as
    the norm-growth limiter does), and the one inner rule writing the batch's directions
    by a kernel that takes them (its ``defers_directions``, told whether the batch's
    inner state stacks: float32 moments must, 8-bit ones never do)?"""
    plan = kept(plans, states, ctxs)
    if (
        plan is None
        or group["rank"] is None
        or not plan.batches
        or plan.singles
        or len(plan.batched) != len(states)
        or len(inner) != 1
        or not along(group, ctxs)
        or plan.due(counters) is not None
    ):
        return False
    ask = getattr(inner[0], "defers_directions", None)
    keys = stack_keys(inner, group, us[0].device)
    if ask is None or keys is None:
        return False
    for batch in plan.batches:
        first = batch.idx[0]
        if (
            us[first].dtype != torch.bfloat16
            or ctxs[first].param.dtype != torch.bfloat16
            or not lowrank_batch.along_data(us[first])
            or not ask(batch.states, group, us[first].device, stacks(batch, keys))
        ):
            return False
    return True


def stacks(batch: lowrank_batch.ShapeBatch, keys: tuple[str, ...]) -> bool:
    """Does ``batch``'s inner state (its ``keys``) stack into one entry?"""
    return batch.stacked_state(keys) is not None


def split(plan: lowrank_batch.BatchPlan, counters: Counters) -> Split:
    """Which of ``plan``'s matrices step alone this time: its singles, and the members of a
    batch due for a refresh (with the whole batch when fewer than two would stay)."""
    singles, live = plan.singles, [(b, None) for b in plan.batches]
    due = plan.due(counters) if plan.batches else None
    skip: list[int] = []
    if due is not None:  # some matrices refresh: their own path this step
        singles, live, start = list(singles), [], 0
        for batch, at in zip(plan.batches, due, strict=True):
            k = len(batch.idx)
            rest = [j for j in range(k) if j not in at]
            if len(rest) < 2:
                at = list(range(k))
            else:
                live.append((batch, rest if at else None))
            singles += [batch.idx[j] for j in at]
            skip += [start + j for j in at]
            start += k
        singles.sort()
    return Split(singles, live, skip, due)  # type: ignore[arg-type]


def along(group: Group, ctxs: list[Context]) -> bool:
    """Are the shape batches' gradients projected where they are, each read once by its own
    matmul into its entry of R (:meth:`.lowrank_batch.ShapeBatch.project` with
    ``stack=False``, where :func:`.lowrank_batch.along_data` says the batch may), rather than
    stacked? Then GaLore's updates go out as factors (:func:`.lowrank_batch.factors`: the
    optimizer writes each into its weight by one ``addmm_``), APOLLO's as its scaled
    gradients and Fira's as both (:func:`.residual.combine_buckets`: the gradients as they
    are, no m×n tensor made). Not on a masked step (``capturable=True``: a batch's update is
    masked on its r-row stack and applied densely, :func:`.lowrank_batch.back`)."""
    return not (ctxs and ctxs[0].mask is not None)


def stack_keys(
    inner: list[Transform], group: Group, device: torch.device
) -> tuple[str, ...] | None:
    """The inner chain's state keys a shape batch may stack (every transform's
    ``linear_keys`` and ``quadratic_keys``, wrapped ones' too: those its states hold
    are stacked), or None when one of them does not take
    stacked entries (:meth:`~galore2.core.transform.Transform.stacks`)."""
    if not all(t.stacks(group, device) for t in inner):
        return None
    return tuple(k for t in walk(inner) for k in (*t.linear_keys, *t.quadratic_keys))


def project_batches(
    inner: list[Transform], plan: lowrank_batch.BatchPlan, split: Split, us: list[Tensor],
    group: Group, ctxs: list[Context], inner_in: list[Tensor],
) -> tuple[tuple[str, ...] | None, list[Stacked]]:  # fmt: skip
    """The inner chain's stacked keys and the live shape batches projected
    (:func:`project_live`, which puts unstacked members' R in ``inner_in``)."""
    keys = stack_keys(inner, group, us[0].device) if plan.batches else None
    return keys, project_live(split.live, us, group, ctxs, keys, inner_in)


def project_live(
    live: list[tuple[lowrank_batch.ShapeBatch, list[int] | None]], us: list[Tensor],
    group: Group, ctxs: list[Context], keys: tuple[str, ...] | None, inner_in: list[Tensor],
) -> list[Stacked]:  # fmt: skip
    """Project each live batch (one ``bmm`` at its plan's precision): its
    :class:`Stacked` entry. A batch whose inner state does not stack (``keys`` None, or
    members left out) puts its members' R into ``inner_in``, to go through the chain one
    by one. Along the data (:func:`along`; matrices large enough:
    :func:`.lowrank_batch.along_data`) no stack of the gradients is made: each is read
    once, by its own matmul."""
    projector = get_projector(group["projector"])
    may = along(group, ctxs)
    c = residual.projected_norms(group)
    stacks: list[Stacked] = []
    for batch, rest in live:
        flat = may and lowrank_batch.along_data(us[batch.idx[0]])
        G, B, Y, R, norms = batch.project(us, projector, rest, not flat, c if flat else None)
        idx = batch.idx if rest is None else [batch.idx[j] for j in rest]
        stacked = batch.stacked_state(keys) if keys is not None and rest is None else None
        if stacked is None:  # its matrices go through the chain one by one
            for i, r in zip(idx, R.unbind(0), strict=True):
                inner_in[i] = r
        stacks.append(Stacked(batch, idx, G, B, Y, R, stacked, flat, norms))
    return stacks


def inner_contexts(
    ctxs: list[Context], projections: dict[int, Projection], stacks: list[Stacked],
    rounds: bool = False,
) -> list[Context]:  # fmt: skip
    """The contexts the inner rules see: each projected direction's layout, as at init
    (plain: the parameter's). ``rounds`` (one inner rule, GaLore's own back-projection):
    a matrix projected on its own whose update rounds N to its weight's dtype
    (:func:`rounds_alone`) says so (:meth:`~galore2.core.module.Context.rounded_to`), as a
    shape batch along the data does: its rule may write N in that dtype."""
    out = list(ctxs)
    for i, p in projections.items():
        out[i] = ctxs[i].inner_view(p.layout)
        if rounds and rounds_alone(p, ctxs[i]):
            out[i] = out[i].rounded_to(ctxs[i].param.dtype)
    for st in stacks:
        if st.state is None:  # its matrices go through the chain one by one
            for i in st.idx:
                out[i] = ctxs[i].inner_view(st.batch.kind.layout)
    return out


def rounds_alone(projection: Projection, ctx: Context) -> bool:
    """Does the update of a matrix projected on its own round its N to the weight's dtype
    before anything else reads it? A local one-sided or two-sided projection (not Tucker,
    not sharded: a sharded one gathers N first, in the inner rule's dtype) of a 16-bit
    weight whose projector's factors are the base ones (:meth:`Projector.back_factors`:
    N cast to the weight's dtype)."""
    return (
        ctx.param.dtype in (torch.bfloat16, torch.float16)
        and projection.side != TUCKER
        and not projection.plan.placement.distributed
        and type(projection.projector).back_factors is Projector.back_factors
    )


def stacked_ctxs(stacked: list[Stacked], ctxs: list[Context]) -> list[Context]:
    """The context of each stacked entry: its first member's (as the inner chain sees it:
    :meth:`~galore2.core.module.Context.inner_view`), with (a masked step) the
    members' flags as its ``mask`` (:func:`~galore2.core.masked.member_flags`: the rules
    derive their weights from it once)."""
    firsts = [ctxs[st.idx[0]].inner_view(st.batch.kind.layout) for st in stacked]
    mask = firsts[0].mask
    if mask is None and firsts[0].keep is not None:  # a deferred step: the members' flags
        return [first.with_keep(first.keep, tuple(ctxs[i].keep_at[0] for i in st.idx))
                for first, st in zip(firsts, stacked, strict=True)]  # fmt: skip
    if mask is None:
        return firsts
    members = [ctxs[i].mask for st in stacked for i in st.idx]
    sizes, dims = [len(st.idx) for st in stacked], [st.R.dim() for st in stacked]
    views = masked.member_flags(mask, members, sizes, dims)  # type: ignore[arg-type]
    out = []
    for first, view in zip(firsts, views, strict=True):
        out.append(first.with_mask(view))
    return out


def run_inner(
    inner: list[Transform], inner_in: list[Tensor], states: list[State], group: Group,
    ctxs: list[Context], stacks: list[Stacked],
) -> tuple[list[Any], list[Tensor | None], list[int], list[Tensor | None]]:  # fmt: skip
    """The inner chain over the directions, each shape batch with a stacked state as one
    stacked entry (its ``R``; the last entries of the chain's lists). Returns the
    per-tensor results (None for a stacked batch's matrices), each batch's stacked result
    (or None), the order in which the chain saw the states (with stacks expanded), and
    each batch's stacked mask (a masked step's ``(k, 1, 1)`` flags of a stacked entry;
    else None)."""
    stacked = [st for st in stacks if st.state is not None]
    none: list[Tensor | None] = [None] * len(stacks)
    if len(inner) == 1:  # along the data, an unstacked batch's N is rounded as a stack's is
        ctxs = _rounded_members(stacks, ctxs)
    if not stacked:
        return run_chain(inner, inner_in, states, group, ctxs), none, (
            list(range(len(states)))
        ), none  # fmt: skip
    skip = set()
    for st in stacked:
        skip.update(st.idx)
    order = [i for i in range(len(states)) if i not in skip]
    entries = stacked_ctxs(stacked, ctxs)
    # along the data, a batch's N is rounded to the weights' dtype (GaLore's factors are
    # cast so; APOLLO reads only N's channel norms, as it reads R's in the gradients' dtype)
    if len(inner) == 1:
        entries = [
            e.rounded_to(ctxs[st.idx[0]].param.dtype) if st.along else e
            for e, st in zip(entries, stacked, strict=True)
        ]  # fmt: skip
    res = run_chain(
        inner,
        [inner_in[i] for i in order] + [st.R for st in stacked],
        [states[i] for i in order] + [st.state for st in stacked],  # type: ignore[misc]
        group,
        [ctxs[i] for i in order] + entries,
    )
    results: list[Any] = [None] * len(states)
    for i, r in zip(order, res, strict=False):
        results[i] = r
    tail = iter(res[len(order) :])
    stacked_out = [dense(next(tail)) if st.state is not None else None for st in stacks]
    entry_masks = iter([c.mask for c in entries])
    masks = [next(entry_masks) if st.state is not None else None for st in stacks]
    for st in stacked:
        order += st.idx
    return results, stacked_out, order, masks


def _rounded_members(stacks: list[Stacked], ctxs: list[Context]) -> list[Context]:
    """``ctxs`` with the members of each batch along the data whose state is not stacked
    (8-bit moments: one entry per matrix) rounded to the weights' dtype
    (:meth:`~galore2.core.module.Context.rounded_to`), as a stacked entry's are."""
    unstacked = [st for st in stacks if st.state is None and st.along]
    if not unstacked:
        return ctxs
    out = list(ctxs)
    for st in unstacked:
        dtype = ctxs[st.idx[0]].param.dtype
        for i in st.idx:
            out[i] = ctxs[i].rounded_to(dtype)
    return out


def back_stacks(
    stacks: list[Stacked], stacked_out: list[Tensor | None], masks: list[Tensor | None],
    results: list[Any], us: list[Tensor], ctxs: list[Context], scale: float,
) -> dict[int, Tensor | LowRankUpdate]:  # fmt: skip
    """The shape batches' updates ``scale``·back(N), {index: update}: factors (each weight
    takes its update in one ``addmm_``) or, on a masked step, dense updates masked on the
    r-row stacks."""
    done: dict[int, Tensor | LowRankUpdate] = {}
    for st, N, mask in zip(stacks, stacked_out, masks, strict=True):
        Ns = N if N is not None else [dense(results[i]) for i in st.idx]
        dtype = ctxs[st.idx[0]].param.dtype
        if st.along:  # factors: each weight takes its update in one addmm_
            shapes = [us[i].shape for i in st.idx]
            ups = lowrank_batch.factors(st.batch.kind, back_bases(st, dtype), Ns, dtype, scale,
                                        shapes)  # fmt: skip
            for i, up in zip(st.idx, ups, strict=True):  # a deferred step's flags
                up.keep, up.keep_at = ctxs[i].keep, ctxs[i].keep_at
            done.update(zip(st.idx, ups, strict=True))
            continue
        # a masked step: dense updates, masked on the r-row stacks. G is projected
        # already: its buffer takes the update (when it is a temporary stack, not a
        # view of the gradients)
        G = st.G
        spent = G if G is not None and G.dtype == dtype and packing.writable(G) else None
        deltas = lowrank_batch.back(st.batch.kind, st.B, Ns, dtype, scale, spent, mask)
        done.update(zip(st.idx, masked.entries(deltas), strict=True))
    return done


def back_bases(st: Stacked, dtype: torch.dtype) -> Tensor | list[Tensor]:
    """The bases a batch's back-projection in ``dtype`` reads: the projection's cast of them
    when in ``dtype`` (no second cast); the stored bases themselves where the grouped
    kernels read them (:func:`.lowrank_batch.factor_lists` checks dtypes); else cast."""
    if isinstance(st.Y, list) or st.Y.dtype == dtype:
        return st.Y
    return st.batch.cast_bases(st.B, dtype)  # type: ignore[arg-type]


def finish(
    plan: lowrank_batch.BatchPlan, split: Split, keys: tuple[str, ...] | None,
    counters: Counters, stepped: bool,
) -> None:  # fmt: skip
    """After a batched step: the shape batches' inner state stacked again where matrices
    refreshed (so that the next step's state is as it will stay), and, where batches
    ``stepped``, the batched matrices' GaLore steps counted (the ones that stepped alone
    counted their own: ``split.skip``)."""
    if keys is not None and split.due is not None:
        for batch in plan.batches:
            batch.stacked_state(keys)
    if stepped:
        lowrank_batch.advance_counters(counters, plan.batched, "galore.step", split.skip)


def sharded_svds(
    us: list[Tensor], states: list[State], group: Group, ctxs: list[Context]
) -> Iterator[tuple[State, Plan, dict[str, Tensor] | None, int]]:
    """Exact refreshes of the sharded matrices due one (``projector="svd"``), batched: every
    due matrix's scaled rows gathered to its owner rank, each rank's SVDs run (concurrently
    with the other ranks'), then each result broadcast: yields (state, plan, the checked new
    bases or None, parameter index) per matrix, to be installed before the next is
    broadcast. Marks each such context ``refreshed`` (this step's refresh is decided here,
    done or not). Tucker weights refresh per tensor (one gather for all modes)."""
    if group["projector"] != "svd" or not any(c.placement.distributed for c in ctxs):
        return
    projector = get_projector("svd")
    due = []
    for u, state, ctx in zip(us, states, ctxs, strict=True):
        side = int(state["galore.side"])
        if side in (NONE, TUCKER) or not ctx.placement.distributed:
            continue
        if not schedule.due(state):
            continue
        plan = plan_for(state, group, ctx)
        scaled = projector.refresh_input(u.reshape(-1, plan.n), plan)
        ctx.refreshed = True
        if scaled is not None:
            owner = projector.owner(state, plan)
            full = plan.placement.gather_rows(scaled, owner)
            due.append((state, plan, owner, full, u, ctx.index))
    computed = [projector.compute(full, plan) for _, plan, _, full, _, _ in due]
    for (state, plan, owner, _, u, index), bases in zip(due, computed, strict=True):
        new = projector.distribute(bases, owner, plan, u.device)
        yield state, plan, projector.checked(new, plan), index
