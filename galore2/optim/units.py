"""Per-unit statistics of a batch of tensors in a few kernels (the batched Ranger21 modules).

A *unit* is what :mod:`galore2.optim.gradient` reduces over: one output row of a ≥2-D
tensor, or the whole of a ≤1-D one (``rows=False``: the whole tensor, whatever its dims).
A batch's tensors are flattened into one buffer (one ``cat``), every unit's sum (or mean)
is one ``segment_reduce`` over that buffer, and a value per unit goes back to the elements
by one ``repeat_interleave`` and one ``torch._foreach_*`` kernel over same-shape views:
a handful of launches for the whole batch instead of a few per tensor.

Only local tensors are batched (:func:`batchable`): a sharded ≤1-D unit needs a
collective per parameter, which the per-tensor path does. Results equal the per-tensor
reductions up to float rounding (a different summation order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..core.transform import Context


def acc_dtype(t: Tensor) -> torch.dtype:
    """Accumulation dtype: float64 for float64 tensors, float32 otherwise."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Layout:
    """Where each tensor's units lie in the flat buffer of a batch."""

    numels: tuple[int, ...]  # elements per tensor
    shapes: tuple[torch.Size, ...]  # each tensor's shape
    unit_shapes: tuple[tuple[int, ...], ...]  # a per-unit value's shape per tensor
    units: tuple[int, ...]  # units per tensor
    lengths: Tensor  # elements per unit, on the tensors' device (int64)
    total: int  # elements of the batch
    repeated: dict[int, Tensor] = field(default_factory=dict, compare=False)  # lengths × k


_LAYOUTS: dict[tuple, Layout] = {}  # by (device, shapes, rows): built once per batch layout
_MAX_LAYOUTS = 64


def layout(tensors: Sequence[Tensor], rows: bool = True) -> Layout:
    """The units of ``tensors`` (non-empty, one device): rows of ≥2-D ones when ``rows``."""
    shapes = tuple(t.shape for t in tensors)
    key = (tensors[0].device, shapes, rows)
    found = _LAYOUTS.get(key)
    if found is not None:
        return found
    numels, unit_shapes, units, lengths = [], [], [], []
    for shape in shapes:
        n = shape.numel()
        numels.append(n)
        if rows and len(shape) >= 2:
            units.append(shape[0])
            unit_shapes.append((shape[0], *([1] * (len(shape) - 1))))
            lengths += [n // shape[0]] * shape[0]
        else:
            units.append(1)
            unit_shapes.append(())
            lengths.append(n)
    if len(_LAYOUTS) >= _MAX_LAYOUTS:
        _LAYOUTS.clear()
    found = _LAYOUTS[key] = Layout(
        tuple(numels),
        shapes,
        tuple(unit_shapes),
        tuple(units),
        torch.tensor(lengths, dtype=torch.int64, device=tensors[0].device),
        sum(numels),
    )
    return found


def batchable(tensors: Sequence[Tensor], ctxs: Sequence[Context]) -> tuple[list[int], list[int]]:
    """(indices batched together, indices left to the per-tensor path): local non-empty
    tensors on the first one's device with its accumulation dtype are batched; sharded or
    empty ones, and the others, are not."""
    first = next(
        (t for t, c in zip(tensors, ctxs, strict=True) if not c.placement.distributed), None
    )
    together: list[int] = []
    alone: list[int] = []
    for i, (t, ctx) in enumerate(zip(tensors, ctxs, strict=True)):
        fits = (
            first is not None
            and not ctx.placement.distributed
            and t.numel() > 0
            and t.device == first.device
            and acc_dtype(t) == acc_dtype(first)
        )
        (together if fits else alone).append(i)
    if len(together) == 1:  # alone: the per-tensor path is as cheap
        alone, together = sorted(alone + together), []
    return together, alone


def flat(tensors: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    """Every tensor's elements, one after the other, in ``dtype`` (a new buffer)."""
    out = torch.cat([t.reshape(-1) for t in tensors])
    return out if out.dtype == dtype else out.to(dtype)


def unit_reduce(values: Tensor, lay: Layout, reduce: str = "sum") -> Tensor:
    """``reduce`` ("sum" or "mean") of every unit of a flat buffer laid out as ``lay``
    (or of several such buffers concatenated: their lengths repeat)."""
    lengths = lay.lengths
    times = values.numel() // max(lay.total, 1)
    if times != 1:
        lengths = lay.repeated.get(times)
        if lengths is None:
            lengths = lay.repeated[times] = lay.lengths.repeat(times)
    return torch.segment_reduce(values, reduce, lengths=lengths, unsafe=True)


def unit_views(per_unit: Tensor, lay: Layout) -> list[Tensor]:
    """A flat per-unit vector as one view per tensor, shaped to broadcast against it."""
    return [
        v.view(shape) for v, shape in zip(per_unit.split(lay.units), lay.unit_shapes, strict=True)
    ]


def spread(per_unit: Tensor, lay: Layout) -> list[Tensor]:
    """Each unit's value repeated over its elements: one tensor per tensor of the batch, at
    its shape (views of one buffer; same shapes, so foreach kernels stay fused)."""
    full = torch.repeat_interleave(per_unit, lay.lengths, output_size=lay.total)
    return [v.view(shape) for v, shape in zip(full.split(lay.numels), lay.shapes, strict=True)]
