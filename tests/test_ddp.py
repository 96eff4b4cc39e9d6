"""galore2.GaLoreAdamW under DistributedDataParallel (CPU, gloo): equals a single-process run
on the concatenated batch, and every rank ends with identical parameters and bases."""

from __future__ import annotations

from . import ddp_cases
from .dist_timeout import spawn_with_timeout


def test_ddp_matches_single_process():
    spawn_with_timeout(ddp_cases.ddp_matches_single_process, 2, timeout=180)
