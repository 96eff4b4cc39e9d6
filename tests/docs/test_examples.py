"""Every runnable ```python example in README.md and docs/ runs (tests/docs/examples.py)."""

from __future__ import annotations

import os

import pytest

from .examples import ROOT, SKIP, blocks, pages

_RUNNABLE = [p for p in pages() if any(not b.skipped for b in blocks(p))]


@pytest.mark.parametrize("page", _RUNNABLE, ids=[str(p.relative_to(ROOT)) for p in _RUNNABLE])
def test_page_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    namespace: dict = {"__name__": "__doc_example__"}
    for block in blocks(page):
        if block.skipped:
            continue
        where = f"{page.relative_to(ROOT)}:{block.line}"
        try:
            exec(compile(block.code, where, "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"the example at {where} failed: {exc!r}") from exc


def test_extractor_finds_and_skips_blocks(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "text\n```python\nx = 1\n```\n" + SKIP + "\n\n```python\nraise SystemExit\n```\n"
        "!!! note\n    ```python\n    y = x + 1\n    ```\n```bash\nls\n```\n"
    )
    found = blocks(page)
    assert [(b.code.strip(), b.skipped) for b in found] == [
        ("x = 1", False),
        ("raise SystemExit", True),
        ("y = x + 1", False),
    ]


def test_there_are_examples_to_run():
    assert len(_RUNNABLE) >= 1, "no runnable example found: the extractor is broken"
    assert os.path.exists(ROOT / "mkdocs.yml")
