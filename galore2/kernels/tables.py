"""Device tables of addresses for multi-tensor launches, kept while their numbers hold.

A list kernel (one launch for many tensors: :mod:`galore2.kernels.adamw`'s AdamW list,
:mod:`galore2.kernels.lowrank_list`'s grouped matmuls) reads where each tensor is from an
int64 table on the device. The table is those numbers and nothing else, so it is kept by
them (:func:`kept`): the same tensors at the same addresses from step to step (new
gradients each step, mostly where the last ones were) reuse it; otherwise it is built again
by one host→device copy from pinned memory, queued on the stream without waiting for the
device (a copy from pageable memory may wait for the stream's work).

A CUDA graph being captured cannot record that copy (:func:`capturing`): the callers launch
per tensor there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

T = TypeVar("T")

#: tables kept (the most recent lists: a step's groups and shape batches)
KEPT = 16
_TABLES: dict[tuple, Any] = {}


def capturing(device: torch.device) -> bool:
    """Is a CUDA graph being captured on ``device``'s current stream?"""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def kept(key: tuple, device: torch.device, make: Callable[[], T]) -> T:
    """The table of ``key`` on ``device``: kept from an earlier call, else ``make()`` (which uploads
    it with :func:`upload`) and kept. ``key`` must determine the table (the addresses and sizes
    it is computed from): a step whose tensors are where they were computes nothing."""
    full = (device, *key)
    hit = _TABLES.get(full)
    if hit is not None:
        return hit
    made = make()
    if len(_TABLES) >= KEPT:
        _TABLES.pop(next(iter(_TABLES)))
    _TABLES[full] = made
    return made


def upload(
    values: Sequence[int] | np.ndarray, device: torch.device, dtype: torch.dtype = torch.int64
) -> Tensor:
    """``values`` as a ``dtype`` tensor on ``device``, copied from pinned memory on CUDA
    (queued, never a wait for the device; the host allocator keeps the buffer until the copy
    ran)."""
    host = torch.empty(len(values), dtype=dtype, pin_memory=device.type == "cuda")
    host.numpy()[:] = values
    return host.to(device, non_blocking=True)


def offsets(name: str, lists: Sequence[Sequence[Tensor]]) -> Tensor:
    """The table of a list kernel (``name``, for its errors and its key): each entry's
    element offset from its list's first entry, list by list, on the first tensor's device
    (int64). Kept (:func:`kept`) by the lists' count, element sizes and those byte offsets
    — the table's own values: the kernel adds them to the first entries' addresses, which
    it is handed at each launch — so lists laid out alike reuse it wherever they are (a
    step's new stacks of R and N, views at the same strides of a buffer allocated anew);
    entries placed otherwise, another number of lists or the same bytes read as another
    dtype get their own."""
    sizes = [ts[0].element_size() for ts in lists]
    deltas = []
    for ts in lists:
        base = ts[0].data_ptr()
        deltas += [a - base for a in map(Tensor.data_ptr, ts)]
    device = lists[0][0].device

    def make() -> Tensor:
        values, at = [], 0
        for ts, size in zip(lists, sizes, strict=True):
            for delta in deltas[at : at + len(ts)]:
                if delta % size:
                    raise ValueError(f"{name}: an entry is not aligned to its dtype's size")
                values.append(delta // size)
            at += len(ts)
        return upload(values, device)

    return kept((name, len(lists), *sizes, *deltas), device, make)


def clear() -> None:
    """Forget every kept table (tests)."""
    _TABLES.clear()


__all__ = ["KEPT", "capturing", "clear", "kept", "offsets", "upload"]
