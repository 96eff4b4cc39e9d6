"""GaLore as a wrapper transform: project, run the inner chain in the subspace, project back.

Who owns what: the geometry of a projected parameter — its low-rank shape and layout,
project and back with their collectives, the moment rotation — is its projection's
(:mod:`.projection`: left, right, full, Tucker); how a basis is found and stored is the
projector's (:mod:`galore2.projectors`); when a basis is refreshed is the schedule's
(:mod:`.refresh`: every ``update_proj_gap`` steps, together or staggered, adaptive gaps);
which matrices of a batched step are projected together is :mod:`.lowrank_plan`'s. GaLore
keeps the subspace rule: a refresh and what happens to the moments then, project → inner
chain → back, and the folding of weight decay into the low-rank update.

Acts on: the full gradient of a ≥2-D parameter in a group whose ``rank`` is
set. For every other parameter — 1-D, ``rank`` unset, or ``rank ≥ min(m, n)`` —
it is transparent and the inner chain runs on the full gradient (plain AdamW for
``GaLoreAdamW``).

Weights with more than two dims get a Tucker projection by default
(``tensor_projection="tucker"``, side ``TUCKER``: a factor per mode from the mode's
unfolding, the inner chain on the core; :mod:`galore2.projectors.tucker`), or are treated as
the matrix ``shape[0] × rest`` (``"matrix"``). ``rank ≥`` every dim leaves them unprojected.

State per projected parameter: the basis (r·m or r·n fp32, see the projector; a
Tucker weight: its factors), the inner chain's state at the low-rank (core) shape,
``galore.side``, the parameter's seed and the schedule's host counters (:mod:`.refresh`).

A refresh (when :mod:`.refresh` says it is due) whose gradient is non-finite or all zero
keeps the previous basis and is retried at the next step. On a successful refresh the
inner moments are kept (``keep``, galore-torch's behaviour), zeroed with their step count
(``reset``), or rotated into the new basis (``project``: M ← C·M with C = P_newᵀ·P_old,
and second moments with C∘C so they stay non-negative — the variance of a sum of
independent coordinates).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor

from .._numerics import mix_seed
from ..core.counters import Counters
from ..core.options import Choice, Int, Option, Optional, Real
from ..core.state import counter
from ..core.transform import (
    Context,
    Group,
    LowRankUpdate,
    State,
    Transform,
    dense,
    init_chain,
    run_chain,
)
from ..projectors import CHECKS as PROJECTOR_CHECKS
from ..projectors import (
    FULL,
    LEFT,
    NONE,
    RIGHT,
    TUCKER,
    Plan,
    choose_side,
)
from ..projectors import KINDS as PROJECTOR_KINDS
from ..projectors import OPTIONS as PROJECTOR_OPTIONS
from ..storage.basis import CHECKS as BASIS_CHECKS
from ..storage.basis import OPTIONS as BASIS_OPTIONS
from . import lowrank_combine, lowrank_plan, lowrank_screen, residual
from . import refresh as schedule
from .projection import Projection, plan_for, projection_for
from .seeds import SEED

RANK = Option(
    "rank",
    None,
    Optional(Int(low=1), "no projection: the inner rule at full rank"),
    "rank r of the subspace; None leaves the group's parameters unprojected",
    resumable=False,
)
SCALE = Option(
    "scale", 0.25, Real(low=0.0, low_open=True), "α, the multiplier of the back-projected update"
)
PROJ_TYPE = Option(
    "proj_type",
    "std",
    Choice(("std", "reverse_std", "left", "right", "full")),
    "which side is projected (galore-torch's names; std: the smaller dimension)",
    resumable=False,
)
MOMENTS_ON_REFRESH = Option(
    "moments_on_refresh",
    "keep",
    Choice(("keep", "reset", "project")),
    "moments at a refresh: kept (galore-torch), zeroed, or rotated into the new basis",
)
TENSOR_PROJECTION = Option(
    "tensor_projection",
    "tucker",
    Choice(("tucker", "matrix")),
    "weights with more than two dims: per-mode Tucker factors, or shape[0] x rest as a matrix",
    resumable=False,
)
OPTIONS = (
    RANK,
    schedule.UPDATE_PROJ_GAP,
    schedule.REFRESH_SCHEDULE,
    SCALE,
    PROJ_TYPE,
    *PROJECTOR_OPTIONS,
    MOMENTS_ON_REFRESH,
    SEED,
    *BASIS_OPTIONS,
    schedule.ADAPTIVE_REFRESH,
    schedule.REFRESH_THRESHOLD,
    schedule.REFRESH_PATIENCE,
    schedule.MAX_UPDATE_PROJ_GAP,
    TENSOR_PROJECTION,
    *residual.OPTIONS,
)
#: the state only a refresh writes (see GaLore.step_masked_keys)
_REFRESH_ONLY = frozenset((*PROJECTOR_KINDS, "galore.similarity"))


class GaLore(Transform):
    """Wrapper transform: project the gradient, run ``inner`` in the subspace, project back.

    In a group whose ``rank`` is set, a ≥2-D parameter's gradient G is projected onto a
    rank-``rank`` basis (left PᵀG, right GQ, full PᵀGQ; a Tucker core for weights with more
    than two dims) refreshed every ``update_proj_gap`` steps by the group's ``projector``;
    the inner chain runs at that low-rank shape, and its result comes back to the full space
    scaled by ``scale``, as a :class:`~galore2.core.transform.LowRankUpdate` the optimizer
    applies in one fused ``addmm_``. For every other parameter (1-D, ``rank`` unset,
    ``rank ≥ min(m, n)``) GaLore is transparent: the inner chain runs on the full gradient.
    ``moments_on_refresh`` keeps, zeroes or rotates the inner moments at a refresh.

    Args:
        *inner: the transforms run in the subspace, in order (e.g. ``ScaleByAdam()``); at
            least one (``ValueError``).
    """

    name = "galore"
    options = OPTIONS
    #: the checks across keys of its options' owners: projector, basis storage, residual, schedule
    checks = (*PROJECTOR_CHECKS, *BASIS_CHECKS, *residual.CHECKS, *schedule.CHECKS)
    takes_decay = True  # folds the step's decoupled decay into projected updates (_back)
    #: advanced by a masked or deferred step for a skipped parameter too, set back when the
    #: skips are read (:mod:`galore2.core.nonfinite`, :mod:`galore2.core.deferred`)
    host_step_counters = ("galore.step",)
    kinds: ClassVar[dict[str, str]] = {
        "galore.side": "other",
        "galore.seed": "other",
        **schedule.KINDS,
        residual.LIMIT_KEY: "other",
        **PROJECTOR_KINDS,
    }
    #: state it creates on demand (``adaptive_refresh``): a checkpoint may lack it
    optional_keys: ClassVar[frozenset[str]] = schedule.OPTIONAL_KEYS
    #: the options whose change :meth:`options_changed` must see (the schedule's)
    watched: ClassVar[frozenset[str]] = schedule.WATCHED

    def __init__(self, *inner: Transform) -> None:
        if not inner:
            raise ValueError("GaLore needs at least one inner transform (e.g. ScaleByAdam())")
        self.inner: list[Transform] = list(inner)
        self._counters = Counters()  # the batched matrices' host counters, packed

    def capture_problem(self, group: Group) -> str | None:
        """Why a non-refresh step cannot replay from a CUDA graph (None: it can, see
        :mod:`galore2.core.capture`): the random projector regenerates its basis from a
        host seed at every step."""
        if group["rank"] is not None and group["projector"] == "random":
            return "GaLore's random projector regenerates its basis from a host seed each step"
        return None

    def adamw_rule(self, group: Group) -> Transform | None:
        """Without a rank GaLore passes every direction to its inner rule unchanged: that
        rule's answer (a single inner rule)."""
        if group["rank"] is not None or len(self.inner) != 1:
            return None
        return self.inner[0].adamw_rule(group)

    def complex_problem(self, group: Group) -> str | None:
        """Transparent without a rank; a projection (rank set) is not defined for complex
        parameters (the inner transforms answer for themselves, see ``walk``)."""
        if group["rank"] is None:
            return None
        return f"GaLore projection (rank={group['rank']}) is not defined for complex parameters"

    def plan(self, state: State, group: Group, ctx: Context) -> Plan:
        """The :class:`~galore2.projectors.Plan` of a parameter (:func:`.projection.plan_for`;
        side chosen by :meth:`init`)."""
        return plan_for(state, group, ctx)

    # ---- transform protocol ------------------------------------------------------
    def init(
        self, shape: torch.Size, ref: Tensor, group: Group, state: State, ctx: Context
    ) -> None:
        """Choose the parameter's projection side from its global shape, then create the basis, the
        refresh counters and the seed, and the inner chain's state at the low-rank shape (or at
        the full shape when the parameter is not projected; a warning when ``rank`` is too large
        to reduce it).
        """
        rank = group.get("rank")
        tensors = group.get("tensor_projection", "tucker")  # absent from older checkpoints
        side = choose_side(tuple(shape), group["proj_type"], rank, tensors)
        state["galore.side"] = counter(side)
        if side == NONE:
            if rank is not None and len(shape) >= 2:
                tucker = len(shape) > 2 and tensors == "tucker"
                which = "every" if tucker else "min"
                ctx.warn_once(
                    f"galore2: rank={rank} >= {which} dimension of a parameter of shape "
                    f"{tuple(shape)}; it is updated without projection (full-rank inner update)"
                )
            init_chain(self.inner, shape, ref, group, state, ctx)
            return
        plan = self.plan(state, group, ctx)
        schedule.init_state(state, group)
        state["galore.seed"] = counter(mix_seed(group["seed"], ctx.index))
        schedule.init_adaptive(state, group)
        projection = projection_for(group, plan, shape)
        projection.projector.init_state(state, plan, group)
        residual.init_state(state, group, ref)
        low, layout = projection.low_shape, projection.layout
        init_chain(self.inner, low, ref, group, state, ctx.inner_view(layout))

    def update(
        self, u: Tensor, state: State, group: Group, ctx: Context, decay: float = 1.0
    ) -> Tensor | LowRankUpdate:
        """Refresh the basis when due, project ``u``, run the inner chain and project its result
        back (a :class:`~galore2.core.transform.LowRankUpdate`, or a dense tensor), times
        ``decay`` (the step's decoupled weight decay factor 1 − lr·λ, see :meth:`_back`).
        """
        if int(state["galore.side"]) == NONE:  # plain: full-rank inner update
            return run_chain(self.inner, [u], [state], group, [ctx])[0]
        kept = lowrank_screen.screen_of(self).take_one(u, state)  # projected by screened()
        projection, R = kept if kept is not None else self._project(u, state, group, ctx)
        # the inner rules see the direction's layout, as at init
        (N,) = run_chain(self.inner, [R], [state], group, [ctx.inner_view(projection.layout)])
        return self._back(dense(N), state, group, projection, ctx, u, R, decay)

    def update_many(
        self, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context],
        decay: float = 1.0,
    ) -> list[Tensor | LowRankUpdate]:  # fmt: skip
        """Batched :meth:`update`: project (the matrices due for a refresh and those never
        batched one by one, the others per shape batch: :mod:`.lowrank_plan`, whose plan of
        the lists is reused between steps), one inner-chain run over plain and projected
        directions (a stacked batch as one entry), and back."""
        plan = lowrank_plan.cached(self.__dict__.setdefault("_plans", {}), us, states, group,
                                   ctxs)  # fmt: skip
        split = lowrank_plan.split(plan, self._counters)
        # project (or take what screened() projected); plain tensors as they are (the inner
        # chain may not modify its input in place: R is still needed by _back)
        inner_in, projections, keys, stacks = lowrank_screen.project_many(
            self, plan, split, us, states, group, ctxs
        )
        # the inner chain: one run, each stacked batch as one entry
        rounds = len(self.inner) == 1 and not residual.active(group)  # N read by _back alone
        inner_ctxs = lowrank_plan.inner_contexts(ctxs, projections, stacks, rounds)
        N, stacked_N, order, masks = lowrank_plan.run_inner(
            self.inner, inner_in, states, group, inner_ctxs, stacks
        )
        # back: the batches' at once (Fira / APOLLO: every unsharded matrix's), the rest alone
        if residual.active(group):
            done = lowrank_combine.combine_many(
                self.inner, projections, stacks, stacked_N, N, us, inner_in, states, group,
                ctxs, order, decay,
            )  # fmt: skip
        else:
            scale = group["scale"] * decay  # α·(1 − lr·λ), as _back's
            done = lowrank_plan.back_stacks(stacks, stacked_N, masks, N, us, ctxs, scale)
        out: list[Tensor | LowRankUpdate] = list(N)
        for i, p in projections.items():
            out[i] = done[i] if i in done else self._back(
                dense(N[i]), states[i], group, p, ctxs[i], us[i], inner_in[i], decay
            )  # fmt: skip
        for st in stacks:
            for i in st.idx:
                out[i] = done[i]
        lowrank_plan.finish(plan, split, keys, self._counters, bool(stacks))
        return out

    def defers(
        self, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context]
    ) -> bool:
        """:func:`.lowrank_plan.deferrable` (:mod:`galore2.core.deferred`)."""
        plans = self.__dict__.get("_plans", {})
        return lowrank_plan.deferrable(plans, self.inner, us, states, group, ctxs, self._counters)

    def screened(
        self, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context]
    ) -> list[Tensor | None]:
        """R of each local matrix projected this step and not due for a refresh, kept for
        :meth:`update` / :meth:`update_many` (:func:`.lowrank_screen.screen`): the step's
        non-finite test reads R instead of G (Fira's and APOLLO's too); None for the rest."""
        if group["rank"] is None:
            return [None] * len(us)
        return lowrank_screen.screen(self, us, states, group, ctxs)

    def drop_screened(self) -> None:
        """Forget the projections :meth:`screened` kept (the step is over)."""
        lowrank_screen.screen_of(self).clear()

    def masked_keys(self, group: Group) -> tuple[str, ...]:
        """The inner rules' (each direction's flag reaches them: a stacked entry's as the
        stack of its members'), unless a refresh rewrites their state
        (``moments_on_refresh`` other than ``"keep"``: a masked direction's moments would be
        reset or rotated with a basis the snapshot then puts back). Its own state (bases,
        schedule) is not masked: the snapshot keeps it."""
        if group["moments_on_refresh"] != "keep":
            return ()
        return tuple(k for t in self.inner for k in t.masked_keys(group))

    def step_masked_keys(
        self, states: list[State], group: Group, ctxs: list[Context]
    ) -> frozenset[str]:
        """:meth:`masked_keys`, and where none of ``states`` is due for a refresh
        (:func:`.lowrank_plan.none_due`) what only a refresh writes (bases, similarity) and
        the inner rules' masked keys whatever ``moments_on_refresh``."""
        static, plans = frozenset(self.masked_keys(group)), self.__dict__.get("_plans", {})
        if not lowrank_plan.none_due(plans, states, ctxs, self._counters):
            return static
        inner = (k for t in self.inner for k in t.masked_keys(group))
        return static.union(_REFRESH_ONLY, inner)

    def __getstate__(self) -> dict[str, Any]:
        """Plans and screened projections are this process's cache: not pickled."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_plans", "_screen")}

    def _project(
        self, u: Tensor, state: State, group: Group, ctx: Context
    ) -> tuple[Projection, Tensor]:
        """Refresh when due, then R = project(G) (this rank's part of it when sharded)."""
        plan = self.plan(state, group, ctx)
        projection = projection_for(group, plan, ctx.global_shape)
        G = projection.matrix(u)  # this rank's rows; a Tucker weight keeps its N-d shape
        step = int(state["galore.step"])
        if self.refresh_due(state, group) and not ctx.refreshed:
            self.refresh(G, state, group, plan, step, index=ctx.index)
        return projection, projection.project(G, state)

    def _back(
        self, N: Tensor, state: State, group: Group, projection: Projection, ctx: Context,
        u: Tensor, R: Tensor, decay: float,
    ) -> LowRankUpdate | Tensor:  # fmt: skip
        # The optimizer decays before applying an update (torch.optim.AdamW's order). For a
        # projected matrix GaLore decays *after* it (galore-torch, GaLore 2 paper):
        # (W − lr·u)(1 − lr·λ) = W(1 − lr·λ) − lr·(1 − lr·λ)·u, so fold ``decay`` = 1 − lr·λ
        # (the step's factor, 1.0 without decoupled decay) in here, as a scalar of the
        # low-rank update (applied inside the optimizer's addmm_).
        shape = u.shape
        factor = group["scale"] * decay
        if projection.side != TUCKER and residual.active(group):  # Fira / APOLLO: dense
            bias = math.prod((t.bias_correction(state, group) for t in self.inner), start=1.0)
            out = residual.combine_projected(projection, u, R, N, state, group, bias)
            state["galore.step"] += 1
            return out.mul_(decay).view(shape)
        delta = projection.back(N, state, ctx.param.dtype, shape, factor)
        state["galore.step"] += 1
        return delta

    # ---- refresh -----------------------------------------------------------------
    def prepare(
        self, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context]
    ) -> None:
        """Exact refreshes of sharded matrices, batched over ranks
        (:func:`.lowrank_plan.sharded_svds`), installed here as any refresh."""
        for state, plan, new, index in lowrank_plan.sharded_svds(us, states, group, ctxs):
            step = int(state["galore.step"])
            self.refresh(None, state, group, plan, step, new, index=index)

    def refresh(
        self,
        G: Tensor | None,
        state: State,
        group: Group,
        plan: Plan,
        step: int,
        precomputed: dict[str, Tensor] | None = None,
        *,
        index: int = 0,
    ) -> bool:
        """Refresh the basis from ``G`` (or install ``precomputed`` bases when G is None);
        returns False (basis kept, retried next step) when there is no usable result.
        A Tucker weight's G is this rank's N-d gradient (it never comes precomputed);
        ``index``: the parameter's index (its phase under ``refresh_schedule="staggered"``)."""
        projection = projection_for(group, plan, () if G is None else (plan.m, *G.shape[1:]))
        projector = projection.projector
        done = int(state["galore.refreshes"])
        if G is None:
            new = precomputed
        else:
            new = projector.refresh(
                G, state, plan, group, mix_seed(int(state["galore.seed"]), done)
            )
        if new is None:  # schedule untouched (next_refresh ≤ step): the next step retries
            return False
        similarity = None
        if schedule.wants_similarity(state, group):  # how far the subspace moved
            similarity = projector.similarity(new, state, plan)
        mode = group["moments_on_refresh"]
        old = None
        if done > 0 and mode == "project":
            old = tuple(None if b is None else b.clone() for b in projector.bases(state, plan))
        projector.store(state, new, plan)
        if done > 0 and mode == "reset":
            for t in self.inner:
                t.reset(state, group)
        elif old is not None:
            rotate = projection.rotation(old, projector.bases(state, plan))
            for t in self.inner:
                t.rotate(state, rotate)
        schedule.refreshed(state, group, step, index, similarity)
        return True

    def refresh_due(self, state: State, group: Group) -> bool:
        """Is a projected parameter due for a refresh at its next step (its host counters)?
        The schedule's one predicate: the step (``BatchPlan.due`` in bulk) and
        :class:`~galore2.core.capture.CapturedStep` (``due_for_refresh``) both read it."""
        return schedule.due(state)

    def refresh_stats(self, state: State, group: Group) -> dict[str, float] | None:
        """A projected parameter's refreshes so far, its current gap and last subspace
        overlap (:func:`.refresh.stats`); None for a parameter GaLore does not project (the
        optimizer's ``refresh_stats`` collects them)."""
        return schedule.stats(state, group)

    # ---- changed settings ----------------------------------------------------------
    def options_changed(
        self, old: dict[str, Any], group: Group, states: list[tuple[int, State]]
    ) -> None:
        """Re-plan each projected parameter's next refresh after a :attr:`watched` option
        changed — on resume, or by an edit of ``param_groups`` between steps
        (:func:`.refresh.replan`: the new gap governs from the next step, a refresh already
        due stays due)."""
        schedule.replan(old, group, states)


__all__ = ["FULL", "LEFT", "NONE", "RIGHT", "TUCKER", "GaLore"]
