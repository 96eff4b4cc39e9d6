"""bitsandbytes' dynamic 8-bit blockwise format (``dynamic8``): what 8-bit moments use.

A logical tensor ``KEY`` of global shape ``shape`` is stored as

* ``KEY`` — uint8 codes at the tensor's exact shape (indices into bitsandbytes'
  ``create_dynamic_map``: the signed map for first moments, the unsigned one for second
  moments — two format instances, :data:`DYNAMIC8` and :data:`UDYNAMIC8`);
* ``KEY.absmax`` — one fp32 absmax per block of at most 256 elements;
* the blocked axis, an int64 scalar on the CPU, under ``KEY.block_dim`` — or under the
  key given as ``params``: a module whose moments share shape and layout (Adam, PNM)
  keeps one record for all of them (``adam.block_dim``).

Block layout (sharding-independent, so DCP checkpoints reshard): the tensor is viewed as
2-D (dim 0 × rest) and blocks run along the axis that is never sharded under FSDP —

* layouts ``"param"``, ``"rows"`` and ``"replicate"``: each row is split into
  ``ceil(cols / 256)`` blocks; absmax has shape ``(rows, ceil(cols / 256))`` and is
  sharded by rows like the codes;
* layout ``"cols"`` (GaLore's left-side r×n, sharded by columns): each column is split
  along dim 0; absmax has shape ``(ceil(rows / 256), cols)``, sharded by columns.

A row (column) shorter than 256 is one short block: 256 elements cost ~1.016 bytes per
element, 128 ~1.03, 8 1.5. Codes are stored at the exact shape (blocks are padded only
transiently, to call bitsandbytes). :func:`block_dim` is the small-tensor rule: tensors
with fewer than 4096 elements (bitsandbytes' ``min_8bit_size``, judged by the *global*
shape), 1-D tensors and tensors whose blocked axis has a single element are not blocked
(their modules keep them in a :class:`~galore2.storage.format.FloatFormat`).

bitsandbytes is imported lazily (:func:`bnb_functional`); it only ever sees plain local
tensors. Its code maps are constants cached per device, not state.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.state import counter
from ..fsdp.detect import is_dtensor
from .format import Spec, State, TensorFormat, Zeros

BLOCK = 256  # elements per quantization block (bitsandbytes' 8-bit optimizers use 256)
MIN_8BIT_SIZE = 4096  # smaller directions keep fp32 moments (bitsandbytes' min_8bit_size)

_CODES: dict[tuple[str, bool], Tensor] = {}
_BOUNDS: dict[tuple[str, bool], Tensor] = {}


def bnb_functional() -> Any:
    """``bitsandbytes.functional``, imported on first use."""
    try:
        import bitsandbytes.functional as bnb_f
    except ImportError as err:
        raise ImportError(
            "8-bit moments (GaLoreAdamW8bit, ScaleByAdam8bit, moments_8bit) need "
            "bitsandbytes: "
            "pip install bitsandbytes"
        ) from err
    return bnb_f


def dynamic_code(signed: bool, device: torch.device) -> Tensor:
    """bitsandbytes' 8-bit dynamic code map (256 sorted fp32 values), cached per device."""
    key = (str(device), signed)
    code = _CODES.get(key)
    if code is None:
        code = bnb_functional().create_dynamic_map(signed=signed).to(device)
        _CODES[key] = code
    return code


def code_bounds(signed: bool, device: torch.device) -> Tensor:
    """The 256 decision bounds of :func:`dynamic_code` (midpoints, then +inf) that the fused
    kernel's nearest-code search reads, cached per device."""
    key = (str(device), signed)
    bounds = _BOUNDS.get(key)
    if bounds is None:
        code = dynamic_code(signed, device)
        mid = (code[:-1] + code[1:]) / 2
        bounds = torch.cat((mid, mid.new_full((1,), math.inf))).float().contiguous()
        _BOUNDS[key] = bounds
    return bounds


def block_dim(shape: torch.Size | tuple[int, ...], layout: str) -> int | None:
    """The axis of the 2-D view (dim 0 × rest) that blocks run along; None keeps fp32."""
    numel = math.prod(shape)
    if len(shape) < 2 or numel < MIN_8BIT_SIZE:
        return None
    dim = 0 if layout == "cols" else 1
    length = shape[0] if dim == 0 else numel // shape[0]
    return dim if length > 1 else None


def absmax_shape(shape: torch.Size | tuple[int, ...], dim: int) -> tuple[int, int]:
    rows = int(shape[0])
    cols = math.prod(shape) // rows
    if dim == 1:
        return rows, -(-cols // BLOCK)
    return -(-rows // BLOCK), cols


def _bnb_blocksize(length: int) -> int:
    """bitsandbytes' block size for rows of ``length``: 256, or, for a row that is a single
    short block, the smallest size ≥ it that bitsandbytes supports on every device (64,
    128) — the same blocks, with less transient padding."""
    if length >= BLOCK:
        return BLOCK
    return max(64, 1 << (length - 1).bit_length())


def _local(t: Tensor) -> Tensor:
    return t.to_local() if is_dtensor(t) else t


def _blocked(x: Tensor, dim: int) -> Tensor:
    """A 2-D (dim 0 × rest) view of ``x`` with the blocked axis last (transposed for dim 0)."""
    x = x.reshape(x.shape[0], -1)
    return x.mT if dim == 0 else x


def dequantize(codes: Tensor, absmax: Tensor, dim: int, signed: bool) -> Tensor:
    """fp32 values of local ``codes`` (any shape) with their ``absmax`` (see :func:`absmax_shape`)."""
    codes, absmax = _local(codes), _local(absmax)
    if codes.numel() == 0:
        return torch.zeros(codes.shape, dtype=torch.float32, device=codes.device)
    q = _blocked(codes, dim)
    scale = absmax.mT if dim == 0 else absmax
    length, size = q.shape[1], _bnb_blocksize(q.shape[1])
    padded = scale.shape[1] * size
    if padded != length:
        q = F.pad(q, (0, padded - length))
    out = bnb_functional().dequantize_blockwise(
        q.contiguous(),
        absmax=scale.contiguous().view(-1),
        code=dynamic_code(signed, codes.device),
        blocksize=size,
    )
    out = out[:, :length]
    return (out.mT if dim == 0 else out).reshape(codes.shape)


def quantize_(x: Tensor, codes: Tensor, absmax: Tensor, dim: int, signed: bool) -> None:
    """Store fp32 ``x`` (the shape of local ``codes``) into ``codes`` and ``absmax``."""
    codes, absmax = _local(codes), _local(absmax)
    if codes.numel() == 0:
        return
    v = _blocked(x.float(), dim)
    length, size = v.shape[1], _bnb_blocksize(v.shape[1])
    blocks = -(-length // size)
    if blocks * size != length:
        v = F.pad(v, (0, blocks * size - length))
    q, qstate = bnb_functional().quantize_blockwise(
        v.contiguous(), code=dynamic_code(signed, codes.device), blocksize=size
    )
    q, scale = q[:, :length], qstate.absmax.view(-1, blocks)
    if dim == 0:
        q, scale = q.mT, scale.mT
    codes.copy_(q.reshape(codes.shape))
    absmax.copy_(scale)


def axis_key(key: str, params: Any = None) -> str:
    """Where the blocked axis of ``key`` is recorded: ``params`` if it names a key."""
    return params if isinstance(params, str) else key + ".block_dim"


class Dynamic8Format(TensorFormat):
    """bitsandbytes' dynamic 8-bit blockwise codes (see the module docstring)."""

    suffixes = ("", ".absmax")

    def __init__(self, signed: bool) -> None:
        self.signed = signed
        self.name = "dynamic8" if signed else "udynamic8"  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"Dynamic8Format(signed={self.signed})"

    def specs(self, shape: tuple[int, ...], layout: str, params: Any = None) -> dict[str, Spec]:
        dim = block_dim(shape, layout)
        if dim is None:
            raise ValueError(f"a {tuple(shape)} tensor ({layout!r}) is not stored 8-bit")
        return {
            "": Spec(tuple(shape), torch.uint8, layout),
            ".absmax": Spec(absmax_shape(shape, dim), torch.float32, layout),
        }

    def allocate(
        self,
        state: State,
        key: str,
        shape: tuple[int, ...],
        layout: str,
        zeros: Zeros,
        params: Any = None,
    ) -> None:
        super().allocate(state, key, shape, layout, zeros, params)
        dim = block_dim(tuple(shape), layout)
        axis = axis_key(key, params)
        if axis in state and int(state[axis]) != dim:
            raise ValueError(f"{key!r} is blocked along dim {dim}, {axis!r} records another")
        state[axis] = counter(dim)  # type: ignore[arg-type]

    def load(self, state: State, key: str, params: Any = None) -> Tensor | None:
        if key not in state:
            return None
        dim = int(state[axis_key(key, params)])
        return dequantize(state[key], state[key + ".absmax"], dim, self.signed)

    def store(self, state: State, key: str, x: Tensor, params: Any = None) -> None:
        dim = int(state[axis_key(key, params)])
        quantize_(x, state[key], state[key + ".absmax"], dim, self.signed)

    def zero_(self, state: State, key: str) -> None:
        state[key].zero_()  # codes and absmax 0 dequantize to 0
        state[key + ".absmax"].zero_()

    # ---- what the fused 8-bit Adam kernel reads ----------------------------------
    def local(self, state: State, key: str, params: Any = None) -> tuple[Tensor, Tensor, int]:
        """(local codes, local absmax, blocked axis) of ``key``."""
        dim = int(state[axis_key(key, params)])
        return _local(state[key]), _local(state[key + ".absmax"]), dim

    def code(self, device: torch.device) -> Tensor:
        return dynamic_code(self.signed, device)

    def bounds(self, device: torch.device) -> Tensor:
        return code_bounds(self.signed, device)


DYNAMIC8 = Dynamic8Format(signed=True)  # first moments
UDYNAMIC8 = Dynamic8Format(signed=False)  # second moments (non-negative)

__all__ = [
    "BLOCK",
    "DYNAMIC8",
    "MIN_8BIT_SIZE",
    "UDYNAMIC8",
    "Dynamic8Format",
    "absmax_shape",
    "axis_key",
    "block_dim",
    "bnb_functional",
    "code_bounds",
    "dequantize",
    "dynamic_code",
    "quantize_",
]
