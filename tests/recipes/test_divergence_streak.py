"""The divergence stop counts consecutive skipping steps (issue 30, behaviours no test
pinned): alternating skip / no-skip never stops, N skips in a row stop at the N-th."""

from __future__ import annotations

import torch

from recipes.divergence import SkipWatch


class _Counting:
    """Stands in for a galore2 optimizer: two parameters, a cumulative skip counter."""

    def __init__(self) -> None:
        self.param_groups = [{"params": [0, 1]}]
        self.nonfinite_skips = 0


def _watch(opt, max_skip_steps):
    return SkipWatch(opt, max_skip_steps, rank=1, world=1, device=torch.device("cpu"))


def _first_stop(pattern: str, max_skip_steps: int) -> int | None:
    """The step at which the watch stops for ``pattern`` ('s': a step that skipped)."""
    opt = _Counting()
    watch = _watch(opt, max_skip_steps)
    for step, c in enumerate(pattern, start=1):
        opt.nonfinite_skips += 2 if c == "s" else 0
        if watch.after_step(step) is not None:
            return step
    return None


def test_alternating_skips_never_stop():
    assert _first_stop("s." * 20, max_skip_steps=2) is None
    assert _first_stop("ss." * 10, max_skip_steps=3) is None


def test_stop_comes_at_the_nth_consecutive_skip():
    assert _first_stop("s.s.sss..", max_skip_steps=3) == 7
    assert _first_stop(".ss.s.ssss", max_skip_steps=4) == 10
    assert _first_stop("s" * 5, max_skip_steps=1) == 1
    assert _first_stop("s" * 50, max_skip_steps=0) is None  # 0: never stops
