"""tests/mutations.py cannot rot unseen: every mutation's code pattern occurs exactly once in
its file, changes it, and names tests that exist (issue 30: the harness once stopped at its
first moved pattern because nothing ran it). Runs no mutation: fast."""

from __future__ import annotations

import re

import pytest

from tests.mutations import MUTATIONS, ROOT, mutated_source


@pytest.mark.parametrize("m", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_pattern_occurs_once_and_changes_the_source(m):
    source = (ROOT / m.path).read_text()
    assert source.count(m.pattern) == 1, f"{m.name}: update its pattern in tests/mutations.py"
    assert mutated_source(m) != source and m.pattern != m.replacement


@pytest.mark.parametrize("m", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_listed_tests_exist(m):
    assert m.tests and m.doc
    for node in m.tests:
        path, _, name = node.partition("::")
        assert (ROOT / path).is_file(), f"{m.name}: no test file {path}"
        if name:
            bare = name.split("[")[0]
            text = (ROOT / path).read_text()
            assert re.search(rf"^def {re.escape(bare)}\(", text, re.M), f"{m.name}: {node}"


def test_names_are_unique():
    names = [m.name for m in MUTATIONS]
    assert len(names) == len(set(names))
