"""Seeded random projection: no basis is stored, only a seed.

The basis is a Gaussian matrix with entries N(0, 1/r) (Johnson–Lindenstrauss
scaling, E[P·Pᵀ] = I on the full space, as in APOLLO), regenerated from the
stored seed whenever it is used and redrawn (new seed) at each refresh. The
gradient is never looked at, so a refresh costs nothing and the projector's
memory is one int64. It is not orthonormal: PᵀP ≈ (m/r)·I.
Cost per step: regenerating an m×r (or n×r) Gaussian.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from ._sketch import generator_for, mix_seed
from .base import FULL, LEFT, RIGHT, Plan, Projector, State, usable_norm


def gaussian_basis(rows: int, rank: int, seed: int, device: torch.device) -> Tensor:
    gen = generator_for(device, seed)
    return torch.randn(rows, rank, generator=gen, device=device).mul_(rank**-0.5)


class RandomProjector(Projector):
    name = "random"
    kinds: ClassVar[dict[str, str]] = {"proj.seed": "basis"}

    def init_state(self, state: State, plan: Plan, group: dict) -> None:
        state["proj.seed"] = torch.tensor(0, dtype=torch.int64)

    def bases(self, state: State, plan: Plan) -> tuple[Tensor | None, Tensor | None]:
        seed = int(state["proj.seed"])
        P = Q = None
        if plan.side in (LEFT, FULL):  # every rank draws all m rows and keeps its own
            start, stop = plan.placement.row_range(plan.m)
            P = gaussian_basis(plan.m, plan.rank, mix_seed(seed, 1), plan.device)[start:stop]
        if plan.side in (RIGHT, FULL):
            Q = gaussian_basis(plan.n, plan.rank, mix_seed(seed, 2), plan.device)
        return P, Q

    def refresh(
        self, G: Tensor, state: State, plan: Plan, group: dict, seed: int
    ) -> dict[str, Tensor] | None:
        if (
            usable_norm(G, plan.placement) is None
        ):  # same contract as every projector: keep the basis
            return None
        return {"seed": torch.tensor(seed, dtype=torch.int64)}

    def store(self, state: State, new: dict[str, Tensor]) -> None:
        state["proj.seed"].copy_(new["seed"])
