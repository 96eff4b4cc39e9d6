"""Extract the runnable code examples of the documentation (README.md and docs/**/*.md).

A fenced block whose info string is ``python`` (``` or ~~~, possibly indented inside an
admonition or a list) is an example. The line ``<!-- doc-test: skip -->`` right before a
block (blank lines between are allowed) leaves that block out: for what needs torchrun, a
GPU, the network or a large model. Blocks of one page run in order in one namespace.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP = "<!-- doc-test: skip -->"
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n]*)$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    code: str
    skipped: bool


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/, sorted."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """Every fenced ``python`` block of ``page``, with whether it is marked skipped."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m["fence"], m["indent"]
        lang = m["info"].split()[0].lower() if m["info"].strip() else ""
        end = i + 1
        while end < len(lines) and not (
            lines[end].strip().startswith(fence)
            and lines[end].strip() == fence[0] * len(lines[end].strip())
        ):
            end += 1
        if lang in ("python", "py"):
            prev = next((ln.strip() for ln in reversed(lines[:i]) if ln.strip()), "")
            body = "\n".join(
                ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[i + 1 : end]
            )
            found.append(Block(page, i + 1, textwrap.dedent(body), prev == SKIP))
        i = end + 1
    return found
