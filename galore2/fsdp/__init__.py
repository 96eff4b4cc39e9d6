"""FSDP2 / HSDP support: DTensor parameters, sharded state, collectives.

Everything that knows about DTensor or process groups lives in this package;
projectors and transforms see plain local tensors through a
:class:`~galore2.placement.Placement`. It is imported lazily, only when an
optimizer meets a DTensor parameter. Checkpoint helpers are in
:mod:`galore2.checkpoint`, the collective-traffic model in :mod:`galore2.traffic`.
"""

from .placement import ShardedPlacement, assign_owners, placement_for

__all__ = ["ShardedPlacement", "assign_owners", "placement_for"]
