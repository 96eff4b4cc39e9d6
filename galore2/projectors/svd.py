"""Exact projector: top-r singular vectors from a full ``torch.linalg.svd`` in fp32.

One SVD of G (m×n) gives both sides: P = U[:, :r], Q = Vᴴ[:r]ᵀ — the same
vectors, with the same signs, as galore-torch 1.0, which is what lets
``projector="svd", moments_on_refresh="keep"`` reproduce it.
Cost: O(m·n·min(m, n)) per refresh.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..placement import Collective
from .base import FULL, LEFT, RIGHT, Plan, Projector, State


class SVDProjector(Projector):
    """Exact projector: the top-r singular vectors of one fp32 ``torch.linalg.svd`` of G.

    The same vectors, with the same signs, as galore-torch 1.0. Under FSDP2, G is gathered
    onto an owner rank (balanced by SVD cost, :func:`galore2.fsdp.assign_owners`), whose
    bases are broadcast. Cost: O(m·n·min(m, n)) per refresh.
    """

    name = "svd"

    def find(
        self, G: Tensor, state: State, plan: Plan, group: dict, seed: int
    ) -> dict[str, Tensor]:
        """P = U[:, :r] and/or Q = V[:, :r] from the SVD of ``G`` (sharded: on its owner)."""
        side, rank = plan.side, plan.rank
        pl = plan.placement
        if not pl.distributed:
            return self._svd(G, side, rank)
        # Sharded G: gather it onto its owner rank (balanced by SVD cost, see
        # galore2.fsdp.assign_owners), whose SVD is broadcast; no rank repeats another's
        # work. GaLore.prepare batches this over a group so owners factor concurrently.
        owner = self.owner(state, plan)
        full = pl.gather_rows(G, owner)
        return self.distribute(self.compute(full, plan), owner, plan, G.device)

    def find_collectives(
        self, plan: Plan, group: dict, world: int, first: bool
    ) -> list[Collective]:
        """A gather of G's rows onto the owner (p·⌈m/p⌉ × n fp32, padded), then a broadcast
        of the owner's P (m×r) and / or Q (n×r)."""
        f32, chunk = torch.float32, -(-plan.m // world)
        out = [
            Collective(
                "gather", (world * chunk, plan.n), f32, "SVDProjector.find: G rows onto the owner"
            )
        ]
        if plan.side in (LEFT, FULL):
            out.append(
                Collective(
                    "broadcast", (plan.m, plan.rank), f32, "SVDProjector.find: P from the owner"
                )
            )
        if plan.side in (RIGHT, FULL):
            out.append(
                Collective(
                    "broadcast", (plan.n, plan.rank), f32, "SVDProjector.find: Q from the owner"
                )
            )
        return out

    @staticmethod
    def owner(state: State, plan: Plan) -> int:
        """The rank that factors this matrix: ``assign_owners``' choice, else from its seed."""
        owner = getattr(plan.placement, "owner", None)
        return int(state["galore.seed"]) % plan.placement.world if owner is None else owner

    def compute(self, full: Tensor | None, plan: Plan) -> dict[str, Tensor] | None:
        """The owner's SVD of the gathered G (NaN bases if it fails); None on other ranks."""
        if full is None:
            return None
        try:
            return self._svd(full, plan.side, plan.rank)
        except torch.linalg.LinAlgError:  # NaNs make every rank keep its basis together
            nan = float("nan")
            out = {}
            if plan.side in (LEFT, FULL):
                out["left"] = torch.full((plan.m, plan.rank), nan, device=full.device)
            if plan.side in (RIGHT, FULL):
                out["right"] = torch.full((plan.n, plan.rank), nan, device=full.device)
            return out

    @staticmethod
    def distribute(
        bases: dict[str, Tensor] | None, owner: int, plan: Plan, device: torch.device
    ) -> dict[str, Tensor]:
        """Broadcast the owner's bases; each rank keeps its rows of P and all of Q."""
        pl, out = plan.placement, {}
        for key, rows, wanted in (("left", plan.m, (LEFT, FULL)), ("right", plan.n, (RIGHT, FULL))):
            if plan.side in wanted:
                mine = None if bases is None else bases[key].contiguous()
                got = pl.broadcast(mine, owner, (rows, plan.rank), device)
                if key == "left":
                    start, stop = pl.row_range(plan.m)
                    got = got[start:stop]
                out[key] = got
        return out

    @staticmethod
    def _svd(G: Tensor, side: int, rank: int) -> dict[str, Tensor]:
        U, _, Vh = torch.linalg.svd(G, full_matrices=False)
        out: dict[str, Tensor] = {}
        if side in (LEFT, FULL):
            out["left"] = U[:, :rank]
        if side in (RIGHT, FULL):
            out["right"] = Vh[:rank].mT
        return out
