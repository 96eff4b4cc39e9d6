"""mkdocs hooks for the benchmarks page: its figures, which live outside docs/, and its tables.

``BENCHMARKS.md`` (included into docs/benchmarks.md by pymdownx.snippets, which runs
inside the Markdown conversion) names each figure in a paragraph with
``Plot: `benchmarks/figures/NAME.png```. :func:`on_files` adds every
``benchmarks/figures/*.png`` to the site as a generated file (nothing is copied into
docs/), and :func:`on_page_content` shows each figure below the paragraph that names it.

Its tables are wide (up to a dozen columns): material scrolls them horizontally, and
:func:`on_page_content` marks short cells (numbers, names) ``nowrap`` so that a value is
never broken over lines, and long ones ``wide`` so that prose cells keep a readable
width (docs/stylesheets/extra.css).
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
FIGURES = "benchmarks/figures"
PAGE = "benchmarks.md"
#: cells of at most NOWRAP characters never wrap; longer ones get a minimum width
NOWRAP = 24

_PARAGRAPH = re.compile(
    r"<p>(?:(?!</p>).)*?Plot: <code>(" + re.escape(FIGURES) + r"/([\w.-]+)\.png)</code>.*?</p>",
    re.DOTALL,
)
_CELL = re.compile(r"<(td|th)((?: [^>]*)?)>(.*?)</\1>", re.DOTALL)
_TAG = re.compile(r"<[^>]+>")


def on_files(files: Files, config: Any) -> Files:
    """Add the benchmark figures to the site, at ``benchmarks/figures/NAME.png``."""
    for png in sorted((ROOT / FIGURES).glob("*.png")):
        uri = f"{FIGURES}/{png.name}"
        if files.get_file_from_path(uri) is None:
            files.append(File.generated(config, uri, abs_src_path=str(png)))
    return files


def on_page_content(html_text: str, page: Any, config: Any, files: Files) -> str:
    """On the benchmarks page: each figure below the paragraph naming it; table cell classes."""
    if page.file.src_uri != PAGE:
        return html_text

    def figure(match: re.Match[str]) -> str:
        uri, name = match.groups()
        found = files.get_file_from_path(uri)
        if found is None:
            return match.group(0)
        src = html.escape(found.url_relative_to(page.file))
        alt = html.escape(name.replace("_", " "))
        return f'{match.group(0)}\n<figure><img src="{src}" alt="{alt}" loading="lazy"></figure>'

    return _CELL.sub(_cell, _PARAGRAPH.sub(figure, html_text))


def _cell(match: re.Match[str]) -> str:
    tag, attrs, content = match.groups()
    text = html.unescape(_TAG.sub("", content)).strip()
    kind = "nowrap" if len(text) <= NOWRAP else "wide"
    if "class=" in attrs:
        return match.group(0)
    return f'<{tag}{attrs} class="{kind}">{content}</{tag}>'
