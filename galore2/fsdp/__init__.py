"""FSDP2 / HSDP support: DTensor parameters, sharded state, collectives.

Everything that knows about DTensor or process groups lives in this package;
projectors and transforms see plain local tensors through a
:class:`~galore2.placement.Placement`. It is imported lazily, only when an
optimizer meets a DTensor parameter.
"""

from .checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from .placement import ShardedPlacement, assign_owners, placement_for
from .traffic import Collective, Traffic, collective_bytes

__all__ = [
    "Collective",
    "ShardedPlacement",
    "Traffic",
    "assign_owners",
    "collective_bytes",
    "list_checkpoints",
    "load_checkpoint",
    "placement_for",
    "save_checkpoint",
]
