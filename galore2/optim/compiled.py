"""``compile=True``'s machinery: a rule's dense math run through ``torch.compile``.

:func:`compiled` wraps a function in ``torch.compile(fullgraph=True, dynamic=True)`` once
per process (shared by every optimizer, and so are its graphs); :func:`run_compiled` runs
it, and falls back to the eager function for the rest of the process, with one warning,
once dynamo refuses another variant (:data:`RECOMPILE_LIMIT`). Used by Adam
(:func:`galore2.optim.adam_paths.adam_math`, ``adam_math_many``).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch

RECOMPILE_LIMIT = 64  # variants dynamo may compile per function (torch's default: 8)
_COMPILED: dict[Callable[..., Any], Callable[..., Any]] = {}
_OVER_LIMIT: set[Callable[..., Any]] = set()  # functions run eagerly from now on


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` under ``torch.compile(fullgraph=True, dynamic=True)``, created on first use and
    shared by every optimizer of the process (so its compiled graphs are too). A plain dict,
    not ``functools.cache``: an outer ``torch.compile(opt.step)`` traces this lookup."""
    out = _COMPILED.get(fn)
    if out is None:
        kwargs: dict[str, Any] = {"fullgraph": True, "dynamic": True}
        if "recompile_limit" in inspect.signature(torch.compile).parameters:  # recent torch only
            kwargs["recompile_limit"] = RECOMPILE_LIMIT
        out = _COMPILED[fn] = torch.compile(fn, **kwargs)
    return out


def run_compiled(fn: Callable[..., Any], *args: Any) -> Any:
    """``compiled(fn)(*args)``; once dynamo refuses another variant of ``fn`` (its recompile
    limit, an error under ``fullgraph``: say, more distinct foreach batch layouts than the
    limit), ``fn`` runs eagerly for the rest of the process, after one ``RuntimeWarning``.
    The refusal comes before the graph runs, so nothing was updated twice. Under an outer
    ``torch.compile`` (of ``opt.step``, say) ``fn`` is called as is: that compile traces it
    into its own graph."""
    if torch.compiler.is_compiling():
        return fn(*args)
    if fn not in _OVER_LIMIT:
        try:
            return compiled(fn)(*args)
        except Exception as err:
            if type(err).__name__ != "FailOnRecompileLimitHit":
                raise
            _OVER_LIMIT.add(fn)
            warnings.warn(
                f"galore2: torch.compile hit its recompile limit on {fn.__name__} ({err}); "
                "compile=True runs it eagerly from now on",
                RuntimeWarning,
                stacklevel=2,
            )
    return fn(*args)


__all__ = ["RECOMPILE_LIMIT", "compiled", "run_compiled"]
