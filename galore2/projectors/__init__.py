"""Projectors: how a GaLore basis is found and stored. See :mod:`galore2.projectors.base`."""

from __future__ import annotations

from .base import FULL, LEFT, NONE, RIGHT, TUCKER, Plan, Projector, choose_side, low_rank_shape
from .power import PowerProjector
from .random import RandomProjector
from .randomized import RandomizedProjector
from .svd import SVDProjector
from .tucker import TuckerProjector

_BY_NAME: dict[str, Projector] = {
    p.name: p for p in (SVDProjector(), RandomizedProjector(), PowerProjector(), RandomProjector())
}


def get_projector(name: str) -> Projector:
    """The projector for a group's ``projector`` key (validated earlier by the optimizer)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"projector must be one of {tuple(_BY_NAME)}, got {name!r}") from None


__all__ = [
    "FULL",
    "LEFT",
    "NONE",
    "RIGHT",
    "TUCKER",
    "Plan",
    "PowerProjector",
    "Projector",
    "RandomProjector",
    "RandomizedProjector",
    "SVDProjector",
    "TuckerProjector",
    "choose_side",
    "get_projector",
    "low_rank_shape",
]
