"""Host step counters of a batch, advanced by one op and read by one op.

Every module keeps its step counters as 0-d int64 CPU tensors, one per parameter (the
``torch.optim`` convention, and what checkpoints hold). Advancing those of a 200-tensor
batch with ``torch._foreach_add_`` is 200 dispatches on the host, and reading them with
``int()`` 200 more: on a launch-bound accelerator, that host time is the step.

:class:`Counters` packs them: the counters of a batch are re-pointed (``Tensor.set_``) at
the entries of one 1-D int64 tensor, so ``add_`` on it advances them all and ``tolist()``
reads them all. Each counter stays the same tensor object in its state dict, with the same
value: ``optimizer.state``, ``state_dict()``, checkpoints and shallow copies of a state dict
see nothing new. A pack is rebuilt when any of its counters was replaced (a
``load_state_dict``, a counter moved to another device) — checked by identity every call.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import Tensor

from . import packing
from .transform import State

_CPU = torch.device("cpu")
MAX_PACKS = 16  # per key: batches of a step (groups × devices) rarely number more


class _Pack:
    """One 1-D int64 tensor and the 0-d counters that are views of its entries."""

    __slots__ = ("addresses", "counters", "packed")

    def __init__(self, counters: list[Tensor]) -> None:
        self.packed = packing.pack(counters)  # each t a view of packed[i], keeping its value
        self.counters = counters
        self.addresses = list(map(Tensor.data_ptr, counters))

    def holds(self, states: Sequence[State], key: str) -> bool:
        """Are ``state[key]`` of ``states`` still its counters, in order (by identity), each
        still a view of this pack (no other pack — of another module, another batch — has
        re-pointed it since)?"""
        return (
            len(states) == len(self.counters)
            and all(map(operator.is_, map(operator.itemgetter(key), states), self.counters))
            and list(map(Tensor.data_ptr, self.counters)) == self.addresses
        )


class Counters:
    """Packs of one module's host counters, per batch of states (see the module docstring)."""

    def __init__(self) -> None:
        self._packs: dict[tuple[str, int, int], _Pack] = {}
        self._owner: dict[int, tuple[str, int, int]] = {}  # id(counter) → its pack's key

    def packed(
        self, states: Sequence[State], key: str, device: torch.device = _CPU
    ) -> Tensor | None:
        """The 1-D int64 tensor whose entries are ``state[key]`` of ``states`` in order
        (writes to it are writes to the counters), or None when one of them is not a 0-d
        int64 tensor on ``device`` (the CPU: host counters; a capturable step's device
        counters are packed on their device alike) or is shared by two states."""
        if not states:
            return None
        ident = (key, len(states), id(states[0][key]))
        pack = self._packs.get(ident)
        if pack is not None and pack.holds(states, key):
            return pack.packed
        counters = [s[key] for s in states]
        if len({id(t) for t in counters}) != len(counters) or not all(
            t.device == device and t.dtype == torch.int64 and t.dim() == 0 for t in counters
        ):
            return None
        if len(self._packs) >= MAX_PACKS:
            self._packs.clear()
            self._owner.clear()
        # a counter is a view of one pack only: packs it leaves are dropped (their other
        # counters are packed again when their batch comes back)
        for t in counters:
            self._packs.pop(self._owner.get(id(t)), None)  # type: ignore[arg-type]
        pack = self._packs[ident] = _Pack(counters)
        self._owner.update(dict.fromkeys(map(id, counters), ident))
        return pack.packed

    def advance(self, states: Sequence[State], key: str) -> list[int]:
        """Add one to ``state[key]`` of every state and return the new values: one ``add_``
        and one read for a packed batch (a ``_foreach_add_`` and a read each otherwise)."""
        packed = self.packed(states, key)
        if packed is not None:
            packed.add_(1)
            return packed.tolist()
        counters = [s[key] for s in states]
        torch._foreach_add_(counters, 1)
        return [int(t) for t in counters]

    def __getstate__(self) -> dict:  # packs are a cache: a pickled module carries none
        return {"_packs": {}, "_owner": {}}
