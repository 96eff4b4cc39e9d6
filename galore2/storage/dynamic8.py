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

On the CPU, :func:`quantize_` and :func:`dequantize` run in torch (:func:`use_torch`),
bit-identical to bitsandbytes' CPU kernels (the same codes, absmax and dequantized
floats) and several times faster than its quantizer. That quantizer (bitsandbytes ≥ 0.50,
``csrc/cpu_ops.cpp``, ``quantize_cpu_impl``) does not pick the exact nearest code: per
block ``absmax = max |x|`` (0: codes 0), ``y = x · fl(1 / absmax)``, then a 65536-entry
table indexed by ``trunc(fma((clamp(y, −1, 1) + 1) · 0.5, 65535, 0.5))`` whose entry ``i``
counts the code midpoints below ``−1 + 2i / 65535``. As a function of the fp32 value ``y``
that is a monotone step function; :func:`_cpu_tables` reduces it, once per map, to one
entry per upper 16 bits of ``y`` (the codes at the bin's two ends and where it steps
between them, at most once per bin), so the torch path is a multiply, two gathers, a
subtraction and a few integer operations per element, in chunks of ~2^20 elements.
Dequantizing is ``code[q] · absmax`` in fp32, as bitsandbytes computes it. The torch
path is taken only where it reproduces the installed bitsandbytes (checked once per
process against it, :func:`_torch_matches_bnb`; another bitsandbytes version or an
aarch64 build, which rounds the table index differently, keeps bitsandbytes), and a
tensor with a block whose absmax is not finite or whose reciprocal overflows (absmax
below ~2.9e-39) goes to bitsandbytes too (it leaves NaN out of the absmax).

The batched 8-bit Adam step on the CPU (``foreach=True``) packs many tensors: their codes
and absmax concatenated flat in storage order, whatever their blocked axis, with an index
from each element to its block (:func:`pack_index`), both moments as the two rows of one
matrix; :func:`dequantize_packed` and :func:`quantize_packed` are the same torch path over
such a pack (the absmax by one scatter, the table lookups by one gather per table): the
same bits as per tensor, in one set of operations for the whole pack.
"""

from __future__ import annotations

import functools
import math
import sys
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
_TABLES: dict[bool, tuple[Tensor, Tensor, Tensor]] = {}  # the CPU path's (see _cpu_tables)
_LUT = 65536  # entries of bitsandbytes' CPU quantization table over [-1, 1]
_CHUNK = 1 << 20  # elements per chunk of the CPU path (bounded temporaries, few parallel ops)


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
    if use_torch(codes):
        return _dequantize_cpu(codes, absmax, dim, signed)
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
    if use_torch(codes) and _quantize_cpu(x, codes, absmax, dim, signed):
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


def use_torch(t: Tensor) -> bool:
    """Whether :func:`quantize_` and :func:`dequantize` take the torch path for the local
    tensor ``t``: on the CPU, where it reproduces the installed bitsandbytes (see the
    module docstring); elsewhere bitsandbytes (CUDA without the fused kernel)."""
    return t.device.type == "cpu" and _torch_matches_bnb()


# ---- the torch path (CPU) ----------------------------------------------------------------
def _ordered(y: Tensor) -> Tensor:
    """int64 keys of fp32 ``y`` in the order of the values (−0 and +0 share key 0)."""
    b = y.view(torch.int32).long()
    return torch.where(b >= 0, b, -(b & 0x7FFFFFFF))


def _unordered(o: Tensor) -> Tensor:
    """The fp32 values of :func:`_ordered` keys."""
    b = torch.where(o >= 0, o, (-o) | -(1 << 31))
    return b.to(torch.int32).view(torch.float32)


def _lut_index(y: Tensor) -> Tensor:
    """bitsandbytes' CPU table index of normalized fp32 values (int64):
    ``trunc(fma((clamp(y, −1, 1) + 1) · 0.5, 65535, 0.5))``, 0 for NaN (x86's conversion of
    NaN keeps 0 in the low 16 bits). The product and sum are exact in fp64, so rounding
    them once to fp32 is the fma's single rounding."""
    h = (y.clamp(-1.0, 1.0) + 1.0) * 0.5
    r = (h.double() * (_LUT - 1) + 0.5).float()
    return torch.where(torch.isnan(r), 0.0, r).long()


def _cpu_tables(signed: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The CPU path's tables for a code map: ``(below, codes2, pairs)``.

    bitsandbytes' code of a normalized fp32 ``y`` is ``lut[_lut_index(y)]``, with ``lut[i]``
    the number of code midpoints ``fl((c[k] + c[k+1]) · 0.5)`` below
    ``fl(−1 + fl(2i / 65535))`` — a monotone step function of ``y``. Its steps (≤ 255
    values, found by bisection over the ordered fp32 values in [−1, 1]) fall at most one
    per bin of fp32 values sharing their upper 16 bits, ``key``: ``codes2[2·key]`` is the
    code at the bin's low end, ``codes2[2·key + 1]`` the code at its high end and
    ``below[2·key]`` (= ``below[2·key + 1]``) the last fp32 value before the step (+inf if
    none), so the code of ``y`` is ``codes2[2·key + (y > below[2·key])]`` — and
    ``y > below`` is the sign bit of ``fl(below − y)`` (exact for finite values: a nonzero
    difference of two floats never rounds to 0, and ``b − b = +0``). NaN bins (an
    all-zero block divides 0 by 0) give code 0, as bitsandbytes' zero blocks. ``pairs``
    (int64 bit patterns of two fp32 code values) dequantizes two codes, read as one uint16,
    with one gather.
    """
    tables = _TABLES.get(signed)
    if tables is not None:
        return tables
    cpu = torch.device("cpu")
    code = dynamic_code(signed, cpu)
    mid = (code[:-1] + code[1:]) * 0.5
    i = torch.arange(_LUT, dtype=torch.float64)
    val = (2 * i / (_LUT - 1)).float() + -1.0  # fp64 then one rounding: the fp32 division
    lut = torch.searchsorted(mid, val)  # midpoints below each table value
    jumps = torch.nonzero(lut[1:] != lut[:-1]).flatten() + 1
    lo = _ordered(torch.full(jumps.shape, -1.0))
    hi = _ordered(torch.full(jumps.shape, 1.0))
    while bool((hi - lo > 1).any()):  # the first y whose index reaches each jump
        m = (lo + hi) // 2
        up = _lut_index(_unordered(m)) >= jumps
        lo, hi = torch.where(up, lo, m), torch.where(up, m, hi)
    steps = _unordered(hi).unique()  # ascending
    key = torch.arange(_LUT, dtype=torch.int64)
    bottom, top = (key << 16).to(torch.int32), ((key << 16) | 0xFFFF).to(torch.int32)
    negative = key >= 0x8000  # sign bit: the bin's values descend as its bits ascend
    low = torch.where(negative, top, bottom).view(torch.float32)
    high = torch.where(negative, bottom, top).view(torch.float32)
    nan = torch.isnan(low) | torch.isnan(high)
    first = torch.searchsorted(steps, low, right=True)  # steps in (low, high]
    inside = torch.searchsorted(steps, high, right=True) - first
    if int(inside[~nan].max()) > 1:  # cannot happen for bitsandbytes' maps
        raise RuntimeError("two code steps in one bin: the CPU tables do not apply")
    one = (inside == 1) & ~nan
    below = torch.full((_LUT,), math.inf)  # the last value before the step
    below[one] = _unordered(_ordered(steps[first[one]]) - 1)
    if bool((below[one] == 0).any()):  # cannot happen: y ≈ 0 all have fl(y + 1) = 1
        raise RuntimeError("a code step at 0: the CPU tables do not apply")
    codes2 = torch.stack((lut[_lut_index(low)], lut[_lut_index(high)]), 1)
    codes2[nan] = 0
    codes2 = codes2.to(torch.uint8).flatten()
    k = torch.arange(1 << 16)
    pairs = torch.stack((code[k & 0xFF], code[k >> 8]), 1).contiguous().view(torch.int64)
    tables = (below.repeat_interleave(2), codes2, pairs.flatten())
    _TABLES[signed] = tables
    return tables


def _parts(t: Tensor, a: Tensor, dim: int) -> list[tuple[Tensor, Tensor]]:
    """3-D views of the whole blocks and of the short last block of 2-D ``t`` (rows × cols,
    blocked along ``dim``) with the matching views of its absmax-shaped ``a``: reducing
    a block view over ``_RDIM[dim]`` (keepdim) gives the shape of its ``a`` view."""
    n = t.shape[dim]
    full, rem = divmod(n, BLOCK)
    cut = full * BLOCK
    if dim == 1:
        parts = [(t[:, :cut].view(t.shape[0], full, BLOCK), a[:, :full, None])]
        parts.append((t[:, cut:].unsqueeze(1), a[:, full:, None]))
    else:
        parts = [(t[:cut].view(full, BLOCK, t.shape[1]), a[:full, None, :])]
        parts.append((t[cut:].unsqueeze(0), a[full:, None, :]))
    return [p for p in parts if p[0].numel()] if rem else parts[:1]


_RDIM = (1, 2)  # the block axis of _parts' 3-D views, by blocked dim


def row_chunks(rows: int, cols: int, dim: int) -> list[tuple[slice, slice]]:
    """Chunks of ~2^20 elements of a ``rows × cols`` tensor blocked along ``dim``, as
    ``(rows, blocks)`` slices of its codes and of its absmax: whole rows (``dim = 1``) or
    runs of 256 rows (``dim = 0``), so :func:`quantize_` and :func:`dequantize` of a chunk
    equal the whole tensor's there. Even element counts (but the last chunk's), for the
    CPU path's two-codes gathers."""
    if dim == 0:
        step = BLOCK * max(1, _CHUNK // (BLOCK * cols))
    else:
        step = max(1, _CHUNK // cols)
        step += step & 1 and cols & 1
    out = []
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        blocks = slice(r0, r1) if dim == 1 else slice(r0 // BLOCK, -(-r1 // BLOCK))
        out.append((slice(r0, r1), blocks))
    return out


def _quantize_cpu(x: Tensor, codes: Tensor, absmax: Tensor, dim: int, signed: bool) -> bool:
    """:func:`quantize_` on the CPU in torch; False (outputs partly written) where a block's
    absmax or its reciprocal is not finite (NaN / inf inputs, absmax below ~2.9e-39 but
    not 0): bitsandbytes then quantizes the tensor."""
    below, codes2, _ = _cpu_tables(signed)
    rows = codes.shape[0]
    cols = codes.numel() // rows
    x2 = x.float().reshape(rows, cols).contiguous()
    q2 = (
        codes.view(rows, cols)
        if codes.is_contiguous()
        else torch.empty(rows, cols, dtype=torch.uint8)
    )
    a2 = (
        absmax
        if absmax.is_contiguous()
        else torch.empty_like(absmax, memory_format=torch.contiguous_format)
    )
    inv = torch.empty_like(a2)
    chunks = row_chunks(rows, cols, dim)
    size = (chunks[0][0].stop - chunks[0][0].start) * cols
    y_buf, t_buf, key_buf = (
        torch.empty(size),
        torch.empty(size),
        torch.empty(size, dtype=torch.int32),
    )
    rd = _RDIM[dim]
    for r, blocks in chunks:
        xc = x2[r]
        n = xc.numel()
        y = y_buf[:n].view(xc.shape)
        ac, ic = a2[blocks], inv[blocks]
        torch.abs(xc, out=y)
        for yp, ap in _parts(y, ac, dim):
            torch.amax(yp, rd, keepdim=True, out=ap)
        # fl(1 / absmax) (an exact division); inf for an all-zero block, whose y = 0 · inf
        # are NaN: code 0, as bitsandbytes stores there
        torch.reciprocal(ac, out=ic)
        for (xp, ip), (yp, _) in zip(_parts(xc, ic, dim), _parts(y, ac, dim), strict=True):
            torch.mul(xp, ip, out=yp)
        y, t, key = y.view(-1), t_buf[:n], key_buf[:n]
        torch.bitwise_right_shift(y.view(torch.int32), 15, out=key)
        torch.bitwise_and(key, 0x1FFFE, out=key)  # 2 · (the upper 16 bits of y)
        torch.index_select(below, 0, key, out=t)
        torch.sub(t, y, out=t)  # < 0 (sign bit set) where y is past the bin's step
        torch.bitwise_right_shift(t.view(torch.int32), 31, out=t.view(torch.int32))
        torch.sub(key, t.view(torch.int32), out=key)  # 2 · key + [y > below]
        torch.index_select(codes2, 0, key, out=q2[r].view(-1))
    # every block's absmax is 0 (all-zero block) or finite with a finite reciprocal
    # (absmax ≥ 0 or NaN, so inv + absmax < inf says both are finite)
    if not bool(((inv + a2) < math.inf).logical_or_(a2 == 0).all()):
        return False
    if q2.data_ptr() != codes.data_ptr():
        codes.copy_(q2.view(codes.shape))
    if a2 is not absmax:
        absmax.copy_(a2)
    return True


def _dequantize_cpu(codes: Tensor, absmax: Tensor, dim: int, signed: bool) -> Tensor:
    """:func:`dequantize` on the CPU in torch: ``code[q] · absmax`` in fp32."""
    _, _, pairs = _cpu_tables(signed)
    code = dynamic_code(signed, codes.device)
    rows = codes.shape[0]
    cols = codes.numel() // rows
    q2 = codes.reshape(rows, cols)
    out = torch.empty(rows, cols)
    chunks = row_chunks(rows, cols, dim)
    key_buf = torch.empty((chunks[0][0].stop - chunks[0][0].start) * cols // 2, dtype=torch.int32)
    paired = q2.is_contiguous() and q2.storage_offset() % 2 == 0
    for r, blocks in chunks:
        q, o = q2[r].reshape(-1), out[r].view(-1)
        even = q.numel() & ~1 if paired else 0
        if even:  # two codes per gather: uint16 key → the int64 bits of two fp32 values
            key = key_buf[: even // 2]
            key.copy_(q[:even].view(torch.uint16))
            torch.index_select(pairs, 0, key, out=o[:even].view(torch.int64))
        if even < q.numel():
            torch.index_select(code, 0, q[even:].to(torch.int32), out=o[even:])
        for op, ap in _parts(out[r], absmax[blocks], dim):
            op.mul_(ap)
    return out.view(codes.shape)


# ---- packed: many tensors' moments as one (rows × N) matrix (the CPU's batched path) ----
_PACKED: dict[tuple[bool, ...], tuple[Tensor, Tensor, Tensor]] = {}


@functools.lru_cache(maxsize=64)
def pack_index(layout: tuple[tuple[int, int, int], ...], rows: int = 1) -> tuple[Tensor, int]:
    """Where each element's block is, for tensors laid out flat one after another.

    ``layout``: ``(rows, cols, dim)`` of each tensor's 2-D view (dim 0 × rest) and its blocked
    axis. With the tensors' elements concatenated in storage order, and their absmax too
    (:func:`absmax_shape`, row-major), returns ``(index, blocks)``: the int64 position of each
    element's absmax in that concatenation, and its length; for ``rows`` such packs one
    after another (``rows × N`` elements, ``rows × blocks`` absmax), the index of all of
    them. Cached per layout (a batch's layout repeats every step)."""
    parts, base = [], 0
    for n, cols, dim in layout:
        r = torch.arange(n, dtype=torch.int64).view(n, 1)
        c = torch.arange(cols, dtype=torch.int64).view(1, cols)
        if dim == 1:
            nb = -(-cols // BLOCK)
            idx = r * nb + c // BLOCK
            count = n * nb
        else:
            idx = (r // BLOCK) * cols + c
            count = -(-n // BLOCK) * cols
        parts.append(idx.flatten() + base)
        base += count
    index = torch.cat(parts)
    return torch.cat([index + k * base for k in range(rows)]), base


def _packed_tables(signs: tuple[bool, ...]) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_cpu_tables`' ``below``, ``codes2`` and ``pairs`` stacked one row per packed row
    (for :func:`torch.gather` along dim 1)."""
    tables = _PACKED.get(signs)
    if tables is None:
        rows = [_cpu_tables(s) for s in signs]
        tables = tuple(torch.stack(t).contiguous() for t in zip(*rows, strict=True))
        _PACKED[signs] = tables  # type: ignore[assignment]
    return tables  # type: ignore[return-value]


@functools.cache
def _absmax_bounds() -> Tensor:
    """Bucket bounds of an absmax for :func:`torch.bucketize` (``right=True``): 0 → 0, a
    positive value whose reciprocal overflows → 1, one whose reciprocal is finite → 2,
    +inf → 3, NaN → 3; an odd bucket is a block :func:`quantize_`'s torch path leaves to
    bitsandbytes."""
    lo, hi = 1, 0x7F7FFFFF  # bit patterns: the smallest positive float, the largest
    while hi - lo > 1:  # the smallest float with a finite reciprocal
        mid = (lo + hi) // 2
        x = torch.tensor([mid], dtype=torch.int32).view(torch.float32)
        lo, hi = (lo, mid) if bool(torch.isfinite(torch.reciprocal(x))) else (mid, hi)
    bounds = torch.tensor([1, hi, 0x7F800000], dtype=torch.int32)
    return bounds.view(torch.float32)


def dequantize_packed(
    codes: Tensor, absmax: Tensor, index: Tensor, signs: tuple[bool, ...]
) -> Tensor:
    """fp32 values of packed CPU ``codes`` (``len(signs)`` × N uint8, row ``i`` in the map
    ``signs[i]``) with their flat ``absmax`` (:func:`pack_index`'s ``index`` for that many
    rows): ``code[q] · absmax``, as :func:`dequantize` computes it per tensor — the same
    bits, four operations for all rows."""
    _, _, pairs = _packed_tables(signs)
    if codes.shape[1] % 2 == 0:  # two codes per gather: uint16 → the bits of two fp32 values
        key = codes.view(torch.uint16).to(torch.int64)
        out = torch.gather(pairs, 1, key).view(torch.float32)
    else:
        cpu = torch.device("cpu")
        code = torch.stack([dynamic_code(s, cpu) for s in signs])
        out = torch.gather(code, 1, codes.to(torch.int64))
    return out.mul_(torch.index_select(absmax, 0, index).view(out.shape))


def quantize_packed(
    x: Tensor, index: Tensor, blocks: int, signs: tuple[bool, ...]
) -> tuple[Tensor, Tensor] | None:
    """``(codes, absmax)`` of packed fp32 ``x`` (rows × N, row ``i`` in the map ``signs[i]``;
    :func:`pack_index`'s ``index`` and ``blocks`` for that many rows; absmax flat):
    :func:`quantize_`'s torch path for all rows at once, the same bits; None where a
    block's absmax or its reciprocal is not finite (the caller then quantizes per tensor,
    where bitsandbytes takes such a tensor)."""
    below, codes2, _ = _packed_tables(signs)
    rows, n = x.shape
    y = torch.abs(x)
    absmax = torch.zeros(rows * blocks).scatter_reduce_(0, index, y.view(-1), "amax")
    if bool(torch.bucketize(absmax, _absmax_bounds(), right=True).bitwise_and_(1).any()):
        return None
    inv = torch.reciprocal(absmax)  # inf for an all-zero block: its y are NaN, code 0
    torch.mul(x, torch.index_select(inv, 0, index).view(rows, n), out=y)
    key = torch.empty(rows, n, dtype=torch.int64)  # gather's index type
    torch.bitwise_right_shift(y.view(torch.int32), 15, out=key)
    key.bitwise_and_(0x1FFFE)  # 2 · (the upper 16 bits of y)
    t = torch.gather(below, 1, key).sub_(y)  # < 0 (sign bit set) where y is past the step
    key.sub_(torch.bitwise_right_shift(t.view(torch.int32), 31))  # 2 · key + [y > below]
    return torch.gather(codes2, 1, key), absmax


@functools.cache
def _torch_matches_bnb() -> bool:
    """Whether the torch path reproduces the installed bitsandbytes' CPU kernels, checked
    once per process: both maps, every normalized value within 3 ulps of a code step of
    :func:`_cpu_tables`, both ends of every table bin in [−1, 1], ±0, ±1, and
    dequantization of every code at a few scales (little-endian machines only)."""
    if sys.byteorder != "little":
        return False
    bnb_f = bnb_functional()
    for signed in (True, False):
        below = _cpu_tables(signed)[0][::2]
        code = dynamic_code(signed, torch.device("cpu"))
        steps = _ordered(below[torch.isfinite(below)])
        near = torch.cat([steps + d for d in range(-3, 5)])
        key = torch.arange(_LUT, dtype=torch.int64)
        edges = torch.cat((key << 16, (key << 16) | 0xFFFF)).to(torch.int32).view(torch.float32)
        edges = edges[edges.abs() <= 1]
        y = torch.cat((_unordered(near), edges, torch.tensor([0.0, -0.0, 1.0, -1.0])))
        y = y[y.abs() <= 1]
        y = torch.cat((y, y.new_zeros(-y.numel() % (BLOCK - 1)))).view(-1, BLOCK - 1)
        x = torch.cat((torch.ones(y.shape[0], 1), y), 1)  # absmax 1: y is the normalized value
        want, state = bnb_f.quantize_blockwise(x.flatten(), code=code, blocksize=BLOCK)
        got = torch.empty_like(x, dtype=torch.uint8)
        absmax = torch.empty(x.shape[0], 1)
        if not _quantize_cpu(x, got, absmax, 1, signed):
            return False
        if not (torch.equal(got.flatten(), want) and torch.equal(absmax.flatten(), state.absmax)):
            return False
        q = torch.arange(4 * BLOCK, dtype=torch.int64).remainder(256).to(torch.uint8)
        scale = torch.tensor([0.0, 1.0, 3.0e-5, 7.0e21])
        want = bnb_f.dequantize_blockwise(q, absmax=scale, code=code, blocksize=BLOCK)
        got = _dequantize_cpu(q.view(4, BLOCK), scale.view(4, 1), 1, signed)
        if not torch.equal(got.flatten().view(torch.int32), want.view(torch.int32)):
            return False
    return True


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
    "dequantize_packed",
    "dynamic_code",
    "pack_index",
    "quantize_",
    "quantize_packed",
    "row_chunks",
    "use_torch",
]
