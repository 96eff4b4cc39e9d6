"""Per-unit statistics of a batch of tensors in a few kernels (the batched Ranger21 modules).

A *unit* is what :mod:`galore2.optim.gradient` reduces over: one output row of a ≥2-D
tensor, or the whole of a ≤1-D one. A batch's tensors are copied into one buffer (one
``cat``) ordered by unit width, so the units of one width form one (units × width) matrix:
a reduction per unit is one ``sum`` / ``vector_norm`` along its rows per distinct width
(two or three in a transformer: the model width, the MLP width), and a factor per unit is
applied by one broadcast multiply per width; one ``torch._foreach_copy_`` writes the
buffer back into the tensors (same shapes: a fused kernel on accelerators). A handful of
launches for the whole batch instead of a few per tensor, and only vectorized reductions.

Only local tensors are batched (:func:`batchable`): a sharded ≤1-D unit needs a
collective per parameter, which the per-tensor path does. Results equal the per-tensor
reductions up to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..core.transform import Context


def acc_dtype(t: Tensor) -> torch.dtype:
    """Accumulation dtype: float64 for float64 tensors, float32 otherwise."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Layout:
    """How a batch's tensors lie in a buffer ordered by unit width.

    ``order``: the tensors' indices in buffer order; ``widths``: per distinct width (in
    buffer order), ``(width, units, first tensor, end tensor)`` over ``order``; ``units``
    and ``numels``: per tensor in buffer order.
    """

    order: tuple[int, ...]
    shapes: tuple[torch.Size, ...]  # in buffer order
    numels: tuple[int, ...]
    units: tuple[int, ...]
    widths: tuple[tuple[int, int, int, int], ...]
    total: int
    cache: dict = field(default_factory=dict, compare=False, repr=False)  # see per_tensor

    def per_tensor(self, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(units per tensor as int64, 1/√N per tensor as ``dtype``) on ``device``, in
        buffer order: made once per layout, device and dtype."""
        found = self.cache.get((device, dtype))
        if found is None:
            n = torch.tensor(self.numels, dtype=torch.float64)
            found = self.cache[(device, dtype)] = (
                torch.tensor(self.units, dtype=torch.int64).to(device),
                n.rsqrt().to(device=device, dtype=dtype),
            )
        return found

    def tensor_reduce(self, per_unit: Tensor, reduce: str = "sum") -> Tensor:
        """Per tensor (buffer order), ``reduce`` ("sum", "mean") of its units' ``per_unit``."""
        lengths = self.per_tensor(per_unit.device, per_unit.dtype)[0]
        return torch.segment_reduce(per_unit, reduce, lengths=lengths, unsafe=True)

    def gather(self, lists: Sequence[Sequence[Tensor]], dtype: torch.dtype) -> Tensor:
        """One buffer of ``lists`` (each laid out like the batch), in ``dtype``: per width,
        the units of every list one after the other (``copies`` = ``len(lists)``)."""
        parts = []
        for _, _, lo, hi in self.widths:
            for ts in lists:
                parts += [ts[i].reshape(-1) for i in self.order[lo:hi]]
        if parts[0].dtype != dtype:
            return torch.cat(parts).to(dtype)
        # into a buffer made by empty: measured ~5x faster than torch.cat's own allocation
        # on the CPU, and no launch more on accelerators
        out = torch.empty(len(lists) * self.total, dtype=dtype, device=parts[0].device)
        return torch.cat(parts, out=out)

    def regions(self, buffer: Tensor, copies: int = 1) -> list[Tensor]:
        """Per width, the buffer's units as a (copies, units, width) view."""
        out, start = [], 0
        for width, units, _, _ in self.widths:
            size = copies * units * width
            out.append(buffer[start : start + size].view(copies, units, width))
            start += size
        return out

    def reduce(self, buffer: Tensor, fn: Callable[[Tensor], Tensor], copies: int = 1) -> Tensor:
        """``fn(region)`` (a reduction over the last dim) of every width: (copies, units)."""
        parts = [fn(region) for region in self.regions(buffer, copies)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def scale_(self, buffer: Tensor, per_unit: Tensor, copies: int = 1) -> None:
        """Multiply the first list's units in ``buffer`` by ``per_unit`` (one per unit)."""
        start = 0
        for region, (_, units, _, _) in zip(self.regions(buffer, copies), self.widths, strict=True):
            region[0].mul_(per_unit[start : start + units, None])
            start += units

    def views(self, buffer: Tensor, copies: int = 1) -> list[Tensor]:
        """The first list's tensors in ``buffer``, in buffer order, at their shapes."""
        out, start, i = [], 0, 0
        for width, units, lo, hi in self.widths:
            at = start
            for _ in range(lo, hi):
                out.append(buffer[at : at + self.numels[i]].view(self.shapes[i]))
                at += self.numels[i]
                i += 1
            start += copies * units * width
        return out

    def ordered(self, ts: Sequence[Tensor]) -> list[Tensor]:
        """``ts`` (laid out like the batch) in buffer order."""
        return [ts[i] for i in self.order]


_LAYOUTS: dict[tuple, Layout] = {}  # by (shapes, rows): built once per batch layout
_MAX_LAYOUTS = 64


def _unit(shape: torch.Size, rows: bool) -> tuple[int, int]:
    """(units, width) of a tensor of ``shape``."""
    if rows and len(shape) >= 2:
        return shape[0], shape.numel() // shape[0]
    return 1, shape.numel()


def layout(tensors: Sequence[Tensor], rows: bool = True) -> Layout:
    """The units of ``tensors`` (non-empty): rows of ≥2-D ones when ``rows``, else whole."""
    key = (tuple(t.shape for t in tensors), rows)
    found = _LAYOUTS.get(key)
    if found is not None:
        return found
    units = [_unit(t.shape, rows) for t in tensors]
    order = sorted(range(len(tensors)), key=lambda i: units[i][1])  # stable: by width
    widths: list[tuple[int, int, int, int]] = []
    for pos, i in enumerate(order):
        n, width = units[i]
        if widths and widths[-1][0] == width:
            w, total, lo, _ = widths[-1]
            widths[-1] = (w, total + n, lo, pos + 1)
        else:
            widths.append((width, n, pos, pos + 1))
    if len(_LAYOUTS) >= _MAX_LAYOUTS:
        _LAYOUTS.clear()
    found = _LAYOUTS[key] = Layout(
        order=tuple(order),
        shapes=tuple(tensors[i].shape for i in order),
        numels=tuple(tensors[i].numel() for i in order),
        units=tuple(units[i][0] for i in order),
        widths=tuple(widths),
        total=sum(t.numel() for t in tensors),
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
