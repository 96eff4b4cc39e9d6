"""A griffe extension for the API reference: galore2's docstrings, as mkdocstrings shows them.

galore2's docstrings cross-reference with Sphinx roles (``:class:`~galore2.GaLoreAdamW```,
``:meth:`step```) and document attributes with ``#:`` comments, neither of which Markdown
or griffe understands. Once the package is loaded this extension

* turns every role into an *optional* autorefs link to the object's canonical path (a
  link when the object is rendered somewhere in the site, plain code otherwise, never a
  broken reference); relative names are looked up from the object outward;
* gives an attribute without a docstring the ``#:`` comment lines right above it;
* drops the reStructuredText literal-block marker (``text::`` before an indented block).

Loaded by mkdocstrings (``extensions:`` in mkdocs.yml); not part of the package.
"""

from __future__ import annotations

import html
import re
from functools import partial
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(class|meth|func|mod|attr|data|exc|obj):`(~?)([^`]+)`")
_TITLED = re.compile(r"^(.*?)\s*<([^>]+)>$")
_LITERAL = re.compile(r"(\S)::(\n\s*\n)")
_COMMENT = re.compile(r"^\s*#:\s?(.*)$")


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles and ``#:`` comments of every object of a loaded package."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        for obj in _walk(pkg):
            if obj.is_attribute and obj.docstring is None:
                _comment_docstring(obj)
            if obj.docstring is not None:
                text = _ROLE.sub(partial(_link, obj=obj, loader=loader), obj.docstring.value)
                obj.docstring.value = _LITERAL.sub(r"\1:\2", text)


def _walk(obj: griffe.Object) -> Any:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)


def _comment_docstring(attr: griffe.Object) -> None:
    """The ``#:`` comment lines right above ``attr`` become its docstring."""
    try:
        lines = attr.lines_collection[attr.filepath]
    except (KeyError, TypeError):
        return
    if not lines or not attr.lineno:
        return
    found: list[str] = []
    index = attr.lineno - 2  # the line above the assignment (linenos start at 1)
    while index >= 0 and (match := _COMMENT.match(lines[index])):
        found.insert(0, match.group(1))
        index -= 1
    if found:
        attr.docstring = griffe.Docstring("\n".join(found), parent=attr)


def _resolve(name: str, obj: griffe.Object, loader: griffe.GriffeLoader) -> str | None:
    """The canonical path ``name`` refers to from ``obj``, or None when it is not found."""
    scopes: list[griffe.Object] = []
    scope: griffe.Object | None = obj
    while scope is not None:
        scopes.append(scope)
        scope = scope.parent
    candidates = [f"{s.path}.{name}" for s in scopes] + [name]
    for path in candidates:
        try:
            found = loader.modules_collection[path]
            return found.canonical_path
        except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            continue
    return None


def _link(match: re.Match[str], *, obj: griffe.Object, loader: griffe.GriffeLoader) -> str:
    _, tilde, target = match.groups()
    title = None
    if titled := _TITLED.match(target):
        title, target = titled.groups()
    target = target.strip().lstrip(".").removesuffix("()")
    shown = title or (target.rsplit(".", 1)[-1] if tilde else target)
    path = _resolve(target, obj, loader)
    code = f"<code>{html.escape(shown)}</code>"
    if path is None:
        return code
    return f'<autoref identifier="{html.escape(path)}" optional>{code}</autoref>'
