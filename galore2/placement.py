"""Where a parameter's pieces live: the single-process ``Placement`` every transform talks to.

Transforms and projectors only ever see plain local tensors. What they need to
know about distribution goes through a ``Placement`` object on the context:

* ``zeros(global_shape, dtype, device, layout)`` allocates a state tensor. The
  layout says how it relates to the parameter's sharding: ``"param"`` (same
  shape and sharding as the parameter: elementwise state), ``"rows"`` (dim 0 is
  the parameter's dim 0, sharded the same way: P, right-side moments),
  ``"cols"`` (dim 1 is the parameter's column dim, sharded evenly by chunks:
  left-side moments), ``"replicate"`` (identical on every rank: Q, full-side
  moments). Single process: plain ``torch.zeros``.
* ``local(t)`` → the local tensor of a stored state tensor (a view: in-place
  updates write through).
* ``reduce(t)`` → Σ over ranks (all-reduce); ``reduce_scatter_cols(t)`` /
  ``all_gather_cols(t)`` move an r×n tensor between "partial sum on every rank"
  and "column shard of the sum"; ``any(flags)`` ORs booleans across ranks.
* ``row_range(m)`` → this rank's rows [start, stop) of a dim-0-sharded tensor.

A :class:`Collective` describes one such call on paper (op, logical shape, dtype): the code
that issues collectives lists them with it (the projections of
:mod:`galore2.optim.projection`, the projectors' refreshes), and :mod:`galore2.traffic`
adds them up.

This file is the identity implementation; ``galore2.fsdp`` implements the same
methods with DTensor and collectives (all collective code lives there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

LAYOUTS = ("param", "rows", "cols", "replicate")
#: the collectives a :class:`Collective` names (the placement methods that issue them:
#: ``reduce`` / ``any``, ``reduce_scatter_cols``, ``all_gather_cols``, ``gather_rows``,
#: ``broadcast``)
OPS = ("all_reduce", "reduce_scatter", "all_gather", "gather", "broadcast")


@dataclass(frozen=True)
class Collective:
    """One collective call, as issued by every rank of the shard group (on paper).

    ``shape`` is the full logical tensor: all-reduce → the tensor; reduce-scatter → its
    input (partial sums); all-gather → its output; gather → what the owner assembles
    (p·⌈m/p⌉ padded rows); broadcast → the tensor. See :mod:`galore2.traffic`.
    """

    op: str  # one of OPS
    shape: tuple[int, ...]  # the full logical tensor (see above)
    dtype: torch.dtype
    source: str  # the galore2 (or FSDP) code that issues it
    param: str = ""  # parameter (or FSDP unit) name; "" for a group-level call
    period: int = 1  # steps between two occurrences (update_proj_gap for refreshes)

    @property
    def numel(self) -> int:
        """Elements of the logical tensor."""
        out = 1
        for d in self.shape:
            out *= int(d)
        return out

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype``."""
        return itemsize(self.dtype)

    @property
    def bytes(self) -> int:
        """Logical payload bytes (the full tensor reduced / assembled / distributed)."""
        return self.numel * self.itemsize

    def wire_bytes(self, world_size: int) -> float:
        """Bytes received per rank (averaged over ranks), bandwidth-optimal algorithms."""
        p = world_size
        if p <= 1:
            return 0.0
        factor = {
            "all_reduce": 2 * (p - 1) / p,
            "reduce_scatter": (p - 1) / p,
            "all_gather": (p - 1) / p,
            "gather": (p - 1) / p**2,
            "broadcast": (p - 1) / p,
        }[self.op]
        return factor * self.bytes

    def key(self) -> tuple[str, int, int]:
        """(op, numel, itemsize): what a recorder of issued collectives can compare."""
        return self.op, self.numel, self.itemsize


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


class Placement:
    """Single-process placement: every operation is the identity."""

    world: int = 1
    rank: int = 0

    @property
    def distributed(self) -> bool:
        """Whether the parameter is split over more than one rank (``world > 1``)."""
        return self.world > 1

    def zeros(
        self,
        shape: tuple[int, ...] | torch.Size,
        dtype: torch.dtype,
        device: torch.device,
        layout: str,
    ) -> Tensor:
        """A zero state tensor of global ``shape``, laid out per ``layout`` (see :data:`LAYOUTS`).

        Single process: a plain ``torch.zeros`` of ``shape``, whatever the layout.
        """
        return torch.zeros(shape, dtype=dtype, device=device)

    def local(self, t: Tensor) -> Tensor:
        """The local tensor of a stored state tensor (a view: in-place updates write through)."""
        return t

    def row_range(self, m: int) -> tuple[int, int]:
        """This rank's rows ``[start, stop)`` of a dim-0-sharded tensor with ``m`` rows."""
        return 0, m

    def reduce(self, t: Tensor) -> Tensor:
        """Σ of ``t`` over the ranks, in place (all-reduce); the identity here."""
        return t

    def reduce_scatter_cols(self, t: Tensor) -> Tensor:
        """An r×n tensor of partial sums on every rank → this rank's column chunk of the sum."""
        return t

    def all_gather_cols(self, t: Tensor, n: int) -> Tensor:
        """This rank's column chunk of an r×n tensor → the full r×n tensor on every rank."""
        return t

    def any(self, flags: list[bool]) -> list[bool]:
        """Logical OR of each flag over the ranks (every rank gets the same list)."""
        return flags

    def any_global(self, flags: Tensor) -> Tensor:
        """Elementwise ``any`` of a bool tensor over every rank of the default process group
        (all ranks step together); stays on the flags' device (no host read)."""
        return flags

    def gather_rows(self, t: Tensor, owner: int) -> Tensor | None:
        """The full row-sharded matrix on ``owner`` (None elsewhere)."""
        return t

    def broadcast(
        self,
        t: Tensor | None,
        owner: int,
        shape: tuple[int, ...],
        device: torch.device | None = None,
    ) -> Tensor:
        """``t`` from rank ``owner`` on every rank.

        Ranks other than ``owner`` may pass ``None``; they receive a tensor of ``shape`` on
        ``device``. Single process: ``t`` itself.
        """
        assert t is not None
        return t


LOCAL = Placement()
