"""Per-tensor write flags of a deferred step, as galore2's ops take them (no triton here).

On a deferred step (:mod:`galore2.core.deferred`) the non-finite flags stay on the device:
galore2's ops take them as ``keep`` — one bool per tensor of a list, or per member of a
stack — and a tensor flagged False is not written at all (its weight, its moments, its
``out``). ``keep_at`` (optional): where in ``keep`` each tensor's flag is — a shape batch's
members are positions of their group's flags, not consecutive ones — uploaded once per
layout (:func:`positions`), so no step gathers flags. The Triton kernels read the flags
themselves, so no host read decides what is written; the ops' torch paths (elsewhere: the
CPU) pick the kept tensors on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .tables import kept as kept_table
from .tables import upload


def keeps(
    keep: Tensor | None, count: int, device: torch.device, at: Sequence[int] | None = None
) -> bool:
    """Is ``keep`` flags the kernels take for ``count`` tensors (or stack members) on
    ``device`` (None: no flags)? A contiguous 1-D bool tensor there, of ``count`` entries —
    or, with ``at``, ``count`` positions in it."""
    if keep is None:
        return at is None
    if not (keep.dtype == torch.bool and keep.dim() == 1 and keep.device == device
            and keep.is_contiguous()):  # fmt: skip
        return False
    if at is None:
        return keep.numel() == count
    n = keep.numel()
    return len(at) == count and all(0 <= a < n for a in at)


def check(
    name: str, keep: Tensor | None, count: int, device: torch.device,
    at: Sequence[int] | None = None,
) -> None:  # fmt: skip
    """Refuse flags :func:`keeps` does not take, naming the op and what it takes."""
    if not keeps(keep, count, device, at):
        got = "positions without flags" if keep is None else (
            f"{keep.dtype} of shape {tuple(keep.shape)} on {keep.device}"
            + ("" if at is None else f" at {len(at)} positions"))  # fmt: skip
        raise ValueError(
            f"{name}: keep must be a contiguous 1-D bool tensor on {device} with one flag per "
            f"tensor or stack member ({count}; keep_at: their positions in it), got {got}"
        )


def kept(keep: Tensor | None, count: int, at: Sequence[int] | None = None) -> list[int]:
    """The tensors (0…count−1) flagged True (all without flags): the torch paths' host read."""
    if keep is None:
        return list(range(count))
    values = keep.tolist()
    return [j for j in range(count) if values[j if at is None else at[j]]]


def members(
    keep: Tensor | None, at: Sequence[int] | None = None, steps: Sequence[int] | None = None
) -> int:
    """How many tensors (or stack members) ``keep`` flags: one per position of ``at``, else
    one per flag; ``steps`` (a stack's members' own step counts) says so too; 1 with none."""
    if steps is not None:
        return len(steps)
    if keep is None:
        return 1
    return len(at) if at is not None else keep.numel()


def pointer(keep: Tensor | None, fallback: Tensor) -> tuple[Tensor, bool]:
    """(what a kernel reads the flags from, HAS_KEEP): the bools as bytes (0 or 1); any
    tensor (``fallback``) stands for them when there are none (the kernel reads nothing)."""
    return (fallback, False) if keep is None else (keep.view(torch.uint8), True)


def positions(at: Sequence[int], device: torch.device) -> Tensor:
    """``at`` as an int64 tensor on ``device``, uploaded once per layout and kept
    (:func:`~galore2.kernels.tables.kept`): the kernels read each tensor's flag there."""
    values = tuple(int(a) for a in at)
    return kept_table(("keep_at", *values), device, lambda: upload(values, device))


__all__ = ["check", "keeps", "kept", "members", "pointer", "positions"]
