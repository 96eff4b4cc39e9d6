"""Parameters stored in a quantized format: the apply stage's part (int8 weights).

A parameter whose weight lives elsewhere (a ``QuantizedLinear``'s shell, see
:mod:`galore2.storage.weights`) carries a store under :data:`STORE_ATTR`: an object with
``dequantize() → dense fp32 tensor`` and ``write(dense)``. The optimizer never sees the
format: for such a parameter a step works on a dense fp32 *working copy* — the chain, the
update ``p ← decay·p − lr·u``, the weight modules (norm loss, lookahead...) all act on it as
on any parameter — and, once the step's weight modules have run, the copy is handed back to
its store (:meth:`Writes.commit`), which re-quantizes it (stochastic rounding, seeded per
weight and write, so a resumed run is bit-identical). No update rule knows the format.

A parameter that is not stepped (its gradient was unusable: the non-finite policy left it
out) is not written: its codes stay exactly as they were. The masked path
(``capturable=True``) and FSDP2 (DTensor) parameters are refused with a clear error.
Working copies live for one step; ``optimizer.step()`` holds one per stepped parameter at
once, per-layer updates (``galore2.per_layer``) one at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, TypeVar

from torch import Tensor

Item = TypeVar("Item", bound=tuple)

#: the attribute of a parameter holding its store (galore2.storage.weights sets it)
STORE_ATTR = "_galore2_weight"


class WeightStore(Protocol):
    def dequantize(self) -> Tensor: ...
    def write(self, x: Tensor) -> None: ...
    def assign(self, x: Tensor) -> None: ...
    def nbytes(self) -> int: ...
    def tensors(self) -> tuple[Tensor, ...]: ...


def store_of(p: Tensor) -> WeightStore | None:
    """The store of a parameter kept in a quantized format, None for a plain one."""
    return getattr(p, STORE_ATTR, None)


def refuse(group: dict[str, Any], p: Tensor, distributed: bool) -> None:
    """A clear error for what quantized weights do not support (before anything changes)."""
    if group.get("capturable"):
        raise ValueError(
            f"a parameter of shape {tuple(p.shape)} has int8 weights "
            "(galore2.quantize_weights), which capturable=True does not support (the "
            "re-quantization is not masked); use capturable=False in its group"
        )
    if distributed:
        raise ValueError(
            "int8 weights (galore2.quantize_weights) are not supported under FSDP2 "
            "(fully_shard); train them on one device with per-layer updates "
            "(galore2.per_layer), or shard bf16 weights without quantize_weights"
        )


def parts(
    groups: Sequence[dict[str, Any]],
    items: list[list[Item]],
    weight_modules: Sequence[Any],
    distributed: Any,
) -> list[list[list[Item]]]:
    """``items`` (per group, (index, gradient, parameter) of a step) cut into the parts
    ``optimizer.step()`` runs one after the other, each a list per group: every plain
    parameter in the first part, then one part per int8 weight, so that one working copy
    is alive at a time. One part only when a weight module reads statistics over every
    parameter in some group (``needs_stats`` and ``uses_stats``). Every int8 weight's
    refusal (:func:`refuse`, with ``distributed(p)``) is raised first, before any part
    changes anything."""
    stored = [
        (g, k) for g, found in enumerate(items) for k, item in enumerate(found)
        if store_of(item[2]) is not None
    ]  # fmt: skip
    for g, k in stored:
        p = items[g][k][2]
        refuse(groups[g], p, distributed(p))
    whole = any(t.needs_stats and t.uses_stats(g) for t in weight_modules for g in groups)
    if whole or not stored:
        return [items]
    apart = set(stored)
    plain = [[it for k, it in enumerate(found) if (g, k) not in apart]
             for g, found in enumerate(items)]  # fmt: skip
    out = [plain] if any(plain) else []
    for g, k in stored:
        part: list[list[Item]] = [[] for _ in items]
        part[g].append(items[g][k])
        out.append(part)
    return out


class Writes:
    """The working copies of one step, by ``id()`` of the copy: made in the gather stage
    (:meth:`track`), handed back to their stores after the weight modules (:meth:`commit`)."""

    def __init__(self) -> None:
        self.pending: dict[int, tuple[WeightStore, Tensor]] = {}

    def track(self, copy: Tensor, store: WeightStore) -> None:
        self.pending[id(copy)] = (store, copy)

    def commit(self, stepped: Iterable[Tensor]) -> None:
        """Write back the copies of the parameters stepped; drop every other one."""
        if not self.pending:
            return
        try:
            for x in stepped:
                found = self.pending.get(id(x))
                if found is not None and found[1] is x:
                    found[0].write(x)
        finally:
            self.pending.clear()

    def drop(self) -> None:
        self.pending.clear()


__all__ = ["STORE_ATTR", "WeightStore", "Writes", "parts", "refuse", "store_of"]
