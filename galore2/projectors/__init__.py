"""Projectors: how a GaLore basis is found and stored. See :mod:`galore2.projectors.base`."""

from __future__ import annotations

from ..core.options import Choice, CrossCheck, Int, Option
from .base import (
    FULL,
    LEFT,
    NONE,
    PROJ_PRECISION,
    RIGHT,
    TUCKER,
    Plan,
    Projector,
    choose_side,
    low_rank_shape,
)
from .power import PowerProjector
from .random import RandomProjector
from .randomized import RandomizedProjector
from .svd import SVDProjector
from .tucker import TuckerProjector

_BY_NAME: dict[str, Projector] = {
    p.name: p for p in (SVDProjector(), RandomizedProjector(), PowerProjector(), RandomProjector())
}


#: accounting kind of every state key a projector may create (per-mode Tucker factors too)
KINDS: dict[str, str] = {
    **Projector.kinds,
    **{k: v for p in _BY_NAME.values() for k, v in type(p).kinds.items()},
    **TuckerProjector.kinds,
}

PROJECTOR = Option(
    "projector",
    "power",
    Choice(tuple(_BY_NAME)),
    "how a basis is found: exact SVD, randomized SVD, warm-started power iteration, random",
    resumable=False,
)
OVERSAMPLE = Option(
    "oversample", 8, Int(low=0), "extra sketch columns of randomized / power cold starts"
)
POWER_ITERS = Option(
    "power_iters",
    1,
    Int(low=0),
    "subspace iterations (randomized: after the sketch; power: per refresh, >= 1)",
)
OPTIONS = (PROJECTOR, OVERSAMPLE, POWER_ITERS, PROJ_PRECISION)


def validate_projector_options(group: dict) -> None:
    """Checks that involve the projector and another key (single-key checks ran already)."""
    iters, name = group["power_iters"], group["projector"]
    if name == "power" and iters < 1:
        raise ValueError(f"power_iters must be an int >= 1 for projector='power', got {iters!r}")
    if name == "random" and group.get("basis_dtype", "fp32") != "fp32":
        raise ValueError(
            f"basis_dtype={group['basis_dtype']!r} needs a stored basis; projector='random' "
            "regenerates its basis from a seed and stores none (use basis_dtype='fp32')"
        )


#: the projector's checks across keys (GaLore runs them; :class:`~galore2.core.options.CrossCheck`)
CHECKS = (CrossCheck(("power_iters", "projector", "basis_dtype"), validate_projector_options),)


def get_projector(name: str) -> Projector:
    """The projector for a group's ``projector`` key (validated earlier by the optimizer)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"projector must be one of {tuple(_BY_NAME)}, got {name!r}") from None


__all__ = [
    "CHECKS",
    "FULL",
    "KINDS",
    "LEFT",
    "NONE",
    "OPTIONS",
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
