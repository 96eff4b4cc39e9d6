"""The divergence stop counts consecutive skipping steps (issue 30, behaviours no test
pinned): alternating skip / no-skip never stops, N skips in a row stop at the N-th. Since
issue 38 the counters are read at log steps only (a host sync with ``capturable=True``):
with a log every step the stop is exactly per step; with longer windows the streak is
counted in whole windows (recipes/divergence.py's docstring)."""

from __future__ import annotations

import torch

from galore2.core.nonfinite import SKIPS
from recipes.divergence import SkipWatch


class _Counting:
    """Stands in for a galore2 optimizer: two parameters, each with a skip counter in its
    state; ``nonfinite_skips`` (their sum) counts how often it is read."""

    def __init__(self) -> None:
        self.params = [torch.zeros(1), torch.zeros(1)]
        self.param_groups = [{"params": self.params}]
        self.state = {p: {SKIPS: 0} for p in self.params}
        self.reads = 0

    @property
    def nonfinite_skips(self) -> int:
        self.reads += 1
        return sum(s[SKIPS] for s in self.state.values())

    def skip(self, c: str) -> None:
        """One step: 's' both parameters skip, 'a' / 'b' only the first / second, '.' none."""
        for i, p in enumerate(self.params):
            if c == "s" or c == "ab"[i]:
                self.state[p][SKIPS] += 1


def _watch(opt, max_skip_steps):
    return SkipWatch(opt, max_skip_steps, rank=1, world=1, device=torch.device("cpu"))


def _first_stop(pattern: str, max_skip_steps: int, log_every: int = 1) -> int | None:
    """The step at which the watch stops for ``pattern`` (see :meth:`_Counting.skip`),
    logging every ``log_every`` steps."""
    opt = _Counting()
    watch = _watch(opt, max_skip_steps)
    for step, c in enumerate(pattern, start=1):
        opt.skip(c)
        if step % log_every == 0 and watch.at_log(step)[1] is not None:
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
    assert _first_stop("abab", max_skip_steps=4) == 4  # per step: any update skipped counts


def test_counters_are_read_at_log_steps_only():
    opt = _Counting()
    watch = _watch(opt, 3)
    assert opt.reads == 1  # a resumed run's count, once
    for step in range(1, 21):
        opt.skip(".")
        if step % 5 == 0:
            fields, _ = watch.at_log(step)
            assert fields == {"nonfinite_skips": 0, "nonfinite_skips_window": 0}
    assert opt.reads == 1 + 4


def test_windows_extend_the_streak_only_when_every_step_skipped():
    # a parameter skipped at each of the window's steps: the window joins the streak
    assert _first_stop("ssss" * 3, max_skip_steps=6, log_every=4) == 8
    assert _first_stop("aaaa" * 3, max_skip_steps=8, log_every=4) == 8
    # alternating steps: skips at some steps only, never a stop (no streak it did not have)
    assert _first_stop("s." * 30, max_skip_steps=2, log_every=4) is None
    # a streak begun inside a window counts from the next window: 9 consecutive skipping
    # steps at step 12 (a per-step count stops there), 8 counted; the stop comes a window
    # later
    assert _first_stop("...s" + "ssss" * 2, max_skip_steps=9, log_every=4) is None
    assert _first_stop("...s" + "ssss" * 3, max_skip_steps=9, log_every=4) == 16
    # skips taking turns between parameters: every step skipped, but no parameter at every
    # step of the window: not counted (documented)
    assert _first_stop("abab" * 4, max_skip_steps=4, log_every=4) is None


def test_window_fields_and_warnings():
    import warnings

    opt = _Counting()
    watch = _watch(opt, 0)
    watch.rank = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, c in enumerate("..s.ss..", start=1):
            opt.skip(c)
            if step % 2 == 0:
                fields, stop = watch.at_log(step)
                assert stop is None
    assert fields == {"nonfinite_skips": 6, "nonfinite_skips_window": 0}
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2  # windows 3-4 and 5-6
    assert messages[0].startswith("steps 3-4: 2 of 4 parameter updates skipped because")
    assert messages[1].startswith("steps 5-6: 4 parameter updates skipped")
