"""FSDP2 / HSDP support: DTensor parameters, sharded state, collectives.

Everything that knows about DTensor or process groups lives in this package;
projectors and transforms see plain local tensors through a
:class:`~galore2.placement.Placement`. It is imported lazily, only when an
optimizer meets a DTensor parameter.
"""

from .placement import ShardedPlacement, placement_for

__all__ = ["ShardedPlacement", "placement_for"]
