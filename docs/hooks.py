"""mkdocs hooks: the benchmark figures, which live outside docs/, served with the site.

``BENCHMARKS.md`` (included into docs/benchmarks.md with pymdownx.snippets) names each
figure on a ``Plot: `benchmarks/figures/NAME.png`.`` line. :func:`on_files` adds every
``benchmarks/figures/*.png`` to the site as a generated file (nothing is copied into
docs/), and :func:`on_page_markdown` shows each figure below the line that names it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
FIGURES = "benchmarks/figures"
_PLOT = re.compile(r"^(.*Plot: `(" + re.escape(FIGURES) + r"/([\w.-]+)\.png)`.*)$", re.MULTILINE)


def on_files(files: Files, config: Any) -> Files:
    """Add the benchmark figures to the site, at ``benchmarks/figures/NAME.png``."""
    for png in sorted((ROOT / FIGURES).glob("*.png")):
        uri = f"{FIGURES}/{png.name}"
        if files.get_file_from_path(uri) is None:
            files.append(File.generated(config, uri, abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """On the benchmarks page, show each figure below the paragraph that names it."""
    if page.file.src_uri != "benchmarks.md":
        return markdown

    def figure(match: re.Match[str]) -> str:
        line, uri, name = match.groups()
        if files.get_file_from_path(uri) is None:
            return line
        alt = name.replace("_", " ")
        return f'{line}\n\n<figure markdown="span">\n  ![{alt}]({uri})\n</figure>'

    return _PLOT.sub(figure, markdown)
