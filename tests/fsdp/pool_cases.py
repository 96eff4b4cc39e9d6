"""Rank bodies for tests/fsdp/test_spawn_pool.py (module level: the ranks import them)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

def dirty(rank: int, world: int) -> None:
    """Leave what a careless body could leave behind: a seed, a dtype, an environment."""
    torch.manual_seed(rank + 1)
    torch.set_default_dtype(torch.float64)
    os.environ["GALORE2_POOL_PROBE"] = "left behind"


def looks_fresh(rank: int, world: int, expected_env: str | None) -> None:
    assert torch.initial_seed() != rank + 1  # the seed ``dirty`` set is gone
    assert torch.get_default_dtype() == torch.float32
    assert os.environ.get("GALORE2_POOL_PROBE") == expected_env
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    assert total.item() == world * (world + 1) / 2


def raises_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("planted failure")
    dist.barrier()  # rank 0 waits for a peer that never comes


def sleeps(rank: int, world: int) -> None:
    time.sleep(60)


def write_pid(rank: int, world: int, folder: str) -> None:
    with open(os.path.join(folder, f"{rank}.pid"), "a") as f:
        f.write(f"{os.getpid()}\n")
