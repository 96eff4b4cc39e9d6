"""GaLore as a wrapper transform: project, run the inner chain in the subspace, project back.

Who owns what: the geometry of a projected parameter — its low-rank shape and layout,
project and back with their collectives, the moment rotation — is its projection's
(:mod:`.projection`: left, right, full, Tucker); how a basis is found and stored is the
projector's (:mod:`galore2.projectors`). GaLore keeps the schedule: when a basis is
refreshed (every ``update_proj_gap`` steps, together or staggered, adaptive gaps), a
refresh retried after an unusable gradient, what happens to the moments at a refresh, and
the folding of weight decay into the low-rank update.

Acts on: the full gradient of a ≥2-D parameter in a group whose ``rank`` is
set. For every other parameter — 1-D, ``rank`` unset, or ``rank ≥ min(m, n)`` —
it is transparent and the inner chain runs on the full gradient (plain AdamW for
``GaLoreAdamW``).

Weights with more than two dims (convolutions, stacked experts…) get a Tucker
projection by default (``tensor_projection="tucker"``, side ``TUCKER``, see
:mod:`galore2.projectors.tucker`): a factor U_k (d_k × min(rank, d_k)) per mode
that ``rank`` reduces, found by the group's projector from the mode's unfolding of
the gradient (truncated HOSVD); the inner chain runs on the core
G ×_0 U_0ᵀ ×_1 U_1ᵀ …, whose result comes back as a dense N ×_0 U_0 ×_1 U_1 …;
same schedule, robustness and ``moments_on_refresh`` modes (``project`` rotates
the core per mode). ``rank ≥`` every dim leaves the weight unprojected.
``tensor_projection="matrix"`` treats it as the matrix ``shape[0] × rest`` instead.

State per projected parameter: the basis (r·m or r·n fp32, see the projector; a
Tucker weight: its factors), the inner chain's state at the low-rank (core) shape,
and four int64 CPU counters (``galore.side``, ``galore.step``,
``galore.next_refresh``, ``galore.refreshes``) plus the parameter's seed.

Refresh schedule: at the parameter's first step and then every
``update_proj_gap`` steps (steps 0, T, 2T, … when every step is usable). A
refresh whose gradient is non-finite or all zero keeps the previous basis and
is retried at the next step. On a successful refresh the inner moments are
kept (``keep``, galore-torch's behaviour), zeroed with their step count
(``reset``), or rotated into the new basis (``project``: M ← C·M with
C = P_newᵀ·P_old, and second moments with C∘C so they stay non-negative —
the variance of a sum of independent coordinates).
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from .._numerics import mix_seed
from ..core import masked, packing
from ..core.counters import Counters
from ..core.options import Bool, Choice, Int, Option, Optional, Real
from ..core.state import counter
from ..core.transform import (
    Context,
    Group,
    LowRankUpdate,
    StackedState,
    State,
    Transform,
    dense,
    init_chain,
    run_chain,
    walk,
)
from ..projectors import (
    FULL,
    LEFT,
    NONE,
    RIGHT,
    TUCKER,
    Plan,
    choose_side,
    get_projector,
    validate_projector_options,
)
from ..projectors import KINDS as PROJECTOR_KINDS
from ..projectors import OPTIONS as PROJECTOR_OPTIONS
from ..storage.basis import OPTIONS as BASIS_OPTIONS
from ..storage.basis import validate_basis_options
from . import lowrank_batch, residual
from .projection import Projection, projection_for

RANK = Option(
    "rank",
    None,
    Optional(Int(low=1), "no projection: the inner rule at full rank"),
    "rank r of the subspace; None leaves the group's parameters unprojected",
    resumable=False,
)
UPDATE_PROJ_GAP = Option("update_proj_gap", 200, Int(low=1), "steps T between subspace refreshes")
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
SEED = Option(
    "seed",
    0,
    Int(low=0, high=2**62),
    "base seed of the random sketches and projections",
    resumable=False,
)
TENSOR_PROJECTION = Option(
    "tensor_projection",
    "tucker",
    Choice(("tucker", "matrix")),
    "weights with more than two dims: per-mode Tucker factors, or shape[0] x rest as a matrix",
    resumable=False,
)
ADAPTIVE_REFRESH = Option(
    "adaptive_refresh", False, Bool(), "lengthen a parameter's gap while its subspace stays put"
)
REFRESH_THRESHOLD = Option(
    "refresh_threshold",
    0.4,
    Real(low=0.0, high=1.0, low_open=True),
    "subspace overlap at or above which a refresh counts as 'stable' (adaptive refresh)",
)
REFRESH_PATIENCE = Option(
    "refresh_patience", 3, Int(low=1), "stable refreshes in a row before the gap doubles"
)
REFRESH_SCHEDULE = Option(
    "refresh_schedule",
    "together",
    Choice(("together", "staggered")),
    "refresh every matrix at the same steps, or each at its own phase of the gap (no stall)",
)
MAX_UPDATE_PROJ_GAP = Option(
    "max_update_proj_gap",
    None,
    Optional(Int(low=1), "8 x update_proj_gap"),
    "the longest gap adaptive refresh may reach",
)
OPTIONS = (
    RANK,
    UPDATE_PROJ_GAP,
    REFRESH_SCHEDULE,
    SCALE,
    PROJ_TYPE,
    *PROJECTOR_OPTIONS,
    MOMENTS_ON_REFRESH,
    SEED,
    *BASIS_OPTIONS,
    ADAPTIVE_REFRESH,
    REFRESH_THRESHOLD,
    REFRESH_PATIENCE,
    MAX_UPDATE_PROJ_GAP,
    TENSOR_PROJECTION,
    *residual.OPTIONS,
)


class GaLore(Transform):
    """Wrapper transform: project the gradient, run ``inner`` in the subspace, project back.

    In a group whose ``rank`` is set, a ≥2-D parameter's gradient G is projected onto a
    rank-``rank`` basis (left PᵀG, right GQ, full PᵀGQ; a Tucker core for weights with more
    than two dims) refreshed every ``update_proj_gap`` steps by the group's ``projector``;
    the inner chain runs at that low-rank shape, and its result comes back to the full space
    scaled by ``scale``, as a :class:`~galore2.core.transform.LowRankUpdate` the optimizer
    applies in one fused ``addmm_``. For every other parameter (1-D, ``rank`` unset,
    ``rank ≥ min(m, n)``) GaLore is transparent: the inner chain runs on the full gradient.
    A refresh whose gradient is non-finite or all zero keeps the previous basis and is
    retried at the next step; ``moments_on_refresh`` keeps, zeroes or rotates the inner
    moments at a refresh.

    Args:
        *inner: the transforms run in the subspace, in order (e.g. ``ScaleByAdam()``).

    Raises:
        ValueError: no inner transform.
    """

    name = "galore"
    options = OPTIONS
    takes_decay = True  # folds the step's decoupled decay into projected updates (_back)
    #: host step counter a masked step advances for a masked parameter too: set back by its
    #: skips when they are read (see :mod:`galore2.core.nonfinite`)
    host_step_counters = ("galore.step",)
    kinds: ClassVar[dict[str, str]] = {
        "galore.side": "other",
        "galore.step": "other",
        "galore.next_refresh": "other",
        "galore.refreshes": "other",
        "galore.seed": "other",
        "galore.gap": "other",
        "galore.streak": "other",
        "galore.similarity": "other",
        residual.LIMIT_KEY: "other",
        **PROJECTOR_KINDS,
    }

    def __init__(self, *inner: Transform) -> None:
        if not inner:
            raise ValueError("GaLore needs at least one inner transform (e.g. ScaleByAdam())")
        self.inner: list[Transform] = list(inner)
        self._counters = Counters()  # the batched matrices' host counters, packed

    def validate(self, group: Group) -> None:
        """Check the options that involve several keys: projector, basis storage, residual and
        ``max_update_proj_gap ≥ update_proj_gap``; ``ValueError`` naming them.
        """
        validate_projector_options(group)
        validate_basis_options(group)
        residual.validate(group)
        cap, gap = group["max_update_proj_gap"], group["update_proj_gap"]
        if cap is not None and cap < gap:
            raise ValueError(
                f"max_update_proj_gap must be None (8 x update_proj_gap) or an int >= "
                f"update_proj_gap ({gap}), got {cap!r}"
            )
        super().validate(group)

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

    # ---- planning ----------------------------------------------------------------
    @staticmethod
    def matrix_shape(shape: torch.Size) -> tuple[int, int]:
        """A weight's shape seen as a matrix: ``(shape[0], product of the rest)``."""
        n = 1
        for d in shape[1:]:
            n *= int(d)
        return int(shape[0]), n

    def plan(self, state: State, group: Group, ctx: Context) -> Plan:
        """The :class:`~galore2.projectors.Plan` of a parameter (side chosen by :meth:`init`)."""
        m, n = self.matrix_shape(ctx.global_shape)
        side, rank = int(state["galore.side"]), int(group["rank"])
        hadamard = bool(group.get("basis_hadamard", False))
        seed = state.get("galore.seed") if hadamard else None  # the Hadamard signs' seed
        return Plan(
            side, m, n, rank, ctx.param.device, ctx.placement,
            basis=group.get("basis_dtype", "fp32"),
            group_size=int(group.get("basis_group_size", 256)),
            hadamard=hadamard,
            basis_seed=0 if seed is None else int(seed),
            precision=group.get("proj_precision", "fp32"),
        )  # fmt: skip

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
        state["galore.step"] = counter()
        state["galore.next_refresh"] = counter()
        state["galore.refreshes"] = counter()
        state["galore.seed"] = counter(mix_seed(group["seed"], ctx.index))
        if group["adaptive_refresh"]:
            _init_adaptive(state, group)
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
        projection, R = self._project(u, state, group, ctx)
        # the inner rules see the direction's layout, as at init
        (N,) = run_chain(self.inner, [R], [state], group, [ctx.inner_view(projection.layout)])
        return self._back(dense(N), state, group, projection, ctx, u, R, decay)

    def update_many(
        self, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context],
        decay: float = 1.0,
    ) -> list[Tensor | LowRankUpdate]:  # fmt: skip
        """Batched :meth:`update`: one inner-chain run over plain and projected directions;
        same-shape matrices projected, combined and back-projected per shape batch
        (:mod:`.lowrank_batch`, whose plan of the lists is reused between steps)."""
        plan = self._batch_plan(us, states, group, ctxs)
        # the plain tensors as they are, projected ones as R (the inner chain may not modify
        # its input in place: R is still needed by _back)
        inner_in: list[Tensor] = list(us)
        singles, live = plan.singles, [(b, None) for b in plan.batches]
        due = plan.due(self._counters) if plan.batches else None
        skip: list[int] = []  # positions in plan.batched that step on their own this time
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
        projections: dict[int, Projection] = {}
        for i in singles:
            projections[i], inner_in[i] = self._project(us[i], states[i], group, ctxs[i])
        projector = get_projector(group["projector"])
        keys = self._stack_keys(group, us[0].device) if plan.batches else None
        stacks: list[_Stacked] = []
        # where the batches' updates go out as factors (see _factored; batches of large
        # matrices), no stack of the gradients is made: each is read once, by its own matmul
        factored = _factored(group, ctxs)
        for batch, rest in live:
            fac = factored and lowrank_batch.along_data(us[batch.idx[0]])
            G, B, Y, R = batch.project(us, projector, group["proj_precision"], rest, not fac)
            idx = batch.idx if rest is None else [batch.idx[j] for j in rest]
            stacked = batch.stacked_state(keys) if keys is not None and rest is None else None
            if stacked is None:  # its matrices go through the chain one by one
                for i, r in zip(idx, R.unbind(0), strict=True):
                    inner_in[i] = r
            stacks.append(_Stacked(batch, idx, G, B, Y, R, stacked, fac))
        # the inner rules see each projected direction's layout, as at init (plain: the param's)
        inner_ctxs = list(ctxs)
        for i, p in projections.items():
            inner_ctxs[i] = ctxs[i].inner_view(p.layout)
        for st in stacks:
            if st.state is None:  # its matrices go through the chain one by one
                for i in st.idx:
                    inner_ctxs[i] = ctxs[i].inner_view(st.batch.kind.layout)
        results, stacked_out, order, masks = self._run_inner(
            inner_in, states, group, inner_ctxs, stacks
        )
        out: list[Tensor | LowRankUpdate] = list(results)
        if residual.active(group):
            done = self._combine_many(
                projections, stacks, stacked_out, results, us, inner_in, states, group, order,
                decay,
            )  # fmt: skip
        else:
            done = {}
            scale = group["scale"] * decay  # α·(1 − lr·λ), as _back's
            for st, N, mask in zip(stacks, stacked_out, masks, strict=True):
                Ns = N if N is not None else [dense(results[i]) for i in st.idx]
                dtype = ctxs[st.idx[0]].param.dtype
                if st.factored:  # factors: each weight takes its update in one addmm_
                    shapes = [us[i].shape for i in st.idx]
                    # the projection's cast of the bases when in dtype (no second cast)
                    B = st.Y if st.Y.dtype == dtype else st.batch.cast_bases(st.B, dtype)
                    ups = lowrank_batch.factors(st.batch.kind, B, Ns, dtype, scale, shapes)
                    done.update(zip(st.idx, ups, strict=True))
                    continue
                # a masked step: dense updates, masked on the r-row stacks. G is projected
                # already: its buffer takes the update (when it is a temporary stack, not a
                # view of the gradients)
                G = st.G
                spent = G if G is not None and G.dtype == dtype and packing.writable(G) else None
                deltas = lowrank_batch.back(st.batch.kind, st.B, Ns, dtype, scale, spent, mask)
                done.update(zip(st.idx, masked.entries(deltas), strict=True))
        for i, p in projections.items():
            out[i] = done[i] if i in done else self._back(
                dense(results[i]), states[i], group, p, ctxs[i], us[i], inner_in[i], decay
            )  # fmt: skip
        for st in stacks:
            for i in st.idx:
                out[i] = done[i]
        if keys is not None and due is not None:  # stack the refreshed batches' state now,
            for batch in plan.batches:  # so that next step's state is as it will stay
                batch.stacked_state(keys)
        if stacks:  # the batched matrices' GaLore steps (per-tensor ones counted their own)
            lowrank_batch.advance_counters(self._counters, plan.batched, "galore.step", skip)
        return out

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
        """:meth:`masked_keys`, and on a step where none of ``states`` is due for a refresh
        (their host counters, read as :meth:`update_many` reads them: these lists' batch
        plan must be last step's) what only a refresh writes — the bases, the subspace
        similarity — and the inner rules' masked keys whatever ``moments_on_refresh`` (only
        a refresh resets or rotates moments). Unknown (a new plan): :meth:`masked_keys`."""
        static = frozenset(self.masked_keys(group))
        plan = self.__dict__.get("_plans", {}).get((len(states), id(states[0]) if states else 0))
        if plan is None or not plan.holds(states, ctxs):
            return static
        for i in plan.singles:
            s = states[i]
            if "galore.next_refresh" in s and int(s["galore.step"]) >= int(
                s["galore.next_refresh"]
            ):
                return static
        if plan.batches and plan.due(self._counters) is not None:
            return static
        inner = (k for t in self.inner for k in t.masked_keys(group))
        return static.union(_REFRESH_ONLY, inner)

    def _stack_keys(self, group: Group, device: torch.device) -> tuple[str, ...] | None:
        """The inner chain's state keys a shape batch may stack (every transform's
        ``linear_keys`` and ``quadratic_keys``, wrapped ones' too: those its states hold
        are stacked), or None when one of them does not take
        stacked entries (:meth:`~galore2.core.transform.Transform.stacks`)."""
        if not all(t.stacks(group, device) for t in self.inner):
            return None
        return tuple(k for t in walk(self.inner) for k in (*t.linear_keys, *t.quadratic_keys))

    def _run_inner(
        self, inner_in: list[Tensor], states: list[State], group: Group, ctxs: list[Context],
        stacks: list[_Stacked],
    ) -> tuple[list[Any], list[Tensor | None], list[int], list[Tensor | None]]:  # fmt: skip
        """The inner chain over the directions, each shape batch with a stacked state as one
        stacked entry (its ``R``; the last entries of the chain's lists). Returns the
        per-tensor results (None for a stacked batch's matrices), each batch's stacked result
        (or None), the order in which the chain saw the states (with stacks expanded), and
        each batch's stacked mask (a masked step's ``(k, 1, 1)`` flags of a stacked entry;
        else None)."""
        stacked = [st for st in stacks if st.state is not None]
        none: list[Tensor | None] = [None] * len(stacks)
        if not stacked:
            return run_chain(self.inner, inner_in, states, group, ctxs), none, (
                list(range(len(states)))
            ), none  # fmt: skip
        skip = set()
        for st in stacked:
            skip.update(st.idx)
        order = [i for i in range(len(states)) if i not in skip]
        entries = _stacked_ctxs(stacked, ctxs)
        if len(self.inner) == 1:  # a factored batch's N is rounded to the weights' dtype first
            entries = [
                e.rounded_to(ctxs[st.idx[0]].param.dtype) if st.factored else e
                for e, st in zip(entries, stacked, strict=True)
            ]  # fmt: skip
        res = run_chain(
            self.inner,
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

    def _batch_plan(
        self, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context]
    ) -> lowrank_batch.BatchPlan:
        """The :class:`~.lowrank_batch.BatchPlan` of these lists: last step's if it still
        holds (the same state dicts and contexts, the same group-level batchability and
        rank), else a new one."""
        key = (len(states), id(states[0]) if states else 0)
        plans = self.__dict__.setdefault("_plans", {})
        plan = plans.get(key)
        can = lowrank_batch.group_batchable(group)
        if (
            plan is None
            or plan.can_batch != can
            or plan.rank != group["rank"]
            or not plan.holds(states, ctxs)
        ):
            plans.pop(key, None)
            if len(plans) >= _MAX_PLANS:  # the oldest goes (lists of a past step)
                plans.pop(next(iter(plans)))
            plan = plans[key] = lowrank_batch.BatchPlan(us, states, ctxs, group, can)
        return plan

    def __getstate__(self) -> dict[str, Any]:
        """Plans are a cache of this process's tensors: a pickled GaLore carries none."""
        return {k: v for k, v in self.__dict__.items() if k != "_plans"}

    def _combine_many(
        self, projections: dict[int, Projection], stacks: list[_Stacked],
        stacked_out: list[Tensor | None], N: list[Tensor | LowRankUpdate], us: list[Tensor],
        R: list[Tensor], states: list[State], group: Group, counted: list[int], decay: float,
    ) -> dict[int, Tensor]:  # fmt: skip
        """Fira / APOLLO of the whole (unsharded) matrices of a batch at once
        (:func:`.residual.combine_buckets`): the shape batches' stacks as they are, the
        matrices projected one by one stacked per shape (when two or more, or along with
        shape batches); {index: dense update}. Sharded ones go per tensor."""
        idx = [
            i
            for i, p in projections.items()
            if not p.plan.placement.distributed and p.side != TUCKER
        ]
        if not stacks and len(idx) < 2:
            return {}
        fira = group["residual"] != "none"
        # every state's, in the order the inner chain counted them: one read of packed counters
        biases: list[Any] = [None] * len(states)
        for i, b in zip(counted, self._biases([states[i] for i in counted], group), strict=True):
            biases[i] = b
        buckets, order = [], []
        for st, stacked in zip(stacks, stacked_out, strict=True):
            st_states = [states[i] for i in st.idx]
            Ns = stacked if stacked is not None else torch.stack([dense(N[i]) for i in st.idx])
            B = st.B if fira else None
            buckets.append(residual.Bucket(st.batch.kind.left, st.G, st.R, Ns, B, st_states,
                                           [biases[i] for i in st.idx],
                                           owned=packing.writable(st.G)))  # fmt: skip
            order.append(st.idx)
        keyed: dict[tuple[Any, ...], list[int]] = {}
        for i in idx:
            g, side = projections[i].matrix(us[i]), projections[i].side
            keyed.setdefault((side, g.shape, R[i].shape, g.dtype, g.device), []).append(i)
        for same in keyed.values():
            ps = [projections[i] for i in same]
            st_states = [states[i] for i in same]
            buckets.append(residual.Bucket(
                ps[0].left, torch.stack([p.matrix(us[i]) for p, i in zip(ps, same, strict=True)]),
                torch.stack([R[i] for i in same]), torch.stack([dense(N[i]) for i in same]),
                torch.stack([p.basis(states[i]) for p, i in zip(ps, same, strict=True)])  # type: ignore[misc]
                if fira else None,
                st_states, [biases[i] for i in same],
            ))  # fmt: skip
            order.append(same)
        out = residual.combine_buckets(buckets, group, decay)
        n_stacked = sum(len(st.idx) for st in stacks)
        done: dict[int, Tensor] = {}
        for same, s in zip(order, out, strict=True):
            if len(done) < n_stacked:  # a shape batch's: 2-D matrices as they are
                done.update(zip(same, s.unbind(0), strict=True))
                continue
            done.update((i, m.view(us[i].shape)) for i, m in zip(same, s.unbind(0), strict=True))
        for i in idx:
            states[i]["galore.step"] += 1
        return done

    def _biases(self, states: list[State], group: Group) -> list[float | Tensor]:
        """Each state's bias correction of the inner chain (the product of its transforms';
        a transform's ``bias_corrections`` answers for a whole list at once where it has one)."""
        out: list[Any] | None = None
        for t in self.inner:
            many = getattr(t, "bias_corrections", None)
            values = many(states, group) if many else [t.bias_correction(s, group) for s in states]
            out = values if out is None else [a * b for a, b in zip(out, values, strict=True)]
        return out  # type: ignore[return-value]

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
            return self._combine(N, state, group, projection, u, R).mul_(decay).view(shape)
        delta = projection.back(N, state, ctx.param.dtype, shape, factor)
        state["galore.step"] += 1
        return delta

    def _combine(
        self, N: Tensor, state: State, group: Group, projection: Projection, u: Tensor,
        R: Tensor,
    ) -> Tensor:  # fmt: skip
        """Fira's residual compensation or APOLLO's gradient scaling (:mod:`.residual`)."""
        N, R = projection.full(N, R)
        plan = projection.plan
        P, Q = (
            projection.projector.bases(state, plan) if group["residual"] != "none" else (None, None)
        )
        bias = 1.0
        for t in self.inner:
            bias *= t.bias_correction(state, group)
        out = residual.combine(projection.matrix(u), R, N, P, Q, state, group, plan, bias)
        state["galore.step"] += 1
        return out

    # ---- refresh -----------------------------------------------------------------
    def prepare(
        self, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context]
    ) -> None:
        """Exact refreshes of sharded matrices, batched: gather every due matrix to its owner
        rank, let each rank run its own SVDs (concurrently with the others), then broadcast."""
        if group["projector"] != "svd" or not any(c.placement.distributed for c in ctxs):
            return
        projector = get_projector("svd")
        due = []
        for u, state, ctx in zip(us, states, ctxs, strict=True):
            side = int(state["galore.side"])
            if side in (NONE, TUCKER) or not ctx.placement.distributed:
                continue  # Tucker weights refresh per tensor (one gather for all modes)
            if not self.refresh_due(state, group):
                continue
            plan = self.plan(state, group, ctx)
            scaled = projector.refresh_input(u.reshape(-1, plan.n), plan)
            ctx.refreshed = True  # this step's refresh is decided here, done or not
            if scaled is not None:
                owner = projector.owner(state, plan)
                full = plan.placement.gather_rows(scaled, owner)
                due.append((state, plan, owner, full, u, ctx.index))
        computed = [projector.compute(full, plan) for _, plan, _, full, _, _ in due]
        for (state, plan, owner, _, u, index), bases in zip(due, computed, strict=True):
            new = projector.distribute(bases, owner, plan, u.device)
            step = int(state["galore.step"])
            self.refresh(None, state, group, plan, step, projector.checked(new, plan), index=index)

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
        if done > 0 and group["adaptive_refresh"]:  # how far the subspace moved
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
        state["galore.refreshes"] += 1
        gap = _next_gap(state, group, similarity)
        state["galore.next_refresh"].fill_(
            next_refresh(step, gap, group["refresh_schedule"], index)
        )
        return True

    def refresh_due(self, state: State, group: Group) -> bool:
        """Is a projected parameter due for a refresh at its next step (its host counters)?
        The one predicate of the schedule: the step refreshes exactly when it holds (the
        batched path compares the same counters in bulk: ``BatchPlan.due``), and a
        :class:`~galore2.core.capture.CapturedStep` runs that step eagerly (through the
        optimizer's ``due_for_refresh``, which re-plans an edited gap first, as the step
        does)."""
        due = state.get("galore.next_refresh")
        return due is not None and int(state["galore.step"]) >= int(due)

    def refresh_stats(self, state: State, group: Group) -> dict[str, float] | None:
        """A projected parameter's refreshes so far, its current gap between refreshes (it
        varies with ``adaptive_refresh``) and the last measured subspace overlap (NaN if
        none); None for a parameter GaLore does not project (the optimizer's
        ``refresh_stats`` collects them)."""
        if "galore.refreshes" not in state:
            return None
        gap = state.get("galore.gap")
        sim = state.get("galore.similarity")
        return {
            "refreshes": int(state["galore.refreshes"]),
            "gap": int(gap) if gap is not None else int(group["update_proj_gap"]),
            "similarity": float(sim) if sim is not None else float("nan"),
        }

    #: state it creates on demand (``adaptive_refresh``): a checkpoint may lack them
    optional_keys: ClassVar[frozenset[str]] = frozenset(
        {"galore.gap", "galore.streak", "galore.similarity"}
    )

    # ---- changed settings ----------------------------------------------------------
    #: the options whose change :meth:`options_changed` must see (the schedule caches them
    #: in ``galore.next_refresh``; every other option is read afresh at each step)
    watched: ClassVar[frozenset[str]] = frozenset(
        {"update_proj_gap", "refresh_schedule", "adaptive_refresh", "max_update_proj_gap"}
    )

    def options_changed(
        self,
        old: dict[str, Any],
        group: Group,
        states: list[tuple[int, State]],
    ) -> None:
        """Re-plan each projected parameter's next refresh after ``update_proj_gap`` (or the
        schedule) changed — on resume, or by an edit of ``param_groups`` between steps —
        so the new gap governs from the next step: the last refresh is placed where the old
        schedule put it (``next_refresh − old gap``), and the next one comes one new gap
        after it (at the parameter's phase when staggered); if that step has passed, the
        refresh is due at the next step (staggered: at the parameter's next phase, within
        one gap, so the change does not make every matrix refresh at once).

        A refresh already due at the next step — scheduled there, or pending after one that
        found no usable gradient (retried) — stays due there: the edit does not move it
        (the old schedule owes it, and a later one would leave the basis older than either
        gap says); the new gap counts from it. An adaptive gap is brought into the new
        range either way.

        Args:
            old: the watched options' values the state was scheduled with.
            group: the parameter group, with the new values.
            states: (parameter index, state) of the group's parameters that have state.
        """
        old_group = {**group, **old}
        for index, state in states:
            if "galore.next_refresh" not in state or int(state["galore.refreshes"]) == 0:
                continue  # not projected, or never refreshed: due at its next step anyway
            step, due = int(state["galore.step"]), int(state["galore.next_refresh"])
            last = due - _current_gap(state, old_group)
            if group["adaptive_refresh"] and "galore.gap" in state:  # keep it in the new range
                cap = group["max_update_proj_gap"] or 8 * group["update_proj_gap"]
                gap = min(max(int(state["galore.gap"]), group["update_proj_gap"]), cap)
                state["galore.gap"].fill_(gap)
            if due <= step:  # due at the next step, or pending (retried): it stays due
                continue
            gap = _current_gap(state, group)
            schedule = group["refresh_schedule"]
            due = next_refresh(last, gap, schedule, index)
            if due < step:  # overdue under the new gap
                due = step if schedule == "together" else _at_phase(step, gap, index)
            state["galore.next_refresh"].fill_(due)


#: at most this many cached batch plans per GaLore (one per group and device of a step)
_MAX_PLANS = 64


class _Stacked(NamedTuple):
    """A shape batch's tensors of this step (the matrices ``idx`` projected together)."""

    batch: lowrank_batch.ShapeBatch
    idx: list[int]
    G: Tensor | None  # the stacked gradients (None: not stacked, see _factored)
    B: Tensor  # the stacked bases, as stored
    Y: Tensor  # B in the projection's operand dtype (B itself when that is its dtype)
    R: Tensor  # the stacked projected gradients
    state: StackedState | None  # the inner chain's state of them as one stacked entry
    factored: bool  # along the data: G not stacked, the update as factors (see _factored)


#: 2**64 / golden ratio: consecutive indices land far apart in every window (Fibonacci hashing)
_GOLDEN = 0x9E3779B97F4A7C15


def phase(index: int, gap: int) -> int:
    """The step within each ``gap``-step window at which parameter ``index`` refreshes under
    ``refresh_schedule="staggered"``: ⌊frac(index·φ⁻¹)·gap⌋ in exact integer arithmetic
    (Fibonacci hashing), so any set of n parameters — consecutive, or every k-th — puts
    about ⌈n/gap⌉ refreshes on each step. A pure function of the index: the same after a
    resume, on every rank."""
    return (((index * _GOLDEN) % 2**64) * gap) >> 64


def _at_phase(start: int, gap: int, index: int) -> int:
    """The first step ≥ ``start`` at parameter ``index``'s phase."""
    return start + (phase(index, gap) - start) % gap


def next_refresh(step: int, gap: int, schedule: str, index: int) -> int:
    """The step of the next refresh after one at ``step``. ``together``: ``step + gap``
    (every parameter refreshed at its first step then every gap: steps 0, T, 2T…).
    ``staggered``: the first step at the parameter's :func:`phase` at least half a gap
    later — exactly ``step + gap`` once on its phase; after the first refresh (step 0),
    a retried one or a changed gap, within [gap/2, 3·gap/2), which brings it back on
    its phase."""
    if schedule == "together":
        return step + gap
    return _at_phase(step + (gap + 1) // 2, gap, index)


def _current_gap(state: State, group: Group) -> int:
    """The gap the parameter's schedule runs on (the adaptive one where it has one)."""
    if group["adaptive_refresh"] and "galore.gap" in state:
        return max(int(state["galore.gap"]), group["update_proj_gap"])
    return group["update_proj_gap"]


def _factored(group: Group, ctxs: list[Context]) -> bool:
    """Do the shape batches' updates go out as factors
    (:func:`.lowrank_batch.factors`: the optimizer writes each into its weight by one
    ``addmm_``, and the gradients are projected where they are, not stacked)? Yes but on
    a masked step (``capturable=True``: a batch's update is masked on its r-row stack
    and applied densely, :func:`.lowrank_batch.back`) and for Fira / APOLLO (their dense
    update needs the gradients stacked: :func:`.residual.combine_buckets`)."""
    return not residual.active(group) and not (ctxs and ctxs[0].mask is not None)


def _stacked_ctxs(stacked: list[_Stacked], ctxs: list[Context]) -> list[Context]:
    """The context of each stacked entry: its first member's (as the inner chain sees it:
    :meth:`~galore2.core.module.Context.inner_view`), with (a masked step) the
    members' flags as its ``mask`` — ``(k, 1, 1)`` views of one pick of every stacked
    member's flag from the batch's flags (one ``index_select``; the rules derive their
    weights from it once)."""
    firsts = [ctxs[st.idx[0]].inner_view(st.batch.kind.layout) for st in stacked]
    mask = firsts[0].mask
    if mask is None:
        return firsts
    base = mask if mask._base is None else mask._base
    # each flag's place in the batch's flags (its 0-d view's offset), picked by a cached index
    at = [ctxs[i].mask.storage_offset() - base.storage_offset()  # type: ignore[union-attr]
          for st in stacked for i in st.idx]  # fmt: skip
    flags = masked.pick(base, at)
    out, start = [], 0
    for st, first in zip(stacked, firsts, strict=True):
        k = len(st.idx)
        view = flags[start : start + k].view(k, *(1,) * (st.R.dim() - 1))
        out.append(first.with_mask(view))
        start += k
    return out


#: the state only a refresh writes (see GaLore.step_masked_keys)
_REFRESH_ONLY = frozenset((*PROJECTOR_KINDS, "galore.similarity"))


def _init_adaptive(state: State, group: Group) -> None:
    state["galore.gap"] = counter(group["update_proj_gap"])
    state["galore.streak"] = counter()
    state["galore.similarity"] = torch.tensor(float("nan"), dtype=torch.float32)


def _next_gap(state: State, group: Group, similarity: float | None) -> int:
    """Steps until the next refresh. Fixed (``update_proj_gap``) unless ``adaptive_refresh``:
    then, after ``refresh_patience`` refreshes in a row whose subspace overlap with the
    previous basis is ≥ ``refresh_threshold``, the gap doubles (up to
    ``max_update_proj_gap``, default 8·T); a refresh below the threshold halves it (never
    below T), since the subspace is moving."""
    base = group["update_proj_gap"]
    if not group["adaptive_refresh"]:
        return base
    if "galore.gap" not in state:  # adaptive refresh switched on after the state was made
        _init_adaptive(state, group)
    gap = max(int(state["galore.gap"]), base)
    if similarity is not None:
        state["galore.similarity"].fill_(similarity)
        cap = group["max_update_proj_gap"] or 8 * base
        if similarity >= group["refresh_threshold"]:
            state["galore.streak"] += 1
            if int(state["galore.streak"]) >= group["refresh_patience"]:
                gap = min(2 * gap, cap)
                state["galore.streak"].zero_()
        else:
            state["galore.streak"].zero_()
            gap = max(base, gap // 2)
    state["galore.gap"].fill_(gap)
    return gap


__all__ = ["FULL", "LEFT", "NONE", "RIGHT", "TUCKER", "GaLore"]
