"""tests/mutations.py cannot rot unseen: every mutation's code pattern occurs exactly once in
the definition it names, changes it, and names tests that exist (issue 30: the harness once
stopped at its first moved pattern because nothing ran it); a function moved to another file
is still found, a missing or doubled one fails loudly (issue 41 item 6). Runs no mutation:
fast."""

from __future__ import annotations

import re

import pytest

from tests.mutations import MUTATIONS, ROOT, Mutation, locate, mutated_source


@pytest.mark.parametrize("m", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_pattern_occurs_once_and_changes_the_source(m):
    rel, at = locate(m)
    source = (ROOT / rel).read_text()
    assert source[at : at + len(m.pattern)] == m.pattern
    assert mutated_source(m)[1] != source and m.pattern != m.replacement


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


def _package(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f(x):\n    return x + 1\n\n\ndef g(x):\n    return x + 1\n")
    (pkg / "b.py").write_text(
        "class K:\n    @staticmethod\n    def h(x):\n        return x * 2\n"
    )
    return pkg


def test_the_pattern_is_looked_for_inside_its_definition_only(tmp_path):
    _package(tmp_path)
    m = Mutation("m", "pkg/a.py", "x + 1", "x - 1", ("t",), "d", where="g")
    rel, source = mutated_source(m, tmp_path)
    assert rel == "pkg/a.py"
    assert source.endswith("def g(x):\n    return x - 1\n")
    assert "def f(x):\n    return x + 1" in source
    with pytest.raises(SystemExit, match="found 2 times"):  # no `where`: the whole file
        locate(Mutation("m", "pkg/a.py", "x + 1", "x - 1", ("t",), "d"), tmp_path)


def test_a_moved_definition_is_found_and_a_missing_one_fails_loudly(tmp_path):
    pkg = _package(tmp_path)
    m = Mutation("m", "pkg/a.py", "x * 2", "x * 3", ("t",), "d", where="K.h")
    assert mutated_source(m, tmp_path) == ("pkg/b.py", (pkg / "b.py").read_text().replace("x * 2", "x * 3"))
    (pkg / "b.py").write_text("def other():\n    pass\n")
    with pytest.raises(SystemExit, match="'K.h' is defined 0 times"):
        locate(m, tmp_path)
    (pkg / "b.py").write_text("class K:\n    def h(x):\n        return x\n")
    with pytest.raises(SystemExit, match="pattern found 0 times in K.h"):
        locate(m, tmp_path)


@pytest.mark.parametrize("m", [m for m in MUTATIONS if not m.where], ids=lambda m: m.name)
def test_an_entry_without_where_is_module_level_code(m):
    """Every mutation inside a function or class names it (``where``), so a moved definition
    keeps its mutations; only module-level code is located in its whole file."""
    from tests.mutations import _definitions

    rel, at = locate(m)
    source = (ROOT / rel).read_text()
    inside = [n for n, spans in _definitions(source).items() for s, e in spans if s <= at < e]
    assert not inside, f"{m.name}: add where={max(inside, key=len)!r}"
