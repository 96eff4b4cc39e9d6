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
        pl = plan.placement
        if not pl.distributed:
            return self._svd(G, side, rank)
        # Sharded G: gather it onto its owner rank (balanced by SVD cost, see
        # galore2.fsdp.assign_owners), whose SVD is broadcast; no rank repeats another's
        # work. A failed SVD sends NaNs, so every rank keeps its old basis together.
        owner = getattr(pl, "owner", None)
        if owner is None:
            owner = int(state["galore.seed"]) % pl.world
        full = pl.gather_rows(G, owner)
        bases: dict[str, Tensor] = {}
        if full is not None:
            try:
                bases = self._svd(full, side, rank)
            except torch.linalg.LinAlgError:
                bases = {}
        out: dict[str, Tensor] = {}
        for key, rows, wanted in (("left", plan.m, (LEFT, FULL)), ("right", plan.n, (RIGHT, FULL))):
            if side in wanted:
                mine = bases.get(key)
                if full is not None and mine is None:
                    mine = torch.full((rows, rank), float("nan"), device=G.device)
                got = pl.broadcast(
                    None if full is None else mine.contiguous(), owner, (rows, rank), G.device
                )
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
