"""Per-tensor write flags of a deferred step, as galore2's ops take them (no triton here).

On a deferred step (:mod:`galore2.core.deferred`) the non-finite flags stay on the device:
galore2's ops take them as ``keep`` — one bool per tensor of a list, or per member of a
stack — and a tensor flagged False is not written at all (its weight, its moments, its
``out``). The Triton kernels read the flags themselves, so no host read decides what is
written; the ops' torch paths (elsewhere: the CPU) pick the kept tensors on the host.
"""

from __future__ import annotations

import torch
from torch import Tensor


def keeps(keep: Tensor | None, count: int, device: torch.device) -> bool:
    """Is ``keep`` flags the kernels take for ``count`` tensors (or stack members) on
    ``device`` (None: no flags)? A contiguous bool tensor of ``count`` entries there."""
    return keep is None or (
        keep.dtype == torch.bool
        and keep.numel() == count
        and keep.device == device
        and keep.is_contiguous()
    )


def check(name: str, keep: Tensor | None, count: int, device: torch.device) -> None:
    """Refuse flags :func:`keeps` does not take, naming the op and what it takes."""
    if not keeps(keep, count, device):
        assert keep is not None
        raise ValueError(
            f"{name}: keep must be a contiguous bool tensor of {count} entries on {device} "
            f"(one per tensor or stack member), got {keep.dtype} of {keep.numel()} on "
            f"{keep.device}"
        )


def kept(keep: Tensor | None, count: int) -> list[int]:
    """The positions flagged True (all without flags): the torch paths' host read."""
    if keep is None:
        return list(range(count))
    return [i for i, k in enumerate(keep.tolist()) if k]


__all__ = ["check", "keeps", "kept"]
