"""Exact projector: top-r singular vectors from a full ``torch.linalg.svd`` in fp32.

One SVD of G (m×n) gives both sides: P = U[:, :r], Q = Vᴴ[:r]ᵀ — the same
vectors, with the same signs, as galore-torch 1.0, which is what lets
``projector="svd", moments_on_refresh="keep"`` reproduce it.
Cost: O(m·n·min(m, n)) per refresh.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import FULL, LEFT, RIGHT, Plan, Projector, State


class SVDProjector(Projector):
    name = "svd"

    def find(
        self, G: Tensor, state: State, plan: Plan, group: dict, seed: int
    ) -> dict[str, Tensor]:
        side, rank = plan.side, plan.rank
        U, _, Vh = torch.linalg.svd(G, full_matrices=False)
        out: dict[str, Tensor] = {}
        if side in (LEFT, FULL):
            out["left"] = U[:, :rank]
        if side in (RIGHT, FULL):
            out["right"] = Vh[:rank].mT
        return out
