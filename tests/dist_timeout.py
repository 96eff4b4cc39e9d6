"""``spawn`` with a deadline and a synchronized exit, for the HSDP / DDP / FSDP-error tests.

* A rank stuck in a collective fails the test after ``timeout`` seconds instead of hanging it.
* After ``fn`` returns, every rank frees its garbage and meets the others at a barrier before
  ``dist_utils`` destroys the process group. Without that, a rank that finishes early tears
  gloo down while its peers still talk to it, and about one run in ten (2 CPUs, torch 2.13)
  dies at exit with "terminate called without an active exception" (SIGABRT) after the test
  body has passed.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from .dist_utils import _entry, _free_port


def _synced(rank: int, world: int, fn: Callable[..., Any], *args: Any) -> None:
    fn(rank, world, *args)
    gc.collect()  # DDP reducers, FSDP states, DTensors holding groups: gone before teardown
    dist.barrier()


def spawn_with_timeout(fn: Callable[..., Any], world: int, *args: Any, timeout: float) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; fail after ``timeout`` seconds.

    A raise in any rank fails the call (as ``dist_utils.spawn``); ranks still running at the
    deadline are killed and ``TimeoutError`` is raised.
    """
    ctx = mp.start_processes(
        _entry,
        args=(world, _free_port(), _synced, (fn, *args)),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{fn.__name__} on {world} ranks did not finish in {timeout:.0f} s "
                    "(a rank is probably blocked in a collective)"
                )
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
