"""The projector protocol: side rule, basis storage, project / project back.

A projector owns three operations on a 2-D gradient ``G`` (m×n):

* ``refresh(G, state, side, rank, group)`` finds a new basis from ``G`` and
  returns it (a dict ``{"left": P, "right": Q}``, the sides in use) or ``None``
  when ``G`` is unusable (non-finite, all zero) or the result is not finite —
  the caller then keeps the previous basis; it never raises a linear-algebra
  error for bad input;
* ``project(G, state, side)`` → ``R`` (left: PᵀG, r×n; right: GQ, m×r;
  full: PᵀGQ, r×r);
* ``back_factors(N, state, plan, dtype)`` → ``(A, B)`` with the full-space update
  ``A·B`` = ``P·N`` / ``N·Qᵀ`` / ``(P·N)·Qᵀ``, never materialized here: the optimizer
  applies it in one fused ``addmm_`` (``project_back`` materializes it).

Bases are stored in the optimizer state as tensors whose dim 0 is the
projected dimension (``"proj.left"``: P, m×r; ``"proj.right"``: Q, n×r), so a
left basis shards on dim 0 exactly like its weight. Subclasses differ only in
how :meth:`find` computes a basis (exact / randomized / warm power / seeded
random) or, by overriding :meth:`init_state` / :meth:`bases` / :meth:`store`,
in how it is kept (e.g. regenerated from a seed). How a stored basis is encoded —
fp32, bf16, or int8 / int4 with an optional Hadamard rotation — is the plan's
``basis`` format (:mod:`galore2.storage.basis`); projectors read bases only
through :meth:`bases`, which returns them dense.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from .._numerics import all_finite
from ..core.options import Choice, Option
from ..placement import LOCAL, Collective, Placement
from ..storage.basis import KEY_SUFFIXES, basis_format, basis_zeros

State = dict[str, Tensor]

NONE, LEFT, RIGHT, FULL, TUCKER = 0, 1, 2, 3, 4
SIDE_NAMES = {NONE: "none", LEFT: "left", RIGHT: "right", FULL: "full", TUCKER: "tucker"}


#: ``proj_precision`` values: fp32 (TF32 off, whatever the global setting), tf32 (TF32
#: matmuls on CUDA; the same as fp32 elsewhere), bf16 (fp32 operands rounded to bf16,
#: the product returned in the gradient's dtype)
PRECISIONS = ("fp32", "tf32", "bf16")
#: read into each parameter's :class:`Plan` (``precision``), which both the per-tensor and
#: the batched projection read (:func:`projection_precision`)
PROJ_PRECISION = Option(
    "proj_precision",
    "fp32",
    Choice(PRECISIONS),
    "precision of the projection matmuls (PᵀG, GQ, Tucker cores): fp32, TF32 on CUDA, bf16",
)


class Plan(NamedTuple):
    """How one parameter is projected: side, its 2-D global shape (m, n), rank, device,
    and how its basis is stored (see :mod:`galore2.storage.basis`)."""

    side: int
    m: int
    n: int
    rank: int
    device: torch.device
    placement: Placement = LOCAL  # how G, P and Q are distributed (identity: one process)
    basis: str = "fp32"  # the group's basis_dtype: fp32 / bf16 / int8 / int4
    group_size: int = 256  # basis_group_size: quantization group (and Hadamard block)
    hadamard: bool = False  # basis_hadamard: rotate rows before quantizing
    basis_seed: int = 0  # the parameter's galore.seed: the Hadamard signs derive from it
    precision: str = PROJ_PRECISION.default  # the projection matmuls' (PROJ_PRECISION)


def choose_side(
    shape: tuple[int, ...] | torch.Size,
    proj_type: str,
    rank: int | None,
    tensor_projection: str = "matrix",
) -> int:
    """Decide the projection side from a weight's *global* shape.

    A matrix, or a weight with more than two dims under ``tensor_projection="matrix"``,
    is seen as m × n with m = shape[0], n = the product of the rest. ``std`` projects
    the smaller dimension: left (P, m×r) when m < n, right (Q, n×r) when m ≥ n — ties
    go right, as in galore-torch 1.0, so results match it. ``reverse_std`` does the
    opposite; ``left``/``right``/``full`` are forced. Returns ``NONE`` when there is
    nothing to gain (``rank`` unset or ``rank ≥ min(m, n)``): the parameter then gets
    the plain inner update.

    A weight with more than two dims under ``tensor_projection="tucker"`` (the
    optimizers' default) gets ``TUCKER`` — one factor per mode k of rank
    min(rank, d_k), see :mod:`galore2.projectors.tucker`; ``proj_type`` does not apply —
    or ``NONE`` when ``rank ≥`` every dim (no mode is reduced).
    """
    if rank is None or len(shape) < 2:
        return NONE
    if len(shape) > 2 and tensor_projection == "tucker":
        return TUCKER if any(rank < int(d) for d in shape) else NONE
    m, n = shape[0], _prod(shape[1:])
    if rank >= min(m, n):
        return NONE
    if proj_type == "std":
        return RIGHT if m >= n else LEFT
    if proj_type == "reverse_std":
        return LEFT if m >= n else RIGHT
    return {"left": LEFT, "right": RIGHT, "full": FULL}[proj_type]


def _prod(dims: Any) -> int:
    out = 1
    for d in dims:
        out *= int(d)
    return out


def usable_norm(G: Tensor, placement: Placement = LOCAL) -> float | None:
    """‖G‖_F of the whole (possibly sharded) G when it is usable for a refresh — finite
    and not all zero — else None. Every rank gets the same answer."""
    norm = float(torch.linalg.vector_norm(G))
    bad = norm != norm  # NaN somewhere
    if norm == math.inf:  # an inf, or finite values whose fp32 norm overflows
        bad = not bool(torch.isfinite(G).all())
        norm = 0.0 if bad else float(torch.linalg.vector_norm(G.double()))
    elif norm == 0.0 and bool(G.any()):  # tiny entries whose fp32 squares underflow
        norm = float(torch.linalg.vector_norm(G.double()))
    if placement.distributed:
        bad = placement.any([bad])[0]
        total = torch.tensor([0.0 if bad else norm * norm], dtype=torch.float64)
        norm = math.sqrt(float(placement.reduce(total)[0]))
    if bad or not math.isfinite(norm) or norm <= 0:
        return None
    return norm


#: what :func:`usable_norm` issues on a sharded G: an any-non-finite flag, then Σ‖G_i‖²
USABLE_NORM = (
    Collective("all_reduce", (1,), torch.int32, "usable_norm: any non-finite"),
    Collective("all_reduce", (1,), torch.float64, "usable_norm: Σ‖G_i‖²"),
)
#: what :meth:`Projector.checked` issues: one flag, the new basis is finite on every rank
BASIS_CHECK = Collective("all_reduce", (1,), torch.int32, "Projector.refresh: any non-finite basis")


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


@contextmanager
def tf32_matmuls(allow: bool) -> Iterator[None]:
    """CUDA's fp32 matmuls with TF32 allowed or not (torch's global flag) inside, put back
    after."""
    flags = torch.backends.cuda.matmul
    before = flags.allow_tf32
    flags.allow_tf32 = allow
    try:
        yield
    finally:
        flags.allow_tf32 = before


def projection_precision(G: Tensor, precision: str) -> tuple[torch.dtype, Any]:
    """The operand dtype and the context for a projection matmul of ``G`` at ``precision``
    (one of :data:`PRECISIONS`): bf16 rounds fp32 operands to bf16; fp32 and tf32 keep the
    operands and, on CUDA, switch TF32 off / on around the matmul when the global setting
    differs. A gradient already in a 16-bit dtype is projected in its own dtype.

    Raises:
        ValueError: an unknown ``precision``.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"proj_precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "bf16" and G.dtype == torch.float32:
        return torch.bfloat16, nullcontext()
    if G.device.type == "cuda" and G.dtype == torch.float32:
        allow = precision == "tf32"
        if torch.backends.cuda.matmul.allow_tf32 != allow:
            return G.dtype, tf32_matmuls(allow)
    return G.dtype, nullcontext()


def low_rank_shape(m: int, n: int, side: int, rank: int) -> tuple[int, int]:
    """The projected gradient's shape for an m×n matrix: r×n (left), m×r (right), r×r (full).

    Args:
        m: rows of the matrix.
        n: columns of the matrix.
        side: ``LEFT``, ``RIGHT`` or ``FULL`` (any other side is treated as ``FULL``).
        rank: the rank r.
    """
    if side == LEFT:
        return (rank, n)
    if side == RIGHT:
        return (m, rank)
    return (rank, rank)


def align_signs(new: Tensor, old: Tensor, placement: Placement = LOCAL) -> Tensor:
    """Flip columns of ``new`` so each has a non-negative inner product with ``old``'s.

    Keeps moment coordinates consistent across refreshes when the subspace
    barely moves (the sign of a singular vector is arbitrary). For row-sharded bases
    pass their placement (the inner products are summed over ranks).
    """
    dots = placement.reduce((new * old.to(new.dtype)).sum(dim=0))
    signs = torch.where(dots < 0, -1.0, 1.0).to(new.dtype)
    return new * signs


class Projector:
    """Base projector; subclasses implement :meth:`find`."""

    name: ClassVar[str] = "base"
    kinds: ClassVar[dict[str, str]] = {
        key + suffix: "basis"
        for key in ("proj.left", "proj.right")
        for suffix in ("", *KEY_SUFFIXES)
    }

    # ---- storage (delegated to the plan's basis format) ----------------------------
    def init_state(self, state: State, plan: Plan, group: dict) -> None:
        """Allocate the basis at its final shape (zeros until the first refresh)."""
        fmt = basis_format(plan.basis)
        if plan.side in (LEFT, FULL):  # P shards on dim 0 with its weight's rows
            fmt.allocate(state, "proj.left", (plan.m, plan.rank), "rows", basis_zeros(plan), plan)
        if plan.side in (RIGHT, FULL):  # Q is replicated
            fmt.allocate(
                state, "proj.right", (plan.n, plan.rank), "replicate", basis_zeros(plan), plan
            )

    def bases(self, state: State, plan: Plan) -> tuple[Tensor | None, Tensor | None]:
        """The current (P, Q) as dense fp32 tensors (dequantized if stored quantized);
        ``None`` for an unused side. Every read of a stored basis goes through here."""
        fmt = basis_format(plan.basis)
        return fmt.load(state, "proj.left", plan), fmt.load(state, "proj.right", plan)

    def store(self, state: State, new: dict[str, Tensor], plan: Plan | None = None) -> None:
        """Write new bases (``{"left": P, "right": Q}``) in the plan's format. Without a
        plan only a dense (fp32 / bf16) basis can be stored."""
        if plan is None:
            if "proj.left.q" in state or "proj.right.q" in state:
                raise ValueError("storing a quantized basis needs the parameter's Plan")
            plan_format = basis_format("fp32")
        else:
            plan_format = basis_format(plan.basis)
        for key, basis in new.items():
            plan_format.store(state, "proj." + key, basis, plan)

    # ---- refresh -----------------------------------------------------------------
    def refresh(
        self, G: Tensor, state: State, plan: Plan, group: dict, seed: int
    ) -> dict[str, Tensor] | None:
        """New bases from ``G``, or ``None`` when ``G`` is unusable (non-finite, all zero) or the
        result is not finite; the caller then keeps the previous basis.

        Never raises a linear-algebra error for bad input: ``G`` is checked and rescaled by
        :meth:`refresh_input`, :meth:`find` computes the bases, :meth:`checked` rejects
        non-finite ones.

        Args:
            G: this rank's rows of the m×n gradient.
            state: the parameter's optimizer state (holds the current basis).
            plan: how the parameter is projected.
            group: the parameter group (projector options).
            seed: the seed of this refresh's random draws.

        Returns:
            ``{"left": P, "right": Q}`` for the sides in use, or ``None``.
        """
        scaled = self.refresh_input(G, plan)
        if scaled is None:
            return None
        try:
            new = self.find(scaled, state, plan, group, seed)
        except torch.linalg.LinAlgError:
            return None
        return self.checked(new, plan)

    @staticmethod
    def refresh_input(G: Tensor, plan: Plan) -> Tensor | None:
        """G in fp32, rescaled if its norm is extreme; None when G is unusable (all ranks agree)."""
        G32 = G.float()
        norm = usable_norm(G32, plan.placement)
        if norm is None:
            return None
        # The basis does not depend on G's scale: normalizing an extreme G keeps Gram
        # matrices of huge (finite) gradients from overflowing.
        ordinary = 1e-15 < norm < 1e15  # no copy of G in the ordinary case
        return G32 if ordinary else (G32.double() / norm).float()

    @staticmethod
    def checked(new: dict[str, Tensor], plan: Plan) -> dict[str, Tensor] | None:
        """``new`` if every basis is finite (on every rank), else None."""
        ok = all(all_finite(b) for b in new.values())
        if plan.placement.distributed:  # a row-sharded basis: every rank must agree
            ok = not plan.placement.any([not ok])[0]
        return new if ok else None

    def find(
        self, G: Tensor, state: State, plan: Plan, group: dict, seed: int
    ) -> dict[str, Tensor]:
        """Compute new bases from a finite, nonzero fp32 ``G`` (``{"left": P, "right": Q}``)."""
        raise NotImplementedError

    def refresh_collectives(
        self, plan: Plan, group: dict, world: int, first: bool
    ) -> list[Collective]:
        """The collectives one :meth:`refresh` of a sharded G issues on a shard group of
        ``world`` ranks, in order (a usable G, the ordinary fp32 path): :func:`usable_norm`,
        :meth:`find_collectives`, the finite-basis check. ``first``: the weight's first
        refresh."""
        return [*USABLE_NORM, *self.find_collectives(plan, group, world, first), BASIS_CHECK]

    def find_collectives(
        self, plan: Plan, group: dict, world: int, first: bool
    ) -> list[Collective]:
        """The collectives :meth:`find` issues on a row-sharded G (none here)."""
        return []

    # ---- projection --------------------------------------------------------------
    def project(self, G: Tensor, state: State, plan: Plan) -> Tensor:
        """The projected gradient R: PᵀG (left, r×n), GQ (right, m×r) or PᵀGQ (full, r×r)."""
        P, Q = self.bases(state, plan)
        side = plan.side
        dtype, context = projection_precision(G, plan.precision)
        X = _as(G, dtype)
        with context:
            if side == LEFT:
                R = _as(P, dtype).mT @ X
            elif side == RIGHT:
                R = X @ _as(Q, dtype)
            else:
                R = _as(P, dtype).mT @ X @ _as(Q, dtype)
        return _as(R, G.dtype)

    def back_factors(
        self, N: Tensor, state: State, plan: Plan, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """Factors (A, B) of the full-space update A·B, in ``dtype``."""
        P, Q = self.bases(state, plan)
        N = _as(N, dtype)
        if plan.side == LEFT:
            return _as(P, dtype), N
        if plan.side == RIGHT:
            return N, _as(Q, dtype).mT
        return _as(P, dtype) @ N, _as(Q, dtype).mT

    def similarity(self, new: dict[str, Tensor], state: State, plan: Plan) -> float:
        """Overlap in [0, 1] of the ``new`` bases with the stored ones: ‖B_newᵀ·B_old‖²_F / r
        per side (1 = same subspace, r/dim for unrelated random ones), averaged over sides.
        Invariant to signs and to rotations within the subspace."""
        old = dict(zip(("left", "right"), self.bases(state, plan), strict=True))
        values = []
        for key, basis in new.items():
            product = basis.float().mT @ old[key].float()
            if key == "left":  # row-sharded P: the r×r product is a sum over ranks
                product = plan.placement.reduce(product)
            values.append(float(product.square().sum()) / basis.shape[1])
        return sum(values) / len(values)

    def project_back(self, N: Tensor, state: State, plan: Plan, dtype: torch.dtype) -> Tensor:
        """The full-space update A·B of :meth:`back_factors`, materialized."""
        A, B = self.back_factors(N, state, plan, dtype)
        return A @ B
