"""FSDP2 (fully_shard) on CPU with gloo: galore2 equals a single-process run on the same data."""

from __future__ import annotations

import pytest

from . import fsdp_cases
from .dist_utils import spawn


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_matches_single_process(world):
    spawn(fsdp_cases.fsdp_matches_single_process, world)
