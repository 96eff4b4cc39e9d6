"""The masked (``capturable=True``) step's list work, a few kernels per shape, not per tensor.

A capturable step never reads its non-finite flags on the host (see
:mod:`galore2.core.nonfinite`): every parameter steps on its gradient with an unusable one
replaced by zeros, then the device state of those masked out is put back. Both are done
per bucket of same-shape tensors (a model has few shapes): the gradients of a bucket are
stacked into one ``(k, *shape)`` buffer and one ``masked_fill_`` with the bucket's
flags broadcast over each tensor (``(k, 1, …)``: no per-element mask; on the CPU a multiply
by the flags and a ``nan_to_num_``) zeroes the unusable ones (the chain sees views of the
buffer). The whole step is :class:`MaskedStep`; updates a rule masked already (GaLore's
back-projection of a masked low-rank stack: :func:`premasked`) are not masked again. The state of a group's local tensors is packed
once per bucket into such a buffer (its tensors become views of it, keeping identity and
values; tensors another owner stacked already are viewed as that stack instead: see
:mod:`~galore2.core.packing`), so a snapshot is one ``clone`` and a restore one ``where``
into the buffer. A
bucket's flags are picked from the group's by one ``index_select`` with an index made once.
No tensor is made from host data after the first step and nothing is read back, so the
step can be captured in a CUDA graph.

Memory: the gradients are copied once (the masked copy the chain sees, which GaLore's
back-projection then reuses), and the state once more for the duration of the step (the
snapshot) — not the state a rule masks itself, given each direction's flag
(:meth:`~galore2.core.transform.Transform.masked_keys`, ``Context.mask``: Adam's float32
moments, which are most of it); packing copies it once when a group's
state is first seen (or replaced: a refresh that reallocates moments, a resume).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from . import packing

State = dict[str, Tensor]


def _buckets(tensors: Sequence[Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` by (device, dtype, shape), in order."""
    by: dict[tuple[torch.device, torch.dtype, torch.Size], list[int]] = {}
    for i, t in enumerate(tensors):
        by.setdefault((t.device, t.dtype, t.shape), []).append(i)
    return list(by.values())


class _Flags:
    """A bucket's flags, picked from the group's and shaped ``(k, 1, …)`` to broadcast over
    its stacked tensors: a view when the bucket is every parameter in order, else one
    ``index_select`` by an index tensor made once on the device (and reused for the same
    flags tensor: the gradients' bucket and its updates' stack pick them once a step)."""

    def __init__(self, owners: Sequence[int], flags: int, ndim: int, device: torch.device):
        every = list(owners) == list(range(flags))
        self.index = None if every else torch.tensor(list(owners)).to(device)
        self.shape = (len(owners),) + (1,) * ndim
        self.last: tuple[Tensor, int, Tensor] | None = None

    def __call__(self, flags: Tensor) -> Tensor:
        # the same flags, unwritten since (a buffer rewritten in place bumps its version)
        if self.last is not None and self.last[0] is flags and self.last[1] == flags._version:
            return self.last[2]
        picked = flags if self.index is None else flags.index_select(0, self.index)
        self.last = (flags, flags._version, picked.view(self.shape))
        return self.last[2]


_FLAGS: dict[tuple, _Flags] = {}


def _flags_for(owners: Sequence[int], flags: int, ndim: int, device: torch.device) -> _Flags:
    """The cached :class:`_Flags` of a bucket (made on the first sight of it: a captured
    step finds it made)."""
    key = (str(device), flags, ndim, tuple(owners))
    found = _FLAGS.get(key)
    if found is None:
        if len(_FLAGS) >= 256:  # bounded: a few groups × shapes, changing rarely
            _FLAGS.clear()
        found = _FLAGS[key] = _Flags(owners, flags, ndim, device)
    return found


class FlagBuffer:
    """A batch's usable flags as 1.0 / 0.0 in one float32 device buffer, rewritten each
    masked step by one copy, and its 0-d entries made once: what each direction's
    ``Context.mask`` is during the chain (no per-direction op per step; the same tensors
    every step, as a captured graph wants). ``bad``: the step's unusable flags (bool);
    ``buckets``: the gradients' (:func:`masked_grads`), kept while the batch's parameters
    are last step's."""

    __slots__ = ("bad", "buckets", "buffer", "entries")

    def __init__(self, n: int, device: torch.device) -> None:
        self.buffer = torch.empty(n, dtype=torch.float32, device=device)
        self.entries = self.buffer.unbind()
        self.bad = torch.zeros(n, dtype=torch.bool, device=device)
        self.buckets: list[list[int]] | None = None

    def fits(self, ok: Tensor) -> bool:
        return ok.shape == self.buffer.shape and ok.device == self.buffer.device

    def write(self, ok: Tensor, bad: Tensor, same: bool) -> Tensor:
        """The buffer, holding ``ok`` (bool) as 1.0 / 0.0; ``bad`` (its negation) kept;
        ``same``: the batch's parameters are last step's (else the buckets are redone)."""
        self.bad = bad
        if not same:
            self.buckets = None
        return self.buffer.copy_(ok)


class MaskedStep:
    """One batch's masked step (``capturable=True``), a context manager around its chain
    and updates: entering saves the snapshot (but the buckets of ``skip``: this step's
    masked keys) and gives each direction its flag (``Context.mask``); a clean exit puts
    the masked parameters' state back and keeps the flags for the weight modules (cleared
    by :meth:`unmask`); every exit clears the :func:`premasked` marks. ``grads``: the
    masked gradients the chain steps on;
    ``decays``: each parameter's decay factor (0-d, exactly 1 where masked; None: no decay)."""

    __slots__ = ("counters", "ctxs", "decays", "flags", "grads", "skip", "snapshot")

    def __init__(
        self, flags: FlagBuffer, snapshot: Snapshot, skip: frozenset[str],
        grads: list[Tensor], decays: Sequence[Tensor] | None, ctxs: Sequence[Any],
        counters: CounterSnapshot | None = None,
    ) -> None:  # fmt: skip
        self.flags, self.snapshot, self.skip = flags, snapshot, skip
        self.grads, self.decays, self.ctxs = grads, decays, ctxs
        self.counters = counters  # the device step counters: put back where masked

    def decays_of(self, chunk: list[int]) -> list[Tensor] | None:
        """The decay factors of the parameters at ``chunk`` (None: no decay)."""
        return None if self.decays is None else [self.decays[i] for i in chunk]

    def __enter__(self) -> MaskedStep:
        self.snapshot.save(self.skip)
        if self.counters is not None:
            self.counters.save()
        for ctx, flag in zip(self.ctxs, self.flags.entries, strict=True):
            ctx.mask = flag
        premasked_clear()
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        premasked_clear()
        if kind is None:
            self.snapshot.restore(self.flags.bad)
            if self.counters is not None:
                self.counters.restore(self.flags.bad)
        else:
            self.unmask()

    def unmask(self) -> None:
        """Clear each direction's flag: after the weight modules (norm loss, stable weight
        decay), which leave a masked parameter's weights as they are by its flag (the
        optimizer calls it once they ran; :meth:`__exit__` on an exception)."""
        for ctx in self.ctxs:
            ctx.mask = None


def _zeroed(x: Tensor, pick: _Flags, flags: FlagBuffer, inplace: bool) -> Tensor:
    """``x`` (a ``(k, …)`` stack) with the entries ``pick`` flags as unusable all zeros, in
    place or as a new tensor; the usable entries (finite) keep their bits. On the CPU by a
    multiply by the 1.0 / 0.0 flags and a ``nan_to_num_`` (0·inf and 0·nan are nan): both
    vectorized, where ``masked_fill`` is a scalar loop there (~4x slower on a step's
    gradients); elsewhere one ``masked_fill`` (one pass over ``x``)."""
    if x.device.type == "cpu":
        ok = pick(flags.buffer)
        out = x.mul_(ok) if inplace else x.mul(ok)
        return out.nan_to_num_(0.0, 0.0, 0.0)
    return x.masked_fill_(pick(flags.bad), 0.0) if inplace else x.masked_fill(pick(flags.bad), 0.0)


def pick(flags: Tensor, at: Sequence[int]) -> Tensor:
    """``flags[at]`` by one ``index_select`` with a cached index tensor (made once per
    ``at``; the whole vector itself when ``at`` is every position in order)."""
    return _flags_for(at, flags.numel(), 0, flags.device)(flags)


def masked_grads(grads: list[Tensor], flags: FlagBuffer) -> list[Tensor]:
    """Copies of ``grads`` with those of parameters flagged unusable in ``flags`` (one per
    gradient) all zeros: per bucket of same-shape gradients, one ``stack`` and one
    masking (:func:`_zeroed`, plus an ``index_select`` of its flags); the copies are its views, and
    the buffer is the step's :func:`~galore2.core.packing.scratch` (GaLore back-projects
    into it, as into a stack of gradients it made: no second gradient-size buffer)."""
    out = list(grads)
    if flags.buckets is None:  # (device, dtype, shape) are the parameters': kept with them
        flags.buckets = _buckets(grads)
    for idx in flags.buckets:
        first = grads[idx[0]]
        stacked = packing.scratch(torch.stack([grads[i] for i in idx]))
        _zeroed(stacked, _flags_for(idx, len(grads), first.dim(), first.device), flags, True)
        for i, piece in zip(idx, stacked.unbind(), strict=True):
            out[i] = piece
    return out


#: Updates a rule masked already in the running masked step (see :func:`premasked`), by
#: ``id`` (held, so that no other tensor takes the id). Emptied by the step
#: (:func:`premasked_clear`).
_PREMASKED: dict[int, Tensor] = {}


def premasked(stack: Tensor) -> Tensor:
    """Mark ``stack`` (a ``(k, …)`` stack of updates made in a masked step) as zero already
    where its parameters are masked — GaLore's back-projection of a low-rank stack it masked
    (:func:`~galore2.optim.lowrank_batch.back`): its :func:`entries` are left as they are
    by :func:`masked_updates`. Returns ``stack``."""
    _PREMASKED[id(stack)] = stack
    return stack


def entries(stack: Tensor) -> tuple[Tensor, ...]:
    """``stack.unbind(0)``: the updates of its matrices, marked :func:`premasked` when it is."""
    pieces = stack.unbind(0)
    if id(stack) in _PREMASKED:
        _PREMASKED.update(zip(map(id, pieces), pieces, strict=True))
    return pieces


def premasked_clear() -> None:
    """Forget the updates marked :func:`premasked` (a masked step starts and ends with it)."""
    _PREMASKED.clear()


def masked_factor(factor: Tensor, mask: Tensor | None) -> Tensor:
    """``factor`` where ``mask`` (1.0 / 0.0, broadcast against it) is 1, exactly 1 where it
    is 0 (``factor`` finite): a weight module's multiplier that leaves a masked parameter's
    weights as they are; ``factor`` itself without a mask. Same bits where usable."""
    if mask is None:
        return factor
    mask = mask.to(factor.dtype)
    return torch.addcmul(torch.rsub(mask, 1), mask, factor)


def stacked_masks(masks: Sequence[Tensor | None]) -> Tensor | None:
    """The 0-d ``masks`` (contexts' flags) as one ``(k,)`` tensor, 1.0 for a None among
    masked ones; None when none is masked (not a masked step)."""
    first = next((m for m in masks if m is not None), None)
    if first is None:
        return None
    return torch.stack([m if m is not None else torch.ones_like(first) for m in masks])


def masked_updates(updates: list[Tensor], flags: FlagBuffer, positions: list[int]) -> list[Tensor]:
    """``updates[j]``, or zeros where parameter ``positions[j]`` is flagged unusable in
    ``flags`` (the batch's) — as they are when :func:`premasked` — : one masking
    (:func:`_zeroed`) per run of updates that are entries of one stack
    (GaLore's back-projection of a shape batch: its flags are those :func:`masked_grads`
    picked for the gradients' bucket), one foreach multiply by each parameter's 0-d
    1.0 / 0.0 (``flags.entries``) for the rest.
    A stack the step made (:func:`~galore2.core.packing.writable`) is masked in place; others
    are new tensors (an update may be a state tensor). Where usable, the same bits."""
    out: list[Tensor | None] = list(updates)
    todo = [j for j, u in enumerate(updates) if id(u) not in _PREMASKED]  # zero where masked
    if not todo:
        return out  # type: ignore[return-value]
    for j in todo:
        out[j] = None
    views: dict[torch.Size, list[int]] = {}
    for j in todo:
        u = updates[j]
        if u._base is not None:
            views.setdefault(u.shape, []).append(j)
    runs = [same for idx in views.values() for same in packing.by_storage(updates, idx).values()]
    for same in runs:
        if len(same) < 2:
            continue
        view = packing.stacked_view([updates[j] for j in same])
        if view is None:
            continue
        first = updates[same[0]]
        owners = [positions[j] for j in same]
        pick = _flags_for(owners, flags.buffer.numel(), first.dim(), first.device)
        # in place when the stack is the step's own (GaLore's back-projection), else a copy
        masked = _zeroed(view, pick, flags, packing.writable(view))
        for j, piece in zip(same, masked.unbind(), strict=True):
            out[j] = piece
    rest = [j for j in todo if out[j] is None]
    if rest:
        oks = flags.entries
        products = torch._foreach_mul([updates[j] for j in rest], [oks[positions[j]] for j in rest])
        for j, u in zip(rest, products, strict=True):
            out[j] = u
    return out  # type: ignore[return-value]


def usable_or_one(
    flags: Tensor, value: float, out: Tensor | None = None, dtype: torch.dtype | None = None
) -> Tensor:
    """``value`` where ``flags`` (1.0 / 0.0) is 1, exactly 1 where it is 0, in ``flags``'
    dtype (or ``dtype``: float64 for float64 weights): a factor that leaves a masked
    direction's tensor as it is (a decay, a moment's β₂). Where usable it is the dtype's
    rounding of ``value``, as a Python float's is."""
    if dtype is not None and dtype != flags.dtype:
        flags = flags.to(dtype)
    return torch.add(torch.rsub(flags, 1), flags, alpha=value, out=out)


#: derive's results kept per (name, masks): the masks, (base, result buffer) pairs, the views
_DERIVED: dict[
    tuple[str, int, int], tuple[list[Tensor], list[tuple[Tensor, Tensor]], list[Tensor]]
] = {}


def derive(
    masks: Sequence[Tensor], fn: Callable[..., Tensor], name: str | None = None
) -> list[Tensor]:
    """``fn`` (elementwise) of each of ``masks`` (the :attr:`~galore2.core.transform.Context.mask`
    of a batch's directions), computed once per contiguous tensor they are views of (the
    batch's flags; GaLore's stacked flags) and viewed per mask: a few kernels per batch,
    not per direction.

    With a ``name`` (what ``fn`` computes; ``fn`` then takes ``out=``), the results of
    several masks are kept for the same mask tensors (a batch's flag buffer entries, step after step): ``fn``
    rewrites each result buffer in place and the same views are returned (no view made per
    step; the list is shared: do not modify it)."""
    key = (name, len(masks), id(masks[0])) if name is not None and len(masks) > 1 else None
    if key is not None:
        found = _DERIVED.get(key)
        if found is not None and all(map(operator.is_, found[0], masks)):
            for base, result in found[1]:
                fn(base, out=result)
            return found[2]
    done: dict[int, tuple[Tensor, Tensor]] = {}
    out = []
    for m in masks:
        base = m if m._base is None else m._base
        if not base.is_contiguous():
            if key is not None:  # not kept: a view of no buffer
                key = None
            out.append(fn(m))
            continue
        found = done.get(id(base))
        if found is None:
            found = done[id(base)] = (base, fn(base).contiguous())
        src, result = found
        if m is src:
            out.append(result)
            continue
        offset = m.storage_offset() - src.storage_offset() + result.storage_offset()
        out.append(result.as_strided(m.shape, m.stride(), offset))
    if key is not None:
        if len(_DERIVED) >= 256:  # bounded: a few batches and rules, changing rarely
            _DERIVED.clear()
        _DERIVED[key] = (list(masks), list(done.values()), out)
    return out


class _Bucket:
    """Same-shape tensors of the snapshot (one device and dtype) and their flags;
    ``stacked``: the ``(k, *shape)`` tensor whose entries they are (a view of a stack they
    already form, or the buffer they were packed into), or None (saved by a ``stack``)."""

    __slots__ = ("addresses", "flags", "keys", "stacked", "tensors")

    def __init__(
        self, ts: list[Tensor], owners: list[int], flags: int, stacked: Tensor | None,
        keys: frozenset[str],
    ) -> None:  # fmt: skip
        self.tensors = ts
        self.keys = keys  # the state keys its tensors are under
        self.flags = _flags_for(owners, flags, ts[0].dim(), ts[0].device)
        self.stacked = stacked
        self.addresses = packing.addresses(ts)

    def packed(self) -> bool:
        """Are its tensors still where they were (nothing re-pointed one since)?"""
        return packing.addresses(self.tensors) == self.addresses

    def values(self) -> Tensor:
        """The current values, stacked (the stack itself when there is one, else a copy)."""
        return self.stacked if self.stacked is not None else torch.stack(self.tensors)


def _split(
    ts: list[Tensor], idx: list[int], pack: bool, ours: set[int], made: set[int]
) -> list[tuple[list[int], Tensor | None]]:
    """The positions ``idx`` of ``ts`` (one shape) as (positions, stack or None) parts: the
    tensors that share a storage and form a stack there (another owner packed them, see
    :mod:`~galore2.core.packing`; in storage order) viewed as it, those that own their
    storage or sit in a storage of ``ours`` (a previous snapshot's) packed together (with
    ``pack``; their new buffer's storage goes into ``made``), the rest unstacked."""
    parts: list[tuple[list[int], Tensor | None]] = []
    loose: list[int] = []
    rest: list[int] = []
    for ptr, same in packing.by_storage(ts, idx).items():
        if ptr in ours:
            loose += same
            continue
        if len(same) == 1:
            (loose if packing.owns_storage(ts[same[0]]) else rest).append(same[0])
            continue
        view = packing.stacked_view([ts[j] for j in same])
        if view is None:
            rest += same
        else:
            parts.append((same, view))
    if pack and len(loose) > 1:
        loose.sort()
        stacked = packing.pack([ts[j] for j in loose])
        made.add(stacked.untyped_storage().data_ptr())
        parts.append((loose, stacked))
    else:
        rest += loose
    if rest:
        parts.append((sorted(rest), None))
    return parts


_entry = dict.get  # None where the key is gone: the snapshot does not fit


def _pick(states: list[State], owners: list[int]) -> list[State]:
    """``states[i]`` for each ``i`` of ``owners``."""
    return list(map(states.__getitem__, owners))


class CounterSnapshot:
    """The device step counters ``keys`` of ``states`` (``(parameter index, key)`` pairs,
    0-d int64 tensors on one device), saved by :meth:`save` and put back by :meth:`restore`
    where a parameter's flag says so: one ``stack``, one ``where`` and one ``_foreach_copy_``.
    Never packed, and no view of a pack is kept: the rules re-pack their counters during a
    step (:class:`~galore2.core.counters.Counters`), so the counters are read and written
    through the state's tensors themselves."""

    __slots__ = ("flags", "keys", "saved", "tensors")

    def __init__(self, states: list[State], keys: list[tuple[int, str]], flags: int) -> None:
        self.keys = keys
        self.tensors = [states[i][k] for i, k in keys]
        first = self.tensors[0]
        self.flags = _flags_for([i for i, _ in keys], flags, 0, first.device)
        self.saved: Tensor | None = None

    def fits(self, states: list[State], keys: list[tuple[int, str]]) -> bool:
        """Built for these states' counters (the same tensors)?"""
        return keys == self.keys and all(
            map(operator.is_, (states[i][k] for i, k in keys), self.tensors)
        )

    def save(self) -> None:
        self.saved = torch.stack(self.tensors)

    def restore(self, bad: Tensor) -> None:
        """The saved counts of the parameters flagged in ``bad``, the others' as they are."""
        assert self.saved is not None
        current = torch.stack(self.tensors)
        torch.where(self.flags(bad), self.saved, current, out=current)
        torch._foreach_copy_(self.tensors, list(current.unbind()))
        self.saved = None


class Snapshot:
    """The ``keys`` of ``states`` (``(parameter index, key)`` pairs), saved by :meth:`save`
    and put back by :meth:`restore` where a parameter's flag says so.

    Built once for a group's state and reused while :meth:`fits` (the same state tensors).
    With ``pack`` (local tensors of one group: no DTensor shard, whose local tensor is not
    the state's), the same-shape tensors of each bucket are re-pointed (``Tensor.set_``) at
    the entries of one stacked buffer, keeping their identity and values: a save is then one
    ``clone`` and a restore one ``where`` into the buffer, whatever the number of tensors.
    One snapshot per group (the optimizer replaces a group's), so no tensor is packed twice.
    """

    def __init__(
        self, states: list[State], keys: list[tuple[int, str]], pack: bool,
        previous: Snapshot | None = None, skipped: frozenset[str] = frozenset(),
    ) -> None:  # fmt: skip
        self.keys = keys
        self.skipped = skipped  # the keys left out: the chain masks them itself
        self.owners = [i for i, _ in keys]
        self.names = [k for _, k in keys]
        self.tensors = [states[i][k] for i, k in keys]
        self.lengths = [len(s) for s in states]
        ours = previous.packs if previous is not None else set()
        self.packs: set[int] = set()  # the buffers it packed (a later snapshot may repack)
        self.buckets = [
            _Bucket(
                [self.tensors[j] for j in part],
                [keys[j][0] for j in part],
                len(states),
                st,
                frozenset(self.names[j] for j in part),
            )
            for idx in _buckets(self.tensors)
            for part, st in _split(self.tensors, idx, pack, ours, self.packs)
        ]
        self.saved: list[Tensor | None] = []

    def fits(self, states: list[State]) -> bool:
        """Are these the states (and state tensors) it was built for, still packed?"""
        if len(states) != len(self.lengths):
            return False
        if any(len(s) != n for s, n in zip(states, self.lengths, strict=True)):
            return False
        if not all(b.packed() for b in self.buckets):
            return False
        return all(map(operator.is_, map(_entry, _pick(states, self.owners), self.names),
                       self.tensors))  # fmt: skip

    def save(self, skip: frozenset[str] = frozenset()) -> None:
        """Copy the tensors' current values (one ``clone`` or ``stack`` per bucket), but
        those of buckets whose keys are all in ``skip`` (this step's
        :meth:`~galore2.core.transform.Transform.step_masked_keys`: not saved, not put back)."""
        self.saved = [None if b.keys <= skip
                      else b.stacked.clone() if b.stacked is not None else b.values()
                      for b in self.buckets]  # fmt: skip

    def restore(self, bad: Tensor) -> None:
        """Put back the saved values of the parameters flagged in ``bad``; the others keep
        their current values (bitwise: a select, not arithmetic)."""
        for b, saved in zip(self.buckets, self.saved, strict=True):
            if saved is None:  # unchanged where masked this step
                continue
            current = b.values()
            torch.where(b.flags(bad), saved, current, out=current)
            if b.stacked is None:  # a copy: write it back
                torch._foreach_copy_(b.tensors, list(current.unbind()))
        self.saved = []


def member_flags(first: Tensor, members: Sequence[Tensor], sizes: Sequence[int],
                 dims: Sequence[int]) -> list[Tensor]:  # fmt: skip
    """The flags of stacked entries from their members' 0-d flags ``members`` (views of one
    batch's flags, as ``first`` is): per entry, the next ``sizes[e]`` members' flags as a
    ``(k, 1, …)`` view of ``dims[e]`` dims — one pick (a cached ``index_select``) of every
    member's flag by its place in the batch's flags (its 0-d view's offset)."""
    base = first if first._base is None else first._base
    at = [m.storage_offset() - base.storage_offset() for m in members]
    flags = pick(base, at)
    out, start = [], 0
    for k, dim in zip(sizes, dims, strict=True):
        view = flags[start : start + k].view(k, *(1,) * (dim - 1))
        out.append(view)
        start += k
    return out
