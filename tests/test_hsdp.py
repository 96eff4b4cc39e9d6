"""HSDP (fully_shard on a 2×2 replicate × shard mesh) on CPU with gloo: galore2 equals a
single-process run on the concatenated batch, and both replicas keep identical bases."""

from __future__ import annotations

from . import hsdp_cases
from .dist_timeout import spawn_with_timeout


def test_hsdp_matches_single_process():
    spawn_with_timeout(hsdp_cases.hsdp_matches_single_process, 4, timeout=150)
