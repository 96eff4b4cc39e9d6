"""Randomized-SVD projector: a seeded sketch instead of a full SVD (and the power projector's
cold start).

For each side in use, the basis spans the top-r range of G (left) or Gᵀ
(right), found by :func:`left_basis` / :func:`right_basis` with ``oversample`` extra columns
and ``power_iters`` subspace iterations. The sketch is seeded from the group
seed, the parameter and the refresh count, so a resumed run redraws exactly the
same Ω. Columns are sign-aligned with the previous basis so ``keep``-mode
moments stay in consistent coordinates.
Cost: O(m·n·(r+p)·(2+2q)) per refresh.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._numerics import mix_seed
from ..placement import Collective
from ._sketch import gram_collectives, left_basis, right_basis
from .base import FULL, LEFT, RIGHT, Plan, Projector, State, align_signs


class RandomizedProjector(Projector):
    """Randomized-SVD projector: a seeded Gaussian sketch with ``oversample`` extra columns
    and ``power_iters`` subspace iterations instead of a full SVD.

    The sketch is seeded from the group seed, the parameter and the refresh count, so a
    resumed run redraws the same one; columns are sign-aligned with the previous basis.
    Cost: O(m·n·(r+p)·(2+2q)) per refresh.
    """

    name = "randomized"

    def find(
        self, G: Tensor, state: State, plan: Plan, group: dict, seed: int
    ) -> dict[str, Tensor]:
        """The top-r range of G (left) and/or Gᵀ (right) from a seeded sketch, sign-aligned."""
        side, rank = plan.side, plan.rank
        out: dict[str, Tensor] = {}
        over, iters, pl = group["oversample"], group["power_iters"], plan.placement
        old_P, old_Q = self.bases(state, plan)  # dense, whatever the storage format
        if side in (LEFT, FULL):
            P = left_basis(G, plan.m, rank, over, iters, mix_seed(seed, 1), pl)
            out["left"] = P if old_P is None else align_signs(P, old_P, pl)
        if side in (RIGHT, FULL):
            Q = right_basis(G, plan.m, rank, over, iters, mix_seed(seed, 2), pl)
            out["right"] = Q if old_Q is None else align_signs(Q, old_Q)
        return out

    def find_collectives(
        self, plan: Plan, group: dict, world: int, first: bool
    ) -> list[Collective]:
        """Sharded sketches, k = min(r + oversample, m, n), q = ``power_iters``: left —
        CholeskyQR2 of G·Ω, q × (Gᵀ·Y: n×k, CholeskyQR2), Yᵀ·G (k×n, when k > r),
        ``align_signs`` (r; against the zero basis at the first refresh too); right — Gᵀ·Ω
        (n×k), q × Gᵀ·(G·Y), CᵀC (k×k, when k > r): Q is replicated, so its
        orthonormalization and sign alignment are local."""
        m, n, r, f32 = plan.m, plan.n, plan.rank, torch.float32
        q, k = int(group["power_iters"]), min(r + int(group["oversample"]), m, n)
        out: list[Collective] = []
        if plan.side in (LEFT, FULL):
            out += gram_collectives(k, "left_basis: G·Ω")
            for _ in range(q):
                out.append(Collective("all_reduce", (n, k), f32, "left_basis: GᵀY"))
                out += gram_collectives(k, "left_basis: G·(GᵀY)")
            if k > r:
                out.append(Collective("all_reduce", (k, n), f32, "left_basis: B = YᵀG"))
            out.append(Collective("all_reduce", (r,), f32, "align_signs (left)"))
        if plan.side in (RIGHT, FULL):
            out.append(Collective("all_reduce", (n, k), f32, "right_basis: GᵀΩ"))
            out += [Collective("all_reduce", (n, k), f32, "right_basis: Gᵀ(GY)")] * q
            if k > r:
                out.append(Collective("all_reduce", (k, k), f32, "right_basis: CᵀC"))
        return out
