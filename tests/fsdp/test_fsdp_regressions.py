"""Regressions in the sharded path (each one failed before its fix)."""

from __future__ import annotations

import pytest

from ..dist import spawn
from . import fsdp_regression_cases as cases


@pytest.mark.parametrize(
    "case",
    [
        cases.raise_is_collective,
        cases.rank_deficient_gradient_refreshes,
        cases.float64_default_dtype,
    ],
    ids=lambda f: f.__name__,
)
def test_sharded_regression(case):
    spawn(case, 2)
