"""How a moment module (Adam, PNM, Adafactor) stores its moments: a format per moment.

A moment module is constructed with a moment storage choice, ``moments``:

* ``"state_dtype"`` (the default) — every moment is a :class:`~galore2.storage.format.FloatFormat`
  tensor in the group's ``state_dtype`` and is updated in that dtype;
* ``"dynamic8"`` — moments of large tensors are stored in bitsandbytes' dynamic 8-bit
  blockwise format (:mod:`galore2.storage.dynamic8`; the signed map for first moments, the
  unsigned one for second moments): each step dequantizes them to fp32, updates them and
  quantizes them back. Tensors the small-tensor rule excludes
  (:func:`~galore2.storage.dynamic8.block_dim`: under 4096 elements, 1-D, a one-element
  blocked axis) keep ``state_dtype`` moments, with the same state keys and results as
  ``"state_dtype"``.

The blocked axis of 8-bit moments is recorded once per module and tensor when its moments
share shape and layout (``axis``: ``"adam.block_dim"``, ``"pnm.block_dim"``), else per
moment (``KEY.block_dim``, Adafactor's factors). The choice is made per tensor at ``init``
(:func:`moment_format`); afterwards the state
itself says how a moment is stored (:func:`stored_format`: codes come with ``KEY.absmax``),
so ``update``, ``reset``, ``rotate`` and a resumed checkpoint need nothing else.

:data:`MOMENTS_8BIT` is the preset switch that picks ``"dynamic8"`` (Ranger21, GaLoreAdafactor).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import Tensor

from ..core.options import Bool, Option
from .dtype import STATE_DTYPES
from .dynamic8 import DYNAMIC8, UDYNAMIC8, block_dim, bnb_functional
from .format import FloatFormat, State, TensorFormat

MOMENT_FORMATS = ("state_dtype", "dynamic8")

MOMENTS_8BIT = Option(
    "moments_8bit",
    False,
    Bool(),
    "store the moments of tensors with ≥ 4096 elements 8-bit blockwise (bitsandbytes' "
    "dynamic map, ~1 byte per element; needs bitsandbytes)",
    resumable=False,
)

_FLOATS = {name: FloatFormat(name, dtype) for name, dtype in STATE_DTYPES.items()}


def check_moments(moments: str) -> str:
    """Validate a moment storage choice (``dynamic8`` needs bitsandbytes: fail at construction)."""
    if moments not in MOMENT_FORMATS:
        raise ValueError(f"moments must be one of {MOMENT_FORMATS}, got {moments!r}")
    if moments == "dynamic8":
        bnb_functional()
    return moments


def moments_capture_problem(moments: str, rule: str) -> str | None:
    """Why ``rule``'s step cannot replay from a CUDA graph because of its moment storage
    (None: it can): 8-bit moments quantize through host-side paths."""
    if moments == "state_dtype":
        return None
    return f"{rule}'s 8-bit moments are not captured (their quantizers read the host)"


def moment_format(
    moments: str, shape: tuple[int, ...], layout: str, state_dtype: str, signed: bool
) -> TensorFormat:
    """The format of one moment of a tensor of global ``shape`` laid out per ``layout``."""
    if moments == "dynamic8" and block_dim(tuple(shape), layout) is not None:
        return DYNAMIC8 if signed else UDYNAMIC8
    return _FLOATS[state_dtype]


def stored_format(state: State, key: str, signed: bool) -> TensorFormat:
    """The format ``key`` is stored in (the float formats share :meth:`view`/:meth:`store`)."""
    if key + ".absmax" in state:
        return DYNAMIC8 if signed else UDYNAMIC8
    return _FLOATS["float32"]


def is_quantized(state: State, key: str) -> bool:
    return key + ".absmax" in state


def moment_kinds(*keys: str, axis: str | None = None) -> dict[str, str]:
    """State-accounting kinds of moments ``keys`` in any moment format."""
    kinds = {}
    for key in keys:
        kinds[key] = kinds[key + ".absmax"] = "moments"
        kinds[axis or key + ".block_dim"] = "other"
    return kinds


def reset_moments(state: State, keys: Iterable[str]) -> None:
    """Zero the moments ``keys`` that ``state`` holds, whatever their format."""
    for key in keys:
        if key in state:
            stored_format(state, key, True).zero_(state, key)


def rotate_moments(
    state: State,
    linear: Iterable[str],
    quadratic: Iterable[str],
    rotate_fn: Callable[[Tensor, bool], Tensor],
    axis: str | None = None,
) -> None:
    """Transform.rotate over moments in any format: dequantize, rotate (second moments with
    squared coefficients, clamped at 0), store back."""
    for key, squared in (*((k, False) for k in linear), *((k, True) for k in quadratic)):
        if key not in state:
            continue
        fmt = stored_format(state, key, not squared)
        x = fmt.view(state, key, axis)
        rotated = rotate_fn(x, squared)
        x.copy_(rotated.clamp_(min=0) if squared else rotated)
        fmt.store(state, key, x, axis)


__all__ = [
    "MOMENTS_8BIT",
    "MOMENT_FORMATS",
    "check_moments",
    "is_quantized",
    "moment_format",
    "moment_kinds",
    "reset_moments",
    "rotate_moments",
    "stored_format",
]
