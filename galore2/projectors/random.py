"""Seeded random projection: no basis is stored, only a seed.

The basis is a Gaussian matrix with entries N(0, 1/r) (Johnson–Lindenstrauss
scaling, E[P·Pᵀ] = I on the full space, as in APOLLO), regenerated from the
stored seed whenever it is used and redrawn (new seed) at each refresh. The
gradient is never looked at, so a refresh costs nothing and the projector's
memory is one int64. It is not orthonormal: PᵀP ≈ (m/r)·I.
Cost per step: regenerating an m×r (or n×r) Gaussian (the batched path draws a shape
batch's into one stack, :meth:`RandomProjector.stacked`, and keeps small stacks between
refreshes: :mod:`galore2.optim.lowrank_batch`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from .._numerics import generator_for, mix_seed
from ..placement import LOCAL, Collective
from ._sketch import orthonormalize_rows
from .base import FULL, LEFT, RIGHT, USABLE_NORM, Plan, Projector, State, usable_norm


def gaussian_basis(rows: int, rank: int, seed: int, device: torch.device) -> Tensor:
    gen = generator_for(device, seed)
    return torch.randn(rows, rank, generator=gen, device=device).mul_(rank**-0.5)


class RandomProjector(Projector):
    """Seeded random projection (APOLLO's): only a seed is stored, the basis is regenerated.

    The basis has Gaussian entries N(0, 1/r), regenerated from the stored seed whenever it
    is used and redrawn (new seed) at each refresh; the gradient is never looked at, so a
    refresh costs nothing and the projector's memory is one int64. The basis is not
    orthonormal: PᵀP ≈ (m/r)·I.
    """

    name = "random"
    kinds: ClassVar[dict[str, str]] = {"proj.seed": "basis"}

    def init_state(self, state: State, plan: Plan, group: dict) -> None:
        """Store the seed (``proj.seed``), the only state of a random projection."""
        state["proj.seed"] = torch.tensor(0, dtype=torch.int64)

    def bases(self, state: State, plan: Plan) -> tuple[Tensor | None, Tensor | None]:
        """The Gaussian (P, Q) regenerated from the stored seed (this rank's rows of P)."""
        seed = int(state["proj.seed"])
        P = Q = None
        if plan.side in (LEFT, FULL):  # every rank draws all m rows and keeps its own
            start, stop = plan.placement.row_range(plan.m)
            P = gaussian_basis(plan.m, plan.rank, mix_seed(seed, 1), plan.device)[start:stop]
        if plan.side in (RIGHT, FULL):
            Q = gaussian_basis(plan.n, plan.rank, mix_seed(seed, 2), plan.device)
        return P, Q

    @staticmethod
    def stacked(seeds: list[int], left: bool, rows: int, rank: int, device: torch.device) -> Tensor:
        """The bases on one side (``left``: P, else Q) of same-shape local matrices whose
        ``proj.seed`` are ``seeds``, stacked (k × rows × rank): each one what :meth:`bases`
        regenerates, drawn into one buffer and scaled by one kernel (the batched path)."""
        out = torch.empty(len(seeds), rows, rank, device=device)
        gen = generator_for(device, 0)  # re-seeded per basis
        for k, seed in enumerate(seeds):
            gen.manual_seed(mix_seed(seed, 1 if left else 2))
            torch.randn(rows, rank, generator=gen, out=out[k])
        return out.mul_(rank**-0.5)

    def refresh(
        self, G: Tensor, state: State, plan: Plan, group: dict, seed: int
    ) -> dict[str, Tensor] | None:
        """A new seed (``{'seed': ...}``) if ``G`` is usable, else ``None``; G is not used."""
        if (
            usable_norm(G, plan.placement) is None
        ):  # same contract as every projector: keep the basis
            return None
        return {"seed": torch.tensor(seed, dtype=torch.int64)}

    def refresh_collectives(
        self, plan: Plan, group: dict, world: int, first: bool
    ) -> list[Collective]:
        """Only :func:`usable_norm`'s: the new basis is a seed, nothing to check."""
        return list(USABLE_NORM)

    def similarity(self, new: dict[str, Tensor], state: State, plan: Plan) -> float:
        """Overlap of the spans of the old and the newly drawn bases (≈ r/dim: independent
        draws), so adaptive refresh never lengthens a random projection's gap."""
        old = self.bases(state, plan)
        fresh = self.bases({"proj.seed": new["seed"]}, plan)
        values = []
        for i, (a, b) in enumerate(zip(fresh, old, strict=True)):
            if a is None or b is None:
                continue
            placement = plan.placement if i == 0 else LOCAL  # P is row-sharded, Q replicated
            a, b = (
                orthonormalize_rows(a.float(), placement),
                orthonormalize_rows(b.float(), placement),
            )
            product = a.mT @ b
            if i == 0:
                product = plan.placement.reduce(product)
            values.append(float(product.square().sum()) / plan.rank)
        return sum(values) / len(values)

    def store(self, state: State, new: dict[str, Tensor], plan: Plan | None = None) -> None:
        """Install the new seed."""
        state["proj.seed"].copy_(new["seed"])
