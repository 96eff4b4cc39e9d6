"""FSDP2 / HSDP support: DTensor parameters, sharded state, collectives.

Everything that knows about DTensor or process groups lives in this package;
projectors and transforms see plain local tensors through a
:class:`~galore2.placement.Placement`. :func:`~galore2.fsdp.detect.is_dtensor` (the
one DTensor detector) is cheap and imports nothing; the placements
(:mod:`galore2.fsdp.placement`, which imports ``torch.distributed``) are imported
lazily, on first access to one of their names here — in practice only when an
optimizer meets a DTensor parameter. Checkpoint helpers are in
:mod:`galore2.checkpoint`, the collective-traffic model in :mod:`galore2.traffic`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .detect import is_dtensor

if TYPE_CHECKING:
    from .placement import ShardedPlacement, assign_owners, placement_for

_LAZY = ("ShardedPlacement", "assign_owners", "placement_for")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import placement

        return getattr(placement, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ShardedPlacement", "assign_owners", "is_dtensor", "placement_for"]
