"""What the step engine (:mod:`galore2.core.step`) gathers per group before the chain runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from .transform import Context

Group = dict[str, Any]
State = dict[str, Tensor]
#: (index over all groups, gradient, parameter) of a parameter to step
Item = tuple[int, Tensor, Tensor]
#: (group, local state, ctx) of a parameter stepped
Stepped = tuple[Group, State, Context]


@dataclass
class Batch:
    """A group's parameters of one step, gathered before the chain runs (see ``_gather``)."""

    group: Group  # the parameters' group (with the scheduled lr, if any)
    key: int = 0  # the group's id(): what caches of its lists are keyed by
    owners: list[Tensor] = field(default_factory=list)  # the parameters themselves
    params: list[Tensor] = field(default_factory=list)  # their local tensors
    states: list[State] = field(default_factory=list)
    ctxs: list[Context] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    flags: Tensor | None = None  # usable gradients, on the device (None: not checked)
    reused: bool = False  # the same parameters (at the same indices) as last step's batch
