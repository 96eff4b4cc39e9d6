"""The few collectives checkpointing needs; every one is a no-op without a process group."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world() -> int:
    return dist.get_world_size() if active() else 1


def barrier() -> None:
    if active():
        dist.barrier()


def gather(value: Any) -> list[Any]:
    """Every rank's ``value`` (a small picklable object, sent over the wire, never stored)."""
    if not active():
        return [value]
    out: list[Any] = [None] * world()
    dist.all_gather_object(out, value)
    return out
