"""Tucker projection (truncated HOSVD) for weights with more than two dims.

A weight of shape (d_0, …, d_{K-1}) gets one factor per mode, U_k (d_k × r_k) with
orthonormal columns and r_k = min(rank, d_k); a mode with r_k = d_k is left alone (no
factor, identity). The gradient's core ``R = G ×_0 U_0ᵀ ×_1 U_1ᵀ …`` (shape r_0 × r_1 …)
is what the inner chain sees, and its output N comes back as the dense
``N ×_0 U_0 ×_1 U_1 …``. A refresh computes every factor from the same gradient:
U_k spans the top-r_k left singular vectors of the mode-k unfolding of G, found by the
group's projector —

* mode 0: the *left* basis of G seen as d_0 × (d_1·d_2…) — the matrix GaLore uses for
  ``tensor_projection="matrix"``;
* mode k ≥ 1: the *right* basis of the unfolding whose columns are mode k and whose
  rows are every other index, dim 0 outermost (G moved to ``(d_0, …, d_K-1, d_k)`` and
  reshaped) — under FSDP2 its rows are sharded in blocks exactly like the weight's, so
  the randomized / power projectors' sharded-rows code (with its reductions) applies.

``projector="svd"`` takes exact SVDs of the unfoldings (sharded: G is gathered once onto
its owner rank, which factors every mode and broadcasts the factors), sign-aligned with
the previous factors; ``"randomized"`` / ``"power"`` run their sketches per mode (each
mode with its own seed); ``"random"`` draws seeded Gaussian factors (N(0, 1/r_k)
entries, regenerated from one stored seed, redrawn at each refresh: no gradient is
looked at, nothing but the seed is stored).

State: ``proj.mode{k}`` (d_k × r_k fp32) for each reduced mode k — mode 0's rows sharded
like the weight (layout ``"rows"``), the others replicated — or ``proj.seed`` for
``"random"``. Under FSDP2 the core is a sum over ranks of each rank's rows when mode 0
is reduced (all-reduced, moments replicated); when it is not (d_0 ≤ rank), the core
keeps the weight's dim 0 and is row-sharded like it, with no communication.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import ClassVar

import torch
from torch import Tensor

from .._numerics import mix_seed
from ..placement import LOCAL, Collective, Placement
from ..storage.basis import KEY_SUFFIXES, basis_format, basis_zeros
from ._sketch import orthonormalize_rows
from .base import (
    LEFT,
    RIGHT,
    USABLE_NORM,
    Plan,
    Projector,
    State,
    _as,
    align_signs,
    projection_precision,
    usable_norm,
)
from .random import RandomProjector, gaussian_basis
from .svd import SVDProjector

MAX_MODES = 64  # state keys proj.mode0 … proj.mode63 are known to state_bytes


def tucker_ranks(shape: Sequence[int], rank: int) -> tuple[int, ...]:
    """r_k = min(rank, d_k) per mode."""
    return tuple(min(int(rank), int(d)) for d in shape)


def reduced_modes(shape: Sequence[int], rank: int) -> tuple[int, ...]:
    """The modes that get a factor (rank < d_k); the others are left as they are."""
    return tuple(k for k, d in enumerate(shape) if int(rank) < int(d))


def contract(x: Tensor, U: Tensor, k: int) -> Tensor:
    """x ×_k Uᵀ for U of shape d_k × r: mode k of x (size d_k) becomes size r."""
    return torch.tensordot(x, U, dims=([k], [0])).movedim(-1, k)


def expand(x: Tensor, U: Tensor, k: int) -> Tensor:
    """x ×_k U for U of shape d × r: mode k of x (size r) becomes size d."""
    return torch.tensordot(x, U, dims=([k], [1])).movedim(-1, k)


def unfold(x: Tensor, k: int) -> Tensor:
    """Mode-k unfolding with mode k as the *columns*: rows run over every other index,
    dim 0 outermost (so for k ≥ 1 a dim-0 row shard of x is a block of rows of the
    result). Its top right singular vectors are the top left ones of the textbook
    unfolding X_(k)."""
    return x.movedim(k, -1).reshape(-1, x.shape[k])


class _UnfoldedRows(Placement):
    """The placement of a mode-k unfolding (k ≥ 1) of a dim-0-sharded tensor: each row of
    the weight is ``block`` consecutive rows of the unfolding. Only ``row_range`` differs
    from the weight's placement (the randomized sketches use it to pick this rank's rows
    of a seeded Ω); collectives go to the weight's placement."""

    def __init__(self, base: Placement, block: int) -> None:
        self.base, self.block = base, block
        self.world, self.rank = base.world, base.rank

    def row_range(self, m: int) -> tuple[int, int]:
        start, stop = self.base.row_range(m // self.block)
        return start * self.block, stop * self.block

    def reduce(self, t: Tensor) -> Tensor:
        return self.base.reduce(t)

    def any(self, flags: list[bool]) -> list[bool]:
        return self.base.any(flags)

    def any_global(self, flags: list[bool]) -> list[bool]:
        return self.base.any_global(flags)


class TuckerProjector(Projector):
    """Per-mode factors of one weight, found by the group's projector ``base``.

    Bound to the weight's *global* shape; ``plan`` (side ``TUCKER``) gives the rank,
    device and placement. Same protocol as :class:`Projector`: ``refresh`` returns the
    new factors (``{"mode0": U_0, …}``) or None (G unusable or a non-finite result:
    the caller keeps the old ones), ``store`` installs them, ``bases`` returns them
    (a tuple indexed by mode, None for an identity mode).
    """

    name = "tucker"
    kinds: ClassVar[dict[str, str]] = {
        f"proj.mode{k}{suffix}": "basis" for k in range(MAX_MODES) for suffix in ("", *KEY_SUFFIXES)
    }

    def __init__(self, base: Projector, shape: Sequence[int]) -> None:
        if len(shape) > MAX_MODES:
            raise ValueError(f"Tucker projection supports up to {MAX_MODES} dims, got {shape}")
        self.base = base
        self.shape = tuple(int(d) for d in shape)

    # ---- shapes ------------------------------------------------------------------
    def ranks(self, plan: Plan) -> tuple[int, ...]:
        """The rank r_k = min(rank, d_k) of every mode."""
        return tucker_ranks(self.shape, plan.rank)

    def modes(self, plan: Plan) -> tuple[int, ...]:
        """The modes that ``rank`` reduces (r_k < d_k); the others keep no factor."""
        return reduced_modes(self.shape, plan.rank)

    def core_shape(self, plan: Plan) -> torch.Size:
        """The shape r_0 × r_1 × … of the core the inner chain sees."""
        return torch.Size(self.ranks(plan))

    def core_is_partial(self, plan: Plan) -> bool:
        """True when each rank's core is a partial sum (mode 0 reduced and G row-sharded)."""
        return plan.placement.distributed and 0 in self.modes(plan)

    def core_layout(self, plan: Plan) -> str:
        """How the core (and the inner chain's state) is laid out under FSDP2."""
        return "replicate" if 0 in self.modes(plan) else "rows"

    def _order(self, plan: Plan) -> list[int]:
        """Modes in the order they are contracted: the largest reduction first."""
        ranks = self.ranks(plan)
        return sorted(self.modes(plan), key=lambda k: (ranks[k] / self.shape[k], k))

    @property
    def _random(self) -> bool:
        return isinstance(self.base, RandomProjector)

    # ---- storage (each factor in the plan's basis format, as a d_k × r_k basis) ----
    def _mode_plan(self, plan: Plan, k: int) -> Plan:
        return plan._replace(rank=self.ranks(plan)[k])

    def init_state(self, state: State, plan: Plan, group: dict) -> None:
        """Allocate a factor ``proj.mode{k}`` per reduced mode (or the seed of a random base)."""
        if self._random:
            state["proj.seed"] = torch.tensor(0, dtype=torch.int64)
            return
        fmt = basis_format(plan.basis)
        for k in self.modes(plan):  # U_0 shards on dim 0 with its weight's rows
            layout = "rows" if k == 0 else "replicate"
            mode = self._mode_plan(plan, k)
            shape = (self.shape[k], mode.rank)
            fmt.allocate(state, f"proj.mode{k}", shape, layout, basis_zeros(mode), mode)

    def bases(self, state: State, plan: Plan) -> tuple[Tensor | None, ...]:
        """The factors as dense fp32 tensors, indexed by mode (None: identity mode)."""
        out: list[Tensor | None] = [None] * len(self.shape)
        if self._random:
            seed, ranks = int(state["proj.seed"]), self.ranks(plan)
            for k in self.modes(plan):
                U = gaussian_basis(self.shape[k], ranks[k], mix_seed(seed, 3, k), plan.device)
                if k == 0:  # every rank draws all rows and keeps its own
                    start, stop = plan.placement.row_range(self.shape[0])
                    U = U[start:stop]
                out[k] = U
            return tuple(out)
        fmt = basis_format(plan.basis)
        for k in self.modes(plan):
            out[k] = fmt.load(state, f"proj.mode{k}", self._mode_plan(plan, k))
        return tuple(out)

    def store(self, state: State, new: dict[str, Tensor], plan: Plan | None = None) -> None:
        """Install new factors (``{"mode{k}": U_k}``) in the plan's basis format, or a new seed.

        Raises:
            ValueError: ``plan`` is ``None`` (factors are stored per mode through the plan).
        """
        if self._random:
            state["proj.seed"].copy_(new["seed"])
            return
        if plan is None:
            raise ValueError("storing Tucker factors needs the parameter's Plan")
        fmt = basis_format(plan.basis)
        for key, U in new.items():  # key: "mode{k}"
            fmt.store(state, "proj." + key, U, self._mode_plan(plan, int(key[4:])))

    # ---- refresh -----------------------------------------------------------------
    def refresh(
        self, G: Tensor, state: State, plan: Plan, group: dict, seed: int
    ) -> dict[str, Tensor] | None:
        """New factors from this rank's N-d gradient ``G`` (None: keep the old ones)."""
        flat = G.reshape(G.shape[0], -1)
        if self._random:
            if usable_norm(flat, plan.placement) is None:
                return None
            return {"seed": torch.tensor(seed, dtype=torch.int64)}
        scaled = self.refresh_input(flat, plan)
        if scaled is None:
            return None
        try:
            new = self.find(scaled.view(G.shape), state, plan, group, seed)
        except torch.linalg.LinAlgError:
            return None
        return self.checked(new, plan)

    def find(
        self, G: Tensor, state: State, plan: Plan, group: dict, seed: int
    ) -> dict[str, Tensor]:
        """Every reduced mode's factor from its unfolding of ``G``, found by the base projector."""
        old = self.bases(state, plan)
        if isinstance(self.base, SVDProjector):
            return self._exact(G, old, state, plan)
        out: dict[str, Tensor] = {}
        for k in self.modes(plan):
            sub_plan, Gk = self._mode_problem(G, k, plan)
            key = "left" if k == 0 else "right"
            sub_state = {  # mode k's problem as the base projector's state (dense fp32)
                "proj." + key: old[k],
                "galore.refreshes": state["galore.refreshes"],  # power: cold start or warm
                "galore.seed": state["galore.seed"],
            }
            found = self.base.find(Gk, sub_state, sub_plan, group, mix_seed(seed, 3, k))
            out[f"mode{k}"] = found[key]
        return out

    def refresh_collectives(
        self, plan: Plan, group: dict, world: int, first: bool
    ) -> list[Collective]:
        """As :meth:`Projector.refresh_collectives`; a random base: :func:`usable_norm` only."""
        if self._random:
            return list(USABLE_NORM)
        return super().refresh_collectives(plan, group, world, first)

    def find_collectives(
        self, plan: Plan, group: dict, world: int, first: bool
    ) -> list[Collective]:
        """``svd``: one gather of G's rows (p·⌈d_0/p⌉ × rest), a broadcast of each factor
        (d_k × r_k) and ``align_signs`` of U_0 (r_0); otherwise the base projector's per
        reduced mode, on the mode's matrix problem (:meth:`_mode_plan_of`)."""
        modes, ranks, f32 = self.modes(plan), self.ranks(plan), torch.float32
        if isinstance(self.base, SVDProjector):
            chunk = -(-self.shape[0] // world)
            source = "TuckerProjector._exact"
            out = [
                Collective(
                    "gather", (world * chunk, self._rest), f32, f"{source}: G rows onto the owner"
                )
            ]
            for k in modes:
                out.append(
                    Collective("broadcast", (self.shape[k], ranks[k]), f32, f"{source}: U_{k}")
                )
            if 0 in modes:
                out.append(Collective("all_reduce", (ranks[0],), f32, "align_signs (mode 0)"))
            return out
        return [
            replace(c, source=f"mode {k}: {c.source}")
            for k in modes
            for c in self.base.find_collectives(self._mode_plan_of(plan, k), group, world, first)
        ]

    @property
    def _rest(self) -> int:
        """d_1·d_2·…: the columns of G seen as d_0 × rest."""
        rest = 1
        for d in self.shape[1:]:
            rest *= d
        return rest

    def _mode_plan_of(self, plan: Plan, k: int) -> Plan:
        """Mode k's factor as an ordinary projector problem's plan: a left basis of
        d_0 × rest (k = 0) or a right basis of the mode-k unfolding (k ≥ 1)."""
        ranks, rest = self.ranks(plan), self._rest
        dense = {"basis": "fp32", "hadamard": False}  # sub-problems see dense bases
        if k == 0:  # left basis of G as d_0 × rest: rows sharded like the weight
            return plan._replace(side=LEFT, m=self.shape[0], n=rest, rank=ranks[0], **dense)
        block = rest // self.shape[k]
        pl = plan.placement
        return plan._replace(
            **dense,
            side=RIGHT,
            m=self.shape[0] * block,
            n=self.shape[k],
            rank=ranks[k],
            placement=_UnfoldedRows(pl, block) if pl.distributed else pl,
        )

    def _mode_problem(self, G: Tensor, k: int, plan: Plan) -> tuple[Plan, Tensor]:
        """Mode k's factor as an ordinary projector problem: (its plan, its matrix)."""
        matrix = G.reshape(G.shape[0], -1) if k == 0 else unfold(G, k)
        return self._mode_plan_of(plan, k), matrix

    def _exact(
        self, G: Tensor, old: tuple[Tensor | None, ...], state: State, plan: Plan
    ) -> dict[str, Tensor]:
        """Exact truncated HOSVD, sign-aligned with the stored factors."""
        pl, modes, ranks = plan.placement, self.modes(plan), self.ranks(plan)
        if not pl.distributed:
            found = self._svds(G, plan)
        else:  # gather G once onto its owner, which factors every mode and broadcasts
            owner = SVDProjector.owner(state, plan)
            full = pl.gather_rows(G.reshape(G.shape[0], -1), owner)
            computed = None
            if full is not None:
                try:
                    computed = self._svds(full.view(self.shape), plan)
                except torch.linalg.LinAlgError:  # NaNs make every rank keep its factors
                    computed = {
                        f"mode{k}": torch.full(
                            (self.shape[k], ranks[k]), float("nan"), device=full.device
                        )
                        for k in modes
                    }
            found = {}
            start, stop = pl.row_range(self.shape[0])
            for k in modes:
                key = f"mode{k}"
                mine = None if computed is None else computed[key].contiguous()
                got = pl.broadcast(mine, owner, (self.shape[k], ranks[k]), G.device)
                found[key] = got[start:stop] if k == 0 else got
        return {
            key: align_signs(U, old[int(key[4:])], pl if key == "mode0" else LOCAL)
            for key, U in found.items()
        }

    def _svds(self, G: Tensor, plan: Plan) -> dict[str, Tensor]:
        ranks = self.ranks(plan)
        out = {}
        for k in self.modes(plan):
            if k == 0:
                out["mode0"] = SVDProjector._svd(G.reshape(G.shape[0], -1), LEFT, ranks[0])["left"]
            else:
                out[f"mode{k}"] = SVDProjector._svd(unfold(G, k), RIGHT, ranks[k])["right"]
        return out

    # ---- projection --------------------------------------------------------------
    def project(self, G: Tensor, state: State, plan: Plan) -> Tensor:
        """This rank's core ``G ×_k U_kᵀ`` (a partial sum when :meth:`core_is_partial`)."""
        factors = self.bases(state, plan)
        dtype, context = projection_precision(G, plan.precision)
        x = _as(G, dtype)
        with context:
            for k in self._order(plan):
                x = contract(x, _as(factors[k], dtype), k)
        return _as(x, G.dtype).contiguous()

    def project_back(self, N: Tensor, state: State, plan: Plan, dtype: torch.dtype) -> Tensor:
        """The dense full-space ``N ×_k U_k`` (this rank's rows under FSDP2), in ``dtype``."""
        factors = self.bases(state, plan)
        x = _as(N, dtype)
        for k in reversed(self._order(plan)):
            x = expand(x, _as(factors[k], dtype), k)
        return x.contiguous()

    def back_factors(
        self, N: Tensor, state: State, plan: Plan, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """Not available: a Tucker update is not a product of two matrices.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError("a Tucker update is not a product of two matrices")

    # ---- moments -----------------------------------------------------------------
    @staticmethod
    def rotation(
        old: tuple[Tensor | None, ...], new: tuple[Tensor | None, ...], plan: Plan
    ) -> Callable[[Tensor, bool], Tensor]:
        """Moments into the new factors' coordinates (``old`` / ``new``: :meth:`bases`):
        core ×_k C_k with C_k = U_k,newᵀ·U_k,old for every factored mode k (C_k∘C_k for
        second moments, which stay non-negative)."""
        changes: dict[int, Tensor] = {}
        for k, (U_old, U_new) in enumerate(zip(old, new, strict=True)):
            if U_new is None or U_old is None:  # an identity mode
                continue
            C = U_new.float().mT @ U_old.float()
            changes[k] = plan.placement.reduce(C) if k == 0 else C  # U_0 is row-sharded

        def rotate(t: Tensor, squared: bool) -> Tensor:
            x = t.float()
            for k, C in changes.items():
                x = expand(x, C * C if squared else C, k)
            return x

        return rotate

    def similarity(self, new: dict[str, Tensor], state: State, plan: Plan) -> float:
        """Mean over reduced modes of ‖U_newᵀ·U_old‖²_F / r_k (1: every subspace unchanged)."""
        old = self.bases(state, plan)
        if self._random:
            stored = {"proj.seed": new["seed"]}
            fresh = self.bases(stored, plan)
        else:
            fresh = tuple(new.get(f"mode{k}") for k in range(len(self.shape)))
        values = []
        for k in self.modes(plan):
            U_new, U_old = fresh[k].float(), old[k].float()
            if self._random:  # Gaussian factors are not orthonormal: compare their spans
                pl = plan.placement if k == 0 else LOCAL
                U_new, U_old = orthonormalize_rows(U_new, pl), orthonormalize_rows(U_old, pl)
            product = U_new.mT @ U_old
            if k == 0:
                product = plan.placement.reduce(product)
            values.append(float(product.square().sum()) / fresh[k].shape[1])
        return sum(values) / len(values)


__all__ = [
    "MAX_MODES",
    "TuckerProjector",
    "contract",
    "expand",
    "reduced_modes",
    "tucker_ranks",
    "unfold",
]
