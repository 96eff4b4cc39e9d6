"""The masked (``capturable=True``) step's list work, a few kernels per group, not per tensor.

A capturable step never reads its non-finite flags on the host (see
:mod:`galore2.core.nonfinite`): every parameter steps on its gradient with an unusable one
replaced by zeros, then the device state of those masked out is put back. Both are done
over whole lists: the tensors of one (device, dtype) are flattened into one buffer
(``torch.cat``), the per-parameter flags are stretched to one flag per element (one
``cat`` of broadcast views), and one
``masked_fill`` / ``where`` acts on the buffer; the results go back by views (gradients) or
one ``_foreach_copy_`` (state). No tensor is made from host data after the first step and
nothing is read back, so the step can be captured in a CUDA graph.

Memory: the gradients are copied once (the masked copy the chain sees), and the state
twice for the duration of the step (the snapshot taken before the chain and the buffer
the restore selects into).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

State = dict[str, Tensor]


def _buckets(tensors: Sequence[Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` by (device, dtype), in order."""
    by: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        by.setdefault((t.device, t.dtype), []).append(i)
    return list(by.values())


def _spread(flags: Tensor, runs: Sequence[tuple[int, int]]) -> Tensor:
    """One flag per element of a concatenation whose consecutive ``runs`` of ``(parameter
    index, elements)`` belong to one parameter each: one ``cat`` of the flags broadcast to
    each run (views), no index tensor."""
    each = flags.unbind()
    return torch.cat([each[i].expand(n) for i, n in runs])


def _runs(owners: Sequence[int], sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive equal ``owners`` merged: ``(owner, total size)``."""
    out: list[list[int]] = []
    for i, n in zip(owners, sizes, strict=True):
        if out and out[-1][0] == i:
            out[-1][1] += n
        else:
            out.append([i, n])
    return [(i, n) for i, n in out]


def masked_grads(grads: list[Tensor], bad: Tensor) -> list[Tensor]:
    """Copies of ``grads`` with those of parameters flagged in ``bad`` (a bool per gradient,
    on their device) all zeros: per (device, dtype), one ``cat`` of the gradients, one of the
    flags and one ``masked_fill_``; the copies are views of that buffer."""
    out = list(grads)
    for idx in _buckets(grads):
        sizes = [grads[i].numel() for i in idx]
        flat = torch.cat([grads[i].reshape(-1) for i in idx])
        flat.masked_fill_(_spread(bad, list(zip(idx, sizes, strict=True))), 0.0)
        for i, piece in zip(idx, flat.split(sizes), strict=True):
            out[i] = piece.view(grads[i].shape)
    return out


class Snapshot:
    """The ``keys`` of ``states`` (``(parameter index, key)`` pairs, indices nondecreasing),
    saved by :meth:`save` and put back by :meth:`restore` where a parameter's flag says so.

    Built once for a group's state and reused while :meth:`fits` (the same state tensors):
    the flat views, sizes and runs of each (device, dtype) are computed here, not per step.
    """

    def __init__(self, states: list[State], keys: list[tuple[int, str]]) -> None:
        self.keys = keys
        self.tensors = [states[i][k] for i, k in keys]
        self.lengths = [len(s) for s in states]
        self.buckets = []
        for idx in _buckets(self.tensors):
            ts = [self.tensors[j] for j in idx]
            sizes = [t.numel() for t in ts]
            flat = [t.view(-1) if t.is_contiguous() else None for t in ts]
            runs = _runs([keys[j][0] for j in idx], sizes)
            self.buckets.append((ts, flat, sizes, runs))
        self.saved: list[Tensor] = []

    def fits(self, states: list[State]) -> bool:
        """Are these the states (and state tensors) it was built for?"""
        if len(states) != len(self.lengths):
            return False
        if any(len(s) != n for s, n in zip(states, self.lengths, strict=True)):
            return False
        return all(states[i][k] is t for (i, k), t in zip(self.keys, self.tensors, strict=True))

    @staticmethod
    def _flats(ts: list[Tensor], flat: list[Tensor | None]) -> list[Tensor]:
        return [f if f is not None else t.reshape(-1) for t, f in zip(ts, flat, strict=True)]

    def save(self) -> None:
        """Copy the tensors' current values (one ``cat`` per device and dtype)."""
        self.saved = [torch.cat(self._flats(ts, flat)) for ts, flat, _, _ in self.buckets]

    def restore(self, bad: Tensor) -> None:
        """Put back the saved values of the parameters flagged in ``bad``; the others keep
        their current values (bitwise: a select, not arithmetic)."""
        for (ts, flat, sizes, runs), saved in zip(self.buckets, self.saved, strict=True):
            current = torch.cat(self._flats(ts, flat))
            torch.where(_spread(bad, runs), saved, current, out=current)
            pieces = current.split(sizes)
            dst = [f if f is not None else t for t, f in zip(ts, flat, strict=True)]
            src = [p if f is not None else p.view(t.shape)
                   for t, f, p in zip(ts, flat, pieces, strict=True)]  # fmt: skip
            torch._foreach_copy_(dst, src)
        self.saved = []
