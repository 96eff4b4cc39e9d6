"""Randomized-SVD projector (GaLore 2's default): a seeded sketch instead of a full SVD.

For each side in use, the basis spans the top-r range of G (left) or Gᵀ
(right), found by :func:`randomized_range` with ``oversample`` extra columns
and ``power_iters`` subspace iterations. The sketch is seeded from the group
seed, the parameter and the refresh count, so a resumed run redraws exactly the
same Ω. Columns are sign-aligned with the previous basis so ``keep``-mode
moments stay in consistent coordinates.
Cost: O(m·n·(r+p)·(2+2q)) per refresh.
"""

from __future__ import annotations

from torch import Tensor

from ._sketch import mix_seed, randomized_range
from .base import FULL, LEFT, RIGHT, Plan, Projector, State, align_signs


class RandomizedProjector(Projector):
    name = "randomized"

    def find(
        self, G: Tensor, state: State, plan: Plan, group: dict, seed: int
    ) -> dict[str, Tensor]:
        side, rank = plan.side, plan.rank
        out: dict[str, Tensor] = {}
        over, iters = group["oversample"], group["power_iters"]
        if side in (LEFT, FULL):
            out["left"] = randomized_range(G, rank, over, iters, mix_seed(seed, 1))
        if side in (RIGHT, FULL):
            out["right"] = randomized_range(G.mT, rank, over, iters, mix_seed(seed, 2))
        for key, basis in out.items():
            old = state.get("proj." + key)
            if old is not None:
                out[key] = align_signs(basis, old)
        return out
