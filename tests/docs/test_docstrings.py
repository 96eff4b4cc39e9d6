"""Every public object of galore2 has a docstring, and the API reference renders each one.

"Public" is the rule stated at the top of docs/api/index.md: a module's ``__all__`` where it
has one, else the names it defines (not imports) without a leading underscore. Methods are
those defined in the body of a galore2 class on a public class's MRO (torch's base classes
are not ours), except names starting with an underscore; overrides need their own docstring,
because the API reference shows an override with its own docstring only.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
API_DOCS = ROOT / "docs" / "api"

#: the documented modules; every submodule of galore2.integrations is added to them
MODULES = (
    "galore2",
    "galore2.optim",
    "galore2.projectors",
    "galore2.fsdp",
    "galore2.checkpoint",
    "galore2.integrations",
    "galore2.plan",
)


def documented_modules() -> list[str]:
    integrations = importlib.import_module("galore2.integrations")
    found = [
        f"galore2.integrations.{m.name}"
        for m in pkgutil.iter_modules(integrations.__path__)
        if not m.name.startswith("_")
    ]
    return [*MODULES, *sorted(found)]


def public_names(module: ModuleType) -> list[str]:
    """``__all__``, else the names defined in ``module`` without a leading underscore."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [
        name
        for name, obj in vars(module).items()
        if not name.startswith("_") and getattr(obj, "__module__", None) == module.__name__
    ]


def ours(obj: Any) -> bool:
    return (inspect.isclass(obj) or inspect.isfunction(obj)) and (
        obj.__module__ == "galore2" or obj.__module__.startswith("galore2.")
    )


def public_objects() -> dict[str, Any]:
    """Every public class and function, by the first public path it is reached by."""
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for name in documented_modules():
        module = importlib.import_module(name)
        for attr in public_names(module):
            obj = getattr(module, attr)
            if ours(obj) and id(obj) not in seen:
                seen.add(id(obj))
                out[f"{name}.{attr}"] = obj
    return out


def _function(member: Any) -> Any:
    """The function behind a class attribute (method, static/class method, property), or None."""
    if isinstance(member, property):
        return member.fget
    member = getattr(member, "__func__", member)
    # torch.optim.Optimizer patches a subclass's ``step`` with a profiling wrapper when the
    # first instance is built: judge the function it wraps, and only where galore2 wrote it
    member = inspect.unwrap(member) if inspect.isfunction(member) else member
    return member if inspect.isfunction(member) and ours(member) else None


def _has_doc(obj: Any) -> bool:
    return bool((getattr(obj, "__doc__", None) or "").strip())


def missing_docstrings() -> list[str]:
    offenders = [
        name for name in documented_modules() if not _has_doc(importlib.import_module(name))
    ]
    classes: dict[str, type] = {}
    for path, obj in public_objects().items():
        if not _has_doc(obj):
            offenders.append(path)
        if inspect.isclass(obj):
            for klass in obj.__mro__:
                if ours(klass):
                    classes.setdefault(f"{klass.__module__}.{klass.__qualname__}", klass)
    for path, klass in classes.items():
        fields = getattr(klass, "__dataclass_fields__", {})  # a default is not a method
        for attr, member in vars(klass).items():
            func = None if attr in fields else _function(member)
            if not attr.startswith("_") and func is not None and not _has_doc(func):
                offenders.append(f"{path}.{attr}")
    return sorted(set(offenders))


def test_every_public_object_has_a_docstring() -> None:
    offenders = missing_docstrings()
    assert not offenders, (
        f"{len(offenders)} public modules, classes, functions or methods of galore2 have no "
        "docstring (Google style: a summary line, then Args/Returns/Raises where useful):\n  "
        + "\n  ".join(offenders)
    )


#: ``::: identifier`` and the indented option lines below it
_DIRECTIVE = re.compile(r"^:::\s+(\S+)((?:\n[ \t]+\S.*)*)", re.MULTILINE)


def _resolve(identifier: str) -> Any:
    parts = identifier.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(identifier)


def rendered_objects() -> dict[int, str]:
    """id → identifier of every object a ``::: identifier`` directive of docs/api renders
    (a module directive renders its public names unless its options say ``members: false``)."""
    out: dict[int, str] = {}
    for page in sorted(API_DOCS.glob("*.md")):
        for identifier, options in _DIRECTIVE.findall(page.read_text(encoding="utf-8")):
            obj = _resolve(identifier)
            out[id(obj)] = identifier
            if inspect.ismodule(obj) and not re.search(r"\bmembers:\s*false\b", options):
                for attr in public_names(obj):
                    out.setdefault(id(getattr(obj, attr)), f"{identifier}.{attr}")
    return out


def test_api_reference_renders_every_public_object() -> None:
    rendered = rendered_objects()
    missing = [path for path, obj in public_objects().items() if id(obj) not in rendered]
    assert not missing, (
        "public classes and functions that no `::: identifier` directive of docs/api/*.md "
        "renders (add them to the page of their theme):\n  " + "\n  ".join(missing)
    )
