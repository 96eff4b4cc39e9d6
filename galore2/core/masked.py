"""The masked (``capturable=True``) step's list work, a few kernels per group, not per tensor.

A capturable step never reads its non-finite flags on the host (see
:mod:`galore2.core.nonfinite`): every parameter steps on its gradient with an unusable one
replaced by zeros, then the device state of those masked out is put back. Both are done
over whole lists: the tensors of one (device, dtype) are flattened into one buffer
(``torch.cat``), the per-parameter flags are stretched to one flag per element
(``repeat_interleave`` by constant sizes, :func:`galore2._numerics.constants`), and one
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

from .. import _numerics

State = dict[str, Tensor]


def _buckets(tensors: Sequence[Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` by (device, dtype), in order."""
    by: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        by.setdefault((t.device, t.dtype), []).append(i)
    return list(by.values())


def _spread(flags: Tensor, owners: Sequence[int], sizes: Sequence[int]) -> Tensor:
    """One flag per element of the concatenation of tensors of ``sizes`` whose parameters
    are ``owners`` (nondecreasing indices into ``flags``)."""
    counts = [0] * flags.numel()
    for i, n in zip(owners, sizes, strict=True):
        counts[i] += n
    repeats = _numerics.constants(tuple(counts), torch.int64, flags.device)
    return torch.repeat_interleave(flags, repeats, output_size=sum(sizes))


def masked_grads(grads: list[Tensor], bad: Tensor) -> list[Tensor]:
    """Copies of ``grads`` with those of parameters flagged in ``bad`` (a bool per gradient,
    on their device) all zeros: per (device, dtype), one ``cat``, one ``repeat_interleave``
    and one ``masked_fill_``; the copies are views of that buffer."""
    out = list(grads)
    for idx in _buckets(grads):
        sizes = [grads[i].numel() for i in idx]
        flat = torch.cat([grads[i].reshape(-1) for i in idx])
        flat.masked_fill_(_spread(bad, idx, sizes), 0.0)
        for i, piece in zip(idx, flat.split(sizes), strict=True):
            out[i] = piece.view(grads[i].shape)
    return out


class Snapshot:
    """The ``keys`` of ``states`` (``(parameter index, key)`` pairs, indices nondecreasing) as
    they are now, to put back where a parameter's flag says so (:meth:`restore`)."""

    def __init__(self, states: list[State], keys: list[tuple[int, str]]) -> None:
        self.keys = keys
        tensors = [states[i][k] for i, k in keys]
        self.buckets = _buckets(tensors)
        self.saved = [torch.cat([tensors[j].reshape(-1) for j in idx]) for idx in self.buckets]

    def restore(self, states: list[State], bad: Tensor) -> None:
        """Put back the saved values of the parameters flagged in ``bad``; the others keep
        their current values (bitwise: a select, not arithmetic)."""
        tensors = [states[i][k] for i, k in self.keys]
        for idx, saved in zip(self.buckets, self.saved, strict=True):
            sizes = [tensors[j].numel() for j in idx]
            current = torch.cat([tensors[j].reshape(-1) for j in idx])
            where = _spread(bad, [self.keys[j][0] for j in idx], sizes)
            torch.where(where, saved, current, out=current)
            pieces = current.split(sizes)
            torch._foreach_copy_(
                [tensors[j] for j in idx],
                [p.view(tensors[j].shape) for j, p in zip(idx, pieces, strict=True)],
            )
