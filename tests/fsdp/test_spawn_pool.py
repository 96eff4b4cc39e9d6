"""``tests.dist.spawn`` keeps its ranks between calls: each call must still see what a fresh
process sees, and a failure must fail the test and never leak into the next call."""

from __future__ import annotations

import os

import pytest

from tests import dist
from tests.dist import spawn

from . import pool_cases as cases


def test_a_kept_rank_starts_each_call_like_a_fresh_process(monkeypatch):
    monkeypatch.delenv("GALORE2_POOL_PROBE", raising=False)
    spawn(cases.dirty, 2)
    spawn(cases.looks_fresh, 3, None)  # two kept ranks and a new one
    monkeypatch.setenv("GALORE2_POOL_PROBE", "parent")
    spawn(cases.looks_fresh, 2, "parent")  # the parent's environment at the call


def test_a_raise_names_the_rank_and_the_next_call_runs():
    with pytest.raises(AssertionError, match=r"(?s)\(rank 1\):\n.*ValueError: planted failure"):
        spawn(cases.raises_on_rank_one, 2, timeout=120)
    spawn(cases.looks_fresh, 2, None)


def test_a_rank_still_running_at_the_deadline_is_a_timeout():
    with pytest.raises(TimeoutError, match="did not finish in 2 s"):
        spawn(cases.sleeps, 2, timeout=2)
    spawn(cases.looks_fresh, 2, None)


def test_ranks_are_kept_within_a_test_file_and_new_for_another(tmp_path, monkeypatch):
    def pids() -> list[str]:
        return (tmp_path / "0.pid").read_text().split()

    spawn(cases.write_pid, 2, str(tmp_path))
    spawn(cases.write_pid, 2, str(tmp_path))
    assert len(set(pids())) == 1  # kept
    kept = [proc for proc, _ in dist._POOL.ranks]
    here = os.environ["PYTEST_CURRENT_TEST"]
    monkeypatch.setenv("PYTEST_CURRENT_TEST", here.replace("test_spawn_pool.py", "other.py"))
    spawn(cases.write_pid, 2, str(tmp_path))
    assert len(set(pids())) == 2  # another file: new ranks
    # the old ranks were asked to exit, not killed: a rank killed just after it reported can
    # die holding the shared outbox's write lock and block every later report (CI, stop 45)
    assert [proc.exitcode for proc in kept] == [0, 0]


def test_file_changes_in_a_row_never_block():
    """The hang CI met: ranks ended right after their report, twice in a row (each change
    starts two fresh ranks: seconds of imports, so only two)."""
    here = os.environ["PYTEST_CURRENT_TEST"]
    try:
        for i in range(2):
            os.environ["PYTEST_CURRENT_TEST"] = here.replace("test_spawn_pool.py", f"f{i}.py")
            spawn(cases.looks_fresh, 2, None, timeout=120)
    finally:
        os.environ["PYTEST_CURRENT_TEST"] = here
