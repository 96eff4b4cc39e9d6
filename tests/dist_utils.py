"""Run a function in N spawned CPU processes with a gloo process group (for distributed tests)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        # Let every rank finish and drop its DTensors before gloo tears down: ranks exiting
        # at different times otherwise abort now and then ("terminate called without an
        # active exception").
        import gc

        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world: int, *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; a raise in any rank fails the call."""
    mp.spawn(_entry, args=(world, _free_port(), fn, args), nprocs=world, join=True)
