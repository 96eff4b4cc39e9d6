"""Same-shape state tensors as one stack: a view when they already are, a pack when not.

A batched step works per stack of same-shape tensors (one op per stack, not per tensor): a
``(k, *shape)`` tensor whose entries *are* the tensors, so writing the stack writes them.
When ``k`` tensors lie at equally spaced offsets of one storage (contiguous, in order),
:func:`stacked_view` is that stack, made by one ``as_strided`` with no copy. When they
do not, :func:`pack` makes it so: it copies them into one new ``(k, *shape)`` buffer and
re-points each (``Tensor.set_``) at its entry, so each keeps its identity (the same object
in its state dict), its value, shape and strides — ``optimizer.state``, ``state_dict()``
and checkpoints see nothing new (``torch.save`` of a state dict writes a shared storage
once; of one such tensor alone, the whole buffer; DCP writes each tensor at its size).

A stack is valid while its tensors are still where it saw them: :func:`addresses` records
them, and the user of a stack compares them every step, since another owner (a refresh that
replaces a tensor, ``load_state_dict``, another stack) may re-point or replace one. Two
packers must not take turns re-packing the same tensors: :func:`as_stacks` views first and
packs only when it cannot; a snapshot of many tensors (:mod:`galore2.core.masked`) views
what is stacked already and packs only tensors that own their storage
(:func:`owns_storage`) or that it packed itself.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

#: Buffers a step made for itself and may overwrite once read (see :func:`scratch`).
_SCRATCH: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()


def stacked_view(ts: Sequence[Tensor]) -> Tensor | None:
    """The ``(k, *shape)`` view whose entries are ``ts`` (same shape, dtype and device,
    contiguous, equally spaced in one storage, in order), or None when they are not."""
    first = ts[0]
    if not first.is_contiguous():
        return None
    n, offset = first.numel(), first.storage_offset()
    gap = ts[1].storage_offset() - offset if len(ts) > 1 else n
    if gap < n or gap == 0:  # overlapping, out of order or empty: not a stack
        return None
    # checked list by list (C-level maps: this runs for every batch every step); an address
    # inside the first tensor's storage is in that storage
    k, size, shape = len(ts), first.element_size(), first.shape
    dtype, device = first.dtype, first.device
    if (offset + (k - 1) * gap + n) * size > first.untyped_storage().nbytes():
        return None
    start = first.data_ptr()
    if (
        list(map(Tensor.data_ptr, ts)) != list(range(start, start + k * gap * size, gap * size))
        or any(s != shape for s in map(_shape, ts))
        or any(d != dtype for d in map(_dtype, ts))
        or any(d != device for d in map(_device, ts))
        or not all(map(Tensor.is_contiguous, ts))
    ):
        return None
    return first.as_strided((k, *shape), (gap, *first.stride()), offset)


_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")
_device = operator.attrgetter("device")


def by_storage(ts: Sequence[Tensor], idx: Sequence[int]) -> dict[int, list[int]]:
    """The positions ``idx`` of ``ts`` by the storage each tensor is in (its address), each
    list in storage order: the runs :func:`stacked_view` may see as a stack."""
    runs: dict[int, list[int]] = {}
    for j in idx:
        runs.setdefault(ts[j].untyped_storage().data_ptr(), []).append(j)
    for same in runs.values():
        if len(same) > 1:
            same.sort(key=lambda j: ts[j].storage_offset())
    return runs


def owns_storage(t: Tensor) -> bool:
    """Is ``t`` the whole of its storage (nothing else can alias it through a view)?"""
    return (
        t.is_contiguous()
        and t.storage_offset() == 0
        and (t.untyped_storage().nbytes() == t.numel() * t.element_size())
    )


def pack(ts: Sequence[Tensor]) -> Tensor:
    """Re-point ``ts`` (same shape) at the entries of one new ``(k, *shape)`` buffer holding
    their values (see the module docstring) and return it."""
    return pack_many([ts])[0]


def pack_many(lists: Sequence[Sequence[Tensor]]) -> list[Tensor]:
    """:func:`pack` of each list of same-shape tensors, all in one new buffer (one list's
    stack after another: a snapshot sorting them by storage offset sees one stack where
    their shapes agree); the stacks."""
    sizes = [len(ts) * ts[0].numel() for ts in lists]
    buffer = torch.empty(sum(sizes), dtype=lists[0][0].dtype, device=lists[0][0].device)
    storage, out, start = buffer.untyped_storage(), [], 0
    for ts, size in zip(lists, sizes, strict=True):
        stacked = buffer[start : start + size].view(len(ts), *ts[0].shape)
        torch.stack(list(ts), out=stacked)
        n = ts[0].numel()
        for j, t in enumerate(ts):  # t keeps its identity, value, shape and strides
            t.set_(storage, start + j * n, t.shape, t.stride())
        out.append(stacked)
        start += size
    return out


def scratch(buffer: Tensor) -> Tensor:
    """Mark ``buffer`` as the step's own temporary (the masked gradient copies of a
    capturable step): a consumer that has read all of it may write its result there, as
    into a stack it made itself (:func:`writable`). Returns ``buffer``."""
    _SCRATCH[id(buffer)] = buffer
    return buffer


def writable(t: Tensor) -> bool:
    """May a consumer that made or was handed ``t`` overwrite it? Yes when ``t`` is not a
    view (a new stack), or is a view of a :func:`scratch` buffer; no for a view of anything
    else (the gradients themselves, when they form a stack already)."""
    base = t._base
    return base is None or _SCRATCH.get(id(base)) is base


def addresses(ts: Sequence[Tensor]) -> list[int]:
    """Where each of ``ts`` is now (compare a later call's answer to see a re-pointing)."""
    return list(map(Tensor.data_ptr, ts))


def as_stacks(lists: Sequence[Sequence[Tensor]]) -> list[Tensor] | None:
    """Each list of same-shape tensors as one stack: views when each list is one already,
    else all packed into one buffer (:func:`pack_many`; when each tensor is contiguous and
    of one dtype and device), else None. Packing moves a tensor off a storage it may share
    with others: only for state tensors whose sharing is a cache's (another stack), never
    an alias the state means."""
    views = [stacked_view(ts) for ts in lists]
    if all(v is not None for v in views):
        return views  # type: ignore[return-value]
    first = lists[0][0]
    if all(
        t.is_contiguous() and t.dtype == first.dtype and t.device == first.device
        for ts in lists
        for t in ts
    ):
        return pack_many(lists)
    return None
