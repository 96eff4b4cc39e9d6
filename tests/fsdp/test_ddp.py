"""galore2.GaLoreAdamW under DistributedDataParallel (CPU, gloo): equals a single-process run
on the concatenated batch, and every rank ends with identical parameters and bases."""

from __future__ import annotations

from ..dist import spawn
from . import data_parallel_cases as cases


def test_ddp_matches_single_process():
    spawn(cases.ddp_matches_single_process, 2, timeout=180)
