"""DTensor layouts galore2 refuses, and NaN skips that ranks decide together (CPU, gloo)."""

from __future__ import annotations

from ..dist import spawn
from . import fsdp_errors_cases as cases


def test_unsupported_placement_raises_value_error():
    """Shard(1) (tensor parallel), Replicate() on a 1-D mesh, wrong 2-D layouts: ValueError
    naming the shape and placement at step() / init_state(), parameter unchanged."""
    spawn(cases.unsupported_placements_raise, 2, timeout=120)


def test_refused_parameter_gets_no_state():
    spawn(cases.failed_init_leaves_no_state, 2, timeout=120)


def test_refused_parameter_in_later_group_changes_nothing():
    spawn(cases.unsupported_in_later_group_changes_nothing, 2, timeout=120)


def test_nan_on_one_rank_is_skipped_on_every_rank():
    """NaN in rank 1's gradient shard only: both ranks skip that parameter (and only it),
    count the skip, and keep training in step (a hang fails on the timeout)."""
    spawn(cases.nan_on_one_rank_is_skipped_everywhere, 2, timeout=120)
