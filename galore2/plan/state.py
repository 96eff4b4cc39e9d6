"""Optimizer-state bytes without allocating: galore2's measured, AdamW's and 8-bit AdamW's counted.

A state tensor is a :class:`Piece` (shape, bytes per element, how FSDP2 shards it);
:func:`nbytes` sums pieces on one rank of an FSDP world.

* galore2 optimizers are **measured**: built over the model (the meta device works),
  ``init_state()`` creates every state tensor at its final shape, and :func:`measured`
  lists them with the layout :mod:`galore2.fsdp` shards them by (the parameter's rows; a
  left-projected matrix's low-rank moments by columns; right bases ``Q`` and full-side
  moments replicated, Tucker-projected weights' state too, an upper bound; 0-d counters
  on the CPU). At world size 1 the sum is
  ``opt.state_bytes()["total"]``.
* ``torch.optim.AdamW`` and bitsandbytes' ``AdamW8bit`` are **counted** by their storage
  rules (:func:`counted`), per trainable parameter of n elements:

  - ``adamw``: two moments in the parameter dtype + a 0-d fp32 ``step`` (on the CPU; on
    the device with ``fused=True``, ``device_step``);
  - ``adamw8bit`` (bitsandbytes 0.50.2): fewer than 4096 elements, two fp32 moments;
    otherwise two uint8 moments + one fp32 absmax per 256 elements each; plus two
    256-entry fp32 code maps shared by all parameters.

  Both rules are checked against the real optimizers' state on a small CPU model
  (``tests/recipes/test_memory_estimate.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn

from ..projectors import FULL, LEFT, NONE, RIGHT
from ..storage.dynamic8 import BLOCK as BNB_BLOCK
from ..storage.dynamic8 import MIN_8BIT_SIZE as BNB_MIN_8BIT

#: optimizers whose state is counted by rule (everything galore2 builds is measured)
RULES = ("adamw", "adamw8bit")
#: FSDP layout of a projected matrix's inner (low-rank) state, by GaLore side
_INNER = {NONE: "rows", RIGHT: "rows", LEFT: "cols", FULL: "replicate"}
#: fp32/bf16 bases, or quantized codes + scales: a left basis shards with its weight's rows,
#: a right one is replicated
_BASES = {
    f"proj.{side}{suffix}": layout
    for side, layout in (("left", "rows"), ("right", "replicate"))
    for suffix in ("", ".q", ".scale")
}

__all__ = ["BNB_BLOCK", "BNB_MIN_8BIT", "RULES", "Piece", "counted", "measured", "nbytes"]


class Piece(NamedTuple):
    """One tensor: its shape, bytes per element, how FSDP shards it (``rows``, ``cols``,
    ``replicate``, or ``cpu``: never sharded) and which ``state_bytes()`` column it counts
    in (``moments``, ``basis``, ``other``)."""

    shape: tuple[int, ...]
    itemsize: int
    layout: str = "rows"
    kind: str = "moments"


def nbytes(pieces: Iterable[Piece], world: int = 1) -> int:
    """Bytes of ``pieces`` on one of ``world`` FSDP ranks (a sharded dim split like
    ``torch.chunk``: the largest shard counts)."""
    total = 0
    for p in pieces:
        dims = list(p.shape)
        i = {"rows": 0, "cols": min(1, len(dims) - 1)}.get(p.layout)
        if i is not None and dims and world > 1:
            dims[i] = -(-dims[i] // world)
        total += p.itemsize * math.prod(dims)
    return total


def _eight_bit(shape: tuple[int, ...]) -> list[Piece]:
    n = math.prod(shape)
    if n < BNB_MIN_8BIT:
        return [Piece(shape, 4)] * 2
    return [Piece(shape, 1)] * 2 + [Piece((-(-n // BNB_BLOCK),), 4)] * 2


def counted(
    name: str, model: nn.Module | Iterable[torch.Tensor], device_step: bool = False
) -> list[Piece]:
    """The state ``torch.optim.AdamW`` (``name="adamw"``) or bitsandbytes' ``AdamW8bit``
    (``"adamw8bit"``) holds for ``model``'s trainable parameters (or those given), by its
    storage rules;
    ``device_step``: AdamW keeps its step counters on the device (``fused=True``)."""
    if name not in RULES:
        raise ValueError(f"no storage rule for {name!r}; rules: {', '.join(RULES)}")
    params = model.parameters() if isinstance(model, nn.Module) else model
    out: list[Piece] = []
    for p in (p for p in params if p.requires_grad):
        shape = tuple(p.shape)
        if name == "adamw":
            step = Piece((), 4, "replicate" if device_step else "cpu", "other")
            out += [Piece(shape, p.element_size())] * 2 + [step]
        else:
            out += _eight_bit(shape)
    if name == "adamw8bit":  # the two shared quantization maps
        out += [Piece((256,), 4, "replicate", "other")] * 2
    return out


def measured(opt: torch.optim.Optimizer) -> list[Piece]:
    """Every state tensor of a galore2 optimizer (after ``init_state()``), laid out as
    galore2.fsdp shards it."""
    out: list[Piece] = []
    for state in opt.state.values():
        side = int(state["galore.side"]) if "galore.side" in state else NONE
        inner = _INNER.get(side, "replicate")  # Tucker cores: counted whole on every rank
        for key, v in state.items():
            if isinstance(v, torch.Tensor):
                layout = _BASES.get(key, inner) if v.dim() else "cpu"
                out.append(Piece(tuple(v.shape), v.element_size(), layout))
    return out
