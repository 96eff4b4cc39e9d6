"""accelerate's FSDP2 preparation swaps the parameters of an optimizer built before sharding."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from ..dist import spawn
from . import accelerate_swap_cases as cases


def test_fsdp2_swap_matches_optimizer_built_after_sharding(tmp_path):
    """Trained after accelerate's swap (its real ``prepare`` and a step-by-step mimic), a
    galore2 optimizer from ``create_optimizer`` equals one built on the sharded model."""
    spawn(cases.swap_matches_optimizer_built_after_sharding, 2, str(tmp_path), timeout=240)
