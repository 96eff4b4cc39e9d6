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

This file is the identity implementation; ``galore2.fsdp`` implements the same
methods with DTensor and collectives (all collective code lives there).
"""

from __future__ import annotations

import torch
from torch import Tensor

LAYOUTS = ("param", "rows", "cols", "replicate")


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
