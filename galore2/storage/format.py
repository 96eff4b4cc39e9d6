"""The storage formats of every tensor the optimizer keeps: one protocol for bases and moments.

A *logical* tensor (a GaLore basis, an Adam moment...) is kept in the optimizer state under
a key ``KEY``; its :class:`TensorFormat` decides which state tensors hold it (``KEY + suffix``
for each of :attr:`~TensorFormat.suffixes`), their shapes, dtypes and placement layouts for a
given logical shape (:meth:`~TensorFormat.specs` — computed from the *global* shape, so they do
not depend on the sharding and DCP checkpoints reshard), how to read it (:meth:`~TensorFormat.load`:
dense fp32; :meth:`~TensorFormat.view`: a tensor to update in place) and write it back
(:meth:`~TensorFormat.store`), and what it costs (:meth:`~TensorFormat.nbytes`).

Formats (one module each):

* :class:`FloatFormat` (this module) — the tensor itself in a float dtype: ``fp32`` / ``bf16``
  bases, and moments in the group's ``state_dtype``;
* ``int8`` / ``int4`` absmax (:mod:`galore2.storage.basis`) — blockwise symmetric codes,
  optionally Hadamard-rotated; what bases use;
* ``dynamic8`` (:mod:`galore2.storage.dynamic8`) — bitsandbytes' dynamic 8-bit blockwise
  codes; what 8-bit moments use (Adam, PNM, Adafactor: :mod:`galore2.storage.moments`).

``params`` is what a format needs besides the shape: a basis's :class:`~galore2.storage.basis.Plan`
(group size, Hadamard rotation, seed) for the absmax formats, nothing for the others.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

State = dict[str, Tensor]
#: allocates one state tensor: (global shape, dtype, placement layout) → tensor
Zeros = Callable[[tuple[int, ...], torch.dtype, str], Tensor]


@dataclass(frozen=True)
class Spec:
    """One state tensor of a format: its global shape, dtype and placement layout."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class TensorFormat:
    """How one logical tensor is stored (see the module docstring)."""

    name: ClassVar[str] = "format"
    suffixes: ClassVar[tuple[str, ...]] = ("",)  # state keys: KEY + suffix

    def specs(self, shape: tuple[int, ...], layout: str, params: Any = None) -> dict[str, Spec]:
        """suffix → the state tensor stored for a logical tensor of global ``shape``."""
        raise NotImplementedError

    def allocate(
        self,
        state: State,
        key: str,
        shape: tuple[int, ...],
        layout: str,
        zeros: Zeros,
        params: Any = None,
    ) -> None:
        """Create the (zero) state tensors of ``key`` for a logical tensor of ``shape``."""
        for suffix, spec in self.specs(tuple(shape), layout, params).items():
            state[key + suffix] = zeros(spec.shape, spec.dtype, spec.layout)

    def holds(self, state: State, key: str) -> bool:
        """Whether ``state`` holds ``key`` in this format."""
        return all(key + s in state for s in self.suffixes)

    def load(self, state: State, key: str, params: Any = None) -> Tensor | None:
        """The logical tensor as dense fp32 (None if absent); may be the stored tensor itself."""
        raise NotImplementedError

    def view(self, state: State, key: str, params: Any = None) -> Tensor:
        """A tensor to update in place and hand back to :meth:`store`: the stored tensor for
        a float format (arithmetic in its dtype), a dense fp32 copy for a quantized one."""
        out = self.load(state, key, params)
        assert out is not None, key
        return out

    def store(self, state: State, key: str, x: Tensor, params: Any = None) -> None:
        """Write the logical tensor ``x`` (nothing to do if ``x`` is the stored tensor)."""
        raise NotImplementedError

    def zero_(self, state: State, key: str) -> None:
        """Set the logical tensor to 0 (every stored tensor zeroed dequantizes to 0)."""
        for s in self.suffixes:
            state[key + s].zero_()

    def nbytes(self, shape: tuple[int, ...], layout: str = "param", params: Any = None) -> int:
        """Bytes stored for a logical tensor of global ``shape`` (all shards together)."""
        return sum(spec.nbytes for spec in self.specs(tuple(shape), layout, params).values())


class FloatFormat(TensorFormat):
    """The tensor itself, in ``dtype``, under ``KEY``."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype = name, dtype  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"FloatFormat({self.name!r}, {self.dtype})"

    def specs(self, shape: tuple[int, ...], layout: str, params: Any = None) -> dict[str, Spec]:
        return {"": Spec(tuple(shape), self.dtype, layout)}

    def load(self, state: State, key: str, params: Any = None) -> Tensor | None:
        stored = state.get(key)
        return None if stored is None else stored.float()

    def view(self, state: State, key: str, params: Any = None) -> Tensor:
        return state[key]

    def store(self, state: State, key: str, x: Tensor, params: Any = None) -> None:
        stored = state[key]
        if x is not stored:
            stored.copy_(x)


FP32 = FloatFormat("fp32", torch.float32)
BF16 = FloatFormat("bf16", torch.bfloat16)

__all__ = ["BF16", "FP32", "FloatFormat", "Spec", "TensorFormat", "Zeros"]
