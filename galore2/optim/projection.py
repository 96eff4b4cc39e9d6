"""Projection geometry: one object per kind of projected parameter.

:class:`LeftProjection` (R = PᵀG, r×n), :class:`RightProjection` (R = G·Q, m×r),
:class:`FullProjection` (two-sided, R = PᵀGQ, r×r) and :class:`TuckerProjection` (the core
G ×_0 U_0ᵀ ×_1 U_1ᵀ … of a weight with more than two dims). Each owns, for one parameter:

* the low-rank shape the inner chain sees and its layout under FSDP2 (``low_shape``,
  ``layout``: left r×n shards by columns, right m×r by rows, full replicated, a Tucker core
  replicated or row-sharded);
* ``project``: the projector's product plus the reduction it needs on row-sharded G (left:
  reduce-scatter to a column shard; full and a Tucker core with mode 0 reduced: all-reduce;
  right: nothing, G·Q is row-local);
* ``back``: the all-gather of the inner result (left) and the full-space update — factors
  of a :class:`~galore2.core.transform.LowRankUpdate`, or a dense Tucker update;
* ``rotation``: the change of coordinates of the moments when the basis moves;
* the collectives it issues (``step_collectives``, ``refresh_collectives``), which
  :mod:`galore2.traffic` adds up instead of deriving them again.

How a basis is found and stored is the projector's (:mod:`galore2.projectors`); when the
basis is refreshed and what happens to the moments then is GaLore's schedule
(:class:`~galore2.optim.galore.GaLore`). Collectives go through the plan's placement: no
DTensor here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..core.transform import Context, LowRankUpdate, State
from ..kernels.ops_lowrank import mm_each_
from ..kernels.ops_scaled import project_norms_each
from ..placement import Collective
from ..projectors import (
    FULL,
    LEFT,
    PROJ_PRECISION,
    RIGHT,
    TUCKER,
    Plan,
    Projector,
    TuckerProjector,
    get_projector,
    low_rank_shape,
)

Rotation = Callable[[Tensor, bool], Tensor]
Bases = tuple[Tensor | None, ...]


class Projection:
    """A matrix projection's geometry (subclasses: one per side); see the module docstring.

    Args:
        projector: finds and stores the basis (the group's ``projector``).
        plan: the parameter's :class:`~galore2.projectors.Plan` (side, m×n, rank, placement).
    """

    side: ClassVar[int]
    #: the low-rank state's layout under FSDP2 (see :data:`galore2.placement.LAYOUTS`)
    layout: ClassVar[str]
    #: whether its matrices may be stacked into one ``bmm`` (:mod:`.lowrank_batch`)
    stackable: ClassVar[bool] = False
    #: which bases it reads: P (m×r, row-sharded) and / or Q (n×r, replicated)
    left: ClassVar[bool] = False
    right: ClassVar[bool] = False
    #: the state key of a stackable projection's basis
    basis_key: ClassVar[str] = ""

    __slots__ = ("plan", "projector")

    def __init__(self, projector: Projector, plan: Plan) -> None:
        self.projector = projector
        self.plan = plan

    # ---- shapes ------------------------------------------------------------------
    @property
    def low_shape(self) -> torch.Size:
        """The global shape of R and of the inner chain's state."""
        plan = self.plan
        return torch.Size(low_rank_shape(plan.m, plan.n, plan.side, plan.rank))

    def matrix(self, u: Tensor) -> Tensor:
        """This rank's rows of the gradient as the projector sees them (m×n rows)."""
        return u.reshape(-1, self.plan.n)

    # ---- project / back ----------------------------------------------------------
    def project(self, G: Tensor, state: State) -> Tensor:
        """R = the projector's product of ``G`` (:meth:`matrix`), reduced over the ranks
        as the side needs (this rank's part of R)."""
        return self.reduce(self.projector.project(G, state, self.plan))

    def reduce(self, R: Tensor) -> Tensor:
        """This rank's part of R from its partial product (right: G·Q is row-local)."""
        return R

    def gather(self, N: Tensor) -> Tensor:
        """The inner result as every rank needs it for its rows of the update."""
        return N

    def back(
        self, N: Tensor, state: State, dtype: torch.dtype, shape: torch.Size, factor: float
    ) -> LowRankUpdate | Tensor:
        """``factor`` times the full-space update of the inner result ``N``, for this rank's
        rows (``shape``: the local gradient's), as factors applied in one fused ``addmm_``."""
        A, B = self.projector.back_factors(self.gather(N), state, self.plan, dtype)
        return LowRankUpdate(A, B, shape, factor)

    def full(self, N: Tensor, R: Tensor) -> tuple[Tensor, Tensor]:
        """N and R whole on every rank (a residual needs them: Fira / APOLLO)."""
        return N, R

    @staticmethod
    def project_stack(G: Tensor, B: Tensor) -> Tensor:
        """R of stacked gradients ``G`` and bases ``B`` (``stackable`` projections only)."""
        raise NotImplementedError("only a stackable projection batches its products")

    @staticmethod
    def back_stack(N: Tensor, B: Tensor, out: Tensor | None = None) -> Tensor:
        """The updates of stacked inner results ``N`` and bases ``B`` (``stackable`` only),
        into ``out`` when given."""
        raise NotImplementedError("only a stackable projection batches its products")

    @staticmethod
    def project_each(Gs: list[Tensor], B: Tensor | list[Tensor]) -> Tensor:
        """R of each gradient of ``Gs`` and its basis in ``B`` (a stack, or the stored bases
        themselves: float32 ones for bf16 gradients are rounded as they are read), stacked
        in the gradients' dtype: one matmul per matrix into its entry of R (the gradients
        are read where they are, not stacked first; ``stackable`` only)."""
        raise NotImplementedError("only a stackable projection batches its products")

    @staticmethod
    def project_norms_each(
        Gs: list[Tensor], B: list[Tensor], c: float
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """:meth:`project_each` of the stored bases with Fira's channel norms (of the
        residuals ``G + c·(the part in the subspace)`` and of R): (R, those, R's)."""
        raise NotImplementedError("only a one-sided projection has channels")

    @staticmethod
    def factors_stack(N: Tensor, B: Tensor | list[Tensor]) -> tuple[Any, Any]:
        """The stacked factors (A, B) of the updates A·B of stacked inner results ``N`` and
        bases ``B`` (a stack or a list of them; ``stackable`` only; :meth:`back`'s factors,
        a stack or list of them)."""
        raise NotImplementedError("only a stackable projection batches its products")

    def basis(self, state: State) -> Tensor | None:
        """The basis on the projected side (dense): P (left) or Q (right)."""
        P, Q = self.projector.bases(state, self.plan)
        return P if self.left else Q

    # ---- refresh -----------------------------------------------------------------
    def rotation(self, old: Bases, new: Bases) -> Rotation:
        """Change of coordinates for moments when the bases (P, Q) move from ``old`` to
        ``new``: M ← C·M·D with C = P_newᵀ·P_old, D = Q_oldᵀ·Q_new (C∘C, D∘D for second
        moments, which stay non-negative)."""
        C = D = None
        if self.left:  # P is row-sharded: the r×r product is a sum over ranks
            C = self.plan.placement.reduce(new[0].float().mT @ old[0].float())  # type: ignore[union-attr]
        if self.right:
            D = old[1].float().mT @ new[1].float()  # type: ignore[union-attr]

        def rotate(t: Tensor, squared: bool) -> Tensor:
            x = t.float()
            if C is not None:
                x = (C * C if squared else C) @ x
            if D is not None:
                x = x @ (D * D if squared else D)
            return x

        return rotate

    # ---- collectives (on paper, for galore2.traffic) -------------------------------
    def step_collectives(self, grad: torch.dtype, inner: torch.dtype) -> list[Collective]:
        """What :meth:`project` and :meth:`back` issue every step on row-sharded G (gradient
        dtype ``grad``, the inner result's ``inner``)."""
        return []

    def refresh_collectives(self, group: dict, world: int, first: bool) -> list[Collective]:
        """What a refresh issues on a shard group of ``world`` ranks: the projector's, then
        the moment rotation's (``moments_on_refresh="project"``, not at the first one)."""
        out = self.projector.refresh_collectives(self.plan, group, world, first)
        if not first and group["moments_on_refresh"] == "project":
            out += self.rotation_collectives()
        return out

    def rotation_collectives(self) -> list[Collective]:
        """What :meth:`rotation` issues: C = P_newᵀ·P_old is a sum over ranks."""
        if not self.left:
            return []
        r = self.plan.rank
        return [
            Collective("all_reduce", (r, r), torch.float32, "Projection.rotation: C = P_newᵀ·P_old")
        ]


def entries(B: Tensor | list[Tensor]) -> list[Tensor]:
    """The matrices of a stack (its entries, views) or of a list (as they are)."""
    return list(B.unbind(0)) if isinstance(B, Tensor) else B


class LeftProjection(Projection):
    """R = PᵀG (r×n), a sum over the ranks' rows, reduce-scattered to column shards;
    update P·N after an all-gather of N."""

    side = LEFT
    layout = "cols"
    stackable = True
    left = True
    basis_key = "proj.left"

    def reduce(self, R: Tensor) -> Tensor:
        """Column shard r × n/p of the sum of the ranks' PᵢᵀGᵢ."""
        plan = self.plan
        R = plan.placement.reduce_scatter_cols(R)
        return R

    def gather(self, N: Tensor) -> Tensor:
        """Every rank needs all of N for its rows P_i·N."""
        return self.plan.placement.all_gather_cols(N, self.plan.n)

    def full(self, N: Tensor, R: Tensor) -> tuple[Tensor, Tensor]:
        """Column shards of N and R: one all-gather brings both (fp32)."""
        r = N.shape[0]
        both = self.plan.placement.all_gather_cols(torch.cat([N.float(), R.float()]), self.plan.n)
        return both[:r], both[r:]

    @staticmethod
    def project_stack(G: Tensor, B: Tensor) -> Tensor:
        """PᵀG of stacked gradients and bases (one ``bmm``)."""
        return torch.bmm(B.mT, G)

    @staticmethod
    def back_stack(N: Tensor, B: Tensor, out: Tensor | None = None) -> Tensor:
        """P·N of stacked bases and inner results (one ``bmm``, into ``out`` if given)."""
        return torch.bmm(B, N, out=out)

    @staticmethod
    def project_each(Gs: list[Tensor], B: Tensor | list[Tensor]) -> Tensor:
        """PᵀG of each gradient into its entry of one r × n stack (one grouped launch where
        :mod:`galore2.kernels.ops_lowrank` runs Triton, else one ``mm`` each)."""
        Ps = entries(B)
        R = Gs[0].new_empty((len(Gs), Ps[0].shape[1], Gs[0].shape[1]))
        mm_each_([P.mT for P in Ps], Gs, list(R.unbind(0)))
        return R

    @staticmethod
    def project_norms_each(
        Gs: list[Tensor], B: list[Tensor], c: float
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """:meth:`project_each` with Fira's norms of each column: (R, of G + c·P·R, of R),
        the norms k × 1 × n in float32 (one grouped launch where
        :mod:`galore2.kernels.ops_scaled` runs Triton: each gradient read once)."""
        R = Gs[0].new_empty((len(Gs), B[0].shape[1], Gs[0].shape[1]))
        return R, *project_norms_each(Gs, B, list(R.unbind(0)), c, 0)

    @staticmethod
    def factors_stack(N: Tensor, B: Tensor | list[Tensor]) -> tuple[Any, Any]:
        """(P, N): the update P·N."""
        return B, N

    def step_collectives(self, grad: torch.dtype, inner: torch.dtype) -> list[Collective]:
        """Reduce-scatter of R = PᵀG (r×n, ``grad``), all-gather of N (r×n, ``inner``: it is
        cast to the parameter's dtype only after the gather)."""
        shape = (self.plan.rank, self.plan.n)
        return [
            Collective("reduce_scatter", shape, grad, "LeftProjection.project: R = PᵀG"),
            Collective("all_gather", shape, inner, "LeftProjection.back: N (Adam direction)"),
        ]


class RightProjection(Projection):
    """R = G·Q (m×r), row-local like G; update N·Qᵀ. No collective per step."""

    side = RIGHT
    layout = "rows"
    stackable = True
    right = True
    basis_key = "proj.right"

    @staticmethod
    def project_stack(G: Tensor, B: Tensor) -> Tensor:
        """G·Q of stacked gradients and bases (one ``bmm``)."""
        return torch.bmm(G, B)

    @staticmethod
    def back_stack(N: Tensor, B: Tensor, out: Tensor | None = None) -> Tensor:
        """N·Qᵀ of stacked inner results and bases (one ``bmm``, into ``out`` if given)."""
        return torch.bmm(N, B.mT, out=out)

    @staticmethod
    def project_each(Gs: list[Tensor], B: Tensor | list[Tensor]) -> Tensor:
        """G·Q of each gradient into its entry of one m × r stack (grouped as the left's)."""
        Qs = entries(B)
        R = Gs[0].new_empty((len(Gs), Gs[0].shape[0], Qs[0].shape[1]))
        mm_each_(Gs, Qs, list(R.unbind(0)))
        return R

    @staticmethod
    def project_norms_each(
        Gs: list[Tensor], B: list[Tensor], c: float
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """:meth:`project_each` with Fira's norms of each row: (R, of G + c·R·Qᵀ, of R),
        the norms k × m × 1 in float32 (grouped as the left's)."""
        R = Gs[0].new_empty((len(Gs), Gs[0].shape[0], B[0].shape[1]))
        return R, *project_norms_each(Gs, B, list(R.unbind(0)), c, 1)

    @staticmethod
    def factors_stack(N: Tensor, B: Tensor | list[Tensor]) -> tuple[Any, Any]:
        """(N, Qᵀ): the update N·Qᵀ."""
        return N, (B.mT if isinstance(B, Tensor) else [Q.mT for Q in B])


class FullProjection(Projection):
    """Two-sided R = PᵀGQ (r×r), all-reduced (replicated); update (P·N)·Qᵀ."""

    side = FULL
    layout = "replicate"
    left = right = True

    def reduce(self, R: Tensor) -> Tensor:
        """Σ over the ranks' PᵢᵀGᵢQ."""
        return self.plan.placement.reduce(R)

    def step_collectives(self, grad: torch.dtype, inner: torch.dtype) -> list[Collective]:
        """All-reduce of R = PᵀGQ (r×r, ``grad``)."""
        r = self.plan.rank
        return [Collective("all_reduce", (r, r), grad, "FullProjection.project: R = PᵀGQ")]


class TuckerProjection(Projection):
    """A weight with more than two dims: per-mode factors (:class:`TuckerProjector`), the
    core R = G ×_k U_kᵀ all-reduced when mode 0 is reduced (each rank's rows give a partial
    sum), else row-sharded like the weight; a dense update N ×_k U_k."""

    side = TUCKER
    projector: TuckerProjector

    @property
    def layout(self) -> str:  # type: ignore[override]
        """Replicated when mode 0 is reduced, else row-sharded like the weight."""
        return self.projector.core_layout(self.plan)

    @property
    def low_shape(self) -> torch.Size:
        """The core r_0 × r_1 × … (r_k = min(rank, d_k))."""
        return self.projector.core_shape(self.plan)

    def matrix(self, u: Tensor) -> Tensor:
        """A Tucker weight keeps its N-d shape."""
        return u

    def reduce(self, R: Tensor) -> Tensor:
        """Σ over the ranks' cores when each is a partial sum (mode 0 reduced)."""
        if self.projector.core_is_partial(self.plan):
            R = self.plan.placement.reduce(R)
        return R

    def back(
        self, N: Tensor, state: State, dtype: torch.dtype, shape: torch.Size, factor: float
    ) -> Tensor:
        """The dense ``factor · N ×_k U_k`` (this rank's rows)."""
        return self.projector.project_back(N, state, self.plan, dtype).mul_(factor)

    def basis(self, state: State) -> Tensor | None:
        """Not one basis: a Tucker weight has a factor per mode.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError("a Tucker weight has one factor per mode (see bases)")

    def rotation(self, old: Bases, new: Bases) -> Rotation:
        """Per mode: core ×_k (U_k,newᵀ·U_k,old) (:meth:`TuckerProjector.rotation`)."""
        return TuckerProjector.rotation(old, new, self.plan)

    def step_collectives(self, grad: torch.dtype, inner: torch.dtype) -> list[Collective]:
        """All-reduce of the core (``grad``) when mode 0 is reduced."""
        if 0 not in self.projector.modes(self.plan):
            return []
        shape = tuple(self.low_shape)
        return [Collective("all_reduce", shape, grad, "TuckerProjection.project: core")]

    def rotation_collectives(self) -> list[Collective]:
        """The all-reduce of C_0 = U_0,newᵀ·U_0,old (U_0 is row-sharded)."""
        if 0 not in self.projector.modes(self.plan):
            return []
        r0 = self.projector.ranks(self.plan)[0]
        return [Collective("all_reduce", (r0, r0), torch.float32, "TuckerProjector.rotation: C_0")]


#: the projection class of each side
BY_SIDE: dict[int, type[Projection]] = {
    LEFT: LeftProjection,
    RIGHT: RightProjection,
    FULL: FullProjection,
    TUCKER: TuckerProjection,
}


def plan_for(state: State, group: dict, ctx: Context) -> Plan:
    """The :class:`~galore2.projectors.Plan` of a projected parameter (its side chosen at
    init, ``galore.side``): the one object that carries its geometry, basis storage and
    ``proj_precision`` to the projection, per tensor and per shape batch alike."""
    shape = ctx.global_shape
    n = 1
    for d in shape[1:]:
        n *= int(d)
    side, rank = int(state["galore.side"]), int(group["rank"])
    hadamard = bool(group.get("basis_hadamard", False))
    seed = state.get("galore.seed") if hadamard else None  # the Hadamard signs' seed
    return Plan(
        side, int(shape[0]), n, rank, ctx.param.device, ctx.placement,
        basis=group.get("basis_dtype", "fp32"),
        group_size=int(group.get("basis_group_size", 256)),
        hadamard=hadamard,
        basis_seed=0 if seed is None else int(seed),
        precision=PROJ_PRECISION.of(group),
    )  # fmt: skip


def projection_for(group: dict, plan: Plan, shape: tuple[int, ...] | torch.Size) -> Projection:
    """The projection of a parameter of global ``shape`` with ``plan`` in ``group``."""
    base = get_projector(group["projector"])
    if plan.side == TUCKER:
        return TuckerProjection(TuckerProjector(base, shape), plan)
    return BY_SIDE[plan.side](base, plan)


__all__ = [
    "BY_SIDE",
    "FullProjection",
    "LeftProjection",
    "Projection",
    "RightProjection",
    "TuckerProjection",
    "plan_for",
    "projection_for",
]
