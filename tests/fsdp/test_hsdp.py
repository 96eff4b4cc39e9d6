"""HSDP (fully_shard on a 2×2 replicate × shard mesh) on CPU with gloo: galore2 equals a
single-process run on the concatenated batch, and both replicas keep identical bases."""

from __future__ import annotations

from ..dist import spawn
from . import data_parallel_cases as cases


def test_hsdp_matches_single_process():
    spawn(cases.hsdp_matches_single_process, 4, timeout=150)
