"""galore2's custom ops called without ``torch.library``'s per-call wrapper where nothing
needs it.

A ``torch.library.custom_op`` is what torch.compile, fake tensors, meta tensors and dispatch
modes (``benchmarks/roofline.py`` counts each op as a launch) see. But every eager call goes
through the op's Python wrapper too, which walks the tensor arguments for aliasing: with
lists of a plain group's weights, gradients and moments (204 tensors at Llama-350M), about
1.4 ms of host time per call under cProfile on an H200 machine (torch 2.11;
BENCHMARKS.md, "GPU session"), and 0.35 ms on the 2-core CPU with torch 2.13
(``python -m benchmarks.op_overhead``: 1882 µs through the op, 1527 called directly, 1358
the implementation alone). A launch-bound GPU step waits for that.

:func:`direct` returns a callable that runs the op's implementation itself when the call is
plain eager — no graph being compiled, no dispatch or torch-function mode, grad mode off,
every tensor a plain (not subclassed) tensor off the meta device — and bumps the version
counters of the arguments the op mutates (what the op's dispatch would do, so autograd
still sees those tensors as written); anything else goes through the op. The results are
the same: the same implementation runs.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

_PLAIN = (Tensor, torch.nn.Parameter)
_PLAIN_TYPES = frozenset(_PLAIN)
_IS_META = operator.attrgetter("is_meta")
_NUMBERS = (int, float)  # bool too


def _tensors(args: tuple) -> Iterator[Any]:
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from a
        elif isinstance(a, Tensor):
            yield a


def plain_eager(args: tuple) -> bool:
    """May a call with ``args`` skip the op's dispatch (see the module docstring)?"""
    if (
        torch.is_grad_enabled()
        or torch.compiler.is_compiling()
        or _get_current_dispatch_mode() is not None
        or torch._C._is_torch_function_mode_enabled()
    ):
        return False
    for a in args:  # each list walked by C-level maps (a step's lists hold hundreds)
        if isinstance(a, (list, tuple)):
            # a list of numbers (a deferred step's flag positions) holds no tensor
            ts = a if a and not isinstance(a[0], _NUMBERS) else ()
        else:
            ts = (a,) if isinstance(a, Tensor) else ()
        if not _PLAIN_TYPES.issuperset(map(type, ts)) or any(map(_IS_META, ts)):
            return False
    return True


def bump_versions(tensors: list[Tensor]) -> None:
    """Mark ``tensors`` as written in place (autograd's version counters)."""
    try:
        torch.autograd.graph.increment_version(tensors)
    except TypeError:  # a torch whose increment_version takes one tensor
        for t in tensors:
            torch.autograd.graph.increment_version(t)


def direct(op: Any, impl: Callable[..., Any], mutated: tuple[int, ...]) -> Callable[..., Any]:
    """``op`` (a custom op whose implementation is ``impl``, mutating the list or tensor
    arguments at positions ``mutated``), called directly where :func:`plain_eager`."""

    @functools.wraps(impl)
    def call(*args: Any) -> Any:
        if not plain_eager(args):
            return op(*args)
        out = impl(*args)
        bump_versions(list(_tensors(tuple(args[i] for i in mutated))))
        return out

    call.op = op  # type: ignore[attr-defined]
    return call


__all__ = ["bump_versions", "direct", "plain_eager"]
