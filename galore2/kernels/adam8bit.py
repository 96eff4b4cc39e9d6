"""Fused 8-bit Adam step (Triton): dequantize → Adam moment update → direction → requantize.

One pass over the direction replaces :class:`~galore2.optim.adam.ScaleByAdam`'s 8-bit
torch path (``dequantize`` of both moments, ``ScaleByAdam.update``, ``quantize_`` of
both), with the same arithmetic, for a direction ``g`` viewed 2-D as
``rows = shape[0]`` × ``cols = numel / rows``. Per element, with ``t`` the step
after the increment, ``bc1 = 1 − β₁ᵗ`` and ``bc2 = 1 − β₂ᵗ``::

    m = code_s[qm] · absmax_m[block]        v = code_u[qv] · absmax_v[block]
    m ← lerp(m, g, 1 − β₁)                  v ← β₂·v + (1 − β₂)·g²
    direction = m / (√v · (bc1 / √bc2) + bc1·eps)        (= m̂ / (√v̂ + eps))

then each block gets ``absmax = max |x|`` of its new moment and every element the
index of the code value nearest ``x / absmax`` — the semantics of bitsandbytes'
``quantize_blockwise`` — found by a binary search over the 255 midpoints between the
sorted code values (ties to the lower code); an all-zero block stores absmax 0 and code
0 (as bitsandbytes' CPU quantizer does). ``code_s`` / ``code_u`` are bitsandbytes'
signed / unsigned dynamic maps.

Blocks (see :mod:`galore2.storage.dynamic8`) hold ``BLOCK = 256`` consecutive elements
of the blocked axis of the 2-D view, the last one per row (column) shorter:

* ``dim = 1`` — along each row; absmax is ``(rows, ceil(cols / 256))``;
* ``dim = 0`` — along each column; absmax is ``(ceil(rows / 256), cols)``.

Memory traffic per element: the direction in (its dtype's bytes), 2 code bytes in
and 2 out, the fp32 direction out (4 bytes), plus 4 × 4 bytes of absmax per block
(~0.06 bytes per element) and L1/L2-resident code maps — 12 bytes per element for an
fp32 direction, where the torch path moves each moment through fp32 temporaries
several times.

Each program owns ``OTHER`` whole blocks (one per row for ``dim = 1``, per column for
``dim = 0``), so a block is read and written by one program: the kernel may update
codes and absmax in place.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dispatch import launch_device
from .keep import check, pointer, positions
from .rounding import to_bf16

QBLOCK = 256  # elements per quantization block (galore2.storage.dynamic8.BLOCK)


@triton.jit
def _nearest_code(x, absmax, bounds_ptr):
    """Index of the code value nearest ``x / absmax``: the number of decision bounds
    strictly below it, found by an 8-step branchless binary search. Code 0 where absmax
    is 0 (an all-zero block; bitsandbytes stores 0 there too), which dequantizes to 0."""
    live = absmax > 0
    y = tl.div_rn(x, tl.where(live, absmax, 1.0))
    idx = tl.zeros(y.shape, dtype=tl.int32)
    for s in tl.static_range(8):  # steps of 128, 64, ..., 1
        probe = tl.load(bounds_ptr + idx + ((128 >> s) - 1))
        idx = tl.where(probe < y, idx + (128 >> s), idx)
    return tl.where(live, idx, 0)


@triton.jit
def _adam8bit_kernel(
    g_ptr,
    out_ptr,
    qm_in,
    am_in,
    qv_in,
    av_in,
    qm_out,
    am_out,
    qv_out,
    av_out,
    code_m,
    code_v,
    bounds_m,
    bounds_v,
    n_other,
    length,
    n_blocks,
    n_tiles,
    g_s_mat,
    s_mat,
    a_s_mat,
    g_s_other,
    g_s_block,
    s_other,
    s_block,
    a_s_other,
    a_s_block,
    w1,
    beta2,
    w2,
    c1,
    c2,
    p_ptr,  # UPDATE: the bf16 weight (codes' layout), p ← p·decay − lr·direction
    decay,
    neg_lr,
    keep_ptr,  # HAS_KEEP: matrix j's flag is keep[at[j]] (keep[j] without HAS_AT): 0, unwritten
    at_ptr,
    LERP_LOW: tl.constexpr,
    OTHER: tl.constexpr,
    QB: tl.constexpr,
    OUT_BF16: tl.constexpr,
    UPDATE: tl.constexpr,
    DECAY: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    HAS_AT: tl.constexpr,
):
    # The tile is OTHER blocks × QB elements: axis 0 across rows (dim 1) or columns
    # (dim 0), axis 1 along the blocked axis, block pid_b of it. A 1-D grid (the y and z
    # grid axes are limited to 65535 programs), consecutive programs along the blocks; a
    # stack of matrices: n_tiles programs per matrix, matrix after matrix (strides *_s_mat).
    pid = tl.program_id(0)
    mat = (pid // n_tiles).to(tl.int64)
    pid = pid % n_tiles
    pid_o = pid // n_blocks
    pid_b = pid % n_blocks
    o = (pid_o * OTHER + tl.arange(0, OTHER)).to(tl.int64)
    k = (pid_b * QB + tl.arange(0, QB)).to(tl.int64)
    if HAS_KEEP:  # a flagged-out matrix: nothing of it is read or written
        flag_at = tl.load(at_ptr + mat) if HAS_AT else mat
        n_other = tl.where(tl.load(keep_ptr + flag_at) != 0, n_other, 0)
    o_ok = o < n_other
    mask = o_ok[:, None] & (k < length)[None, :]
    offs = mat * s_mat + o[:, None] * s_other + k[None, :] * s_block
    a_offs = mat * a_s_mat + o * a_s_other + pid_b * a_s_block

    g_offs = mat * g_s_mat + o[:, None] * g_s_other + k[None, :] * g_s_block
    g = tl.load(g_ptr + g_offs, mask=mask, other=0.0)
    g = g.to(tl.float32)
    qm = tl.load(qm_in + offs, mask=mask, other=0).to(tl.int32)
    qv = tl.load(qv_in + offs, mask=mask, other=0).to(tl.int32)
    m = tl.load(code_m + qm) * tl.load(am_in + a_offs, mask=o_ok, other=0.0)[:, None]
    v = tl.load(code_v + qv) * tl.load(av_in + a_offs, mask=o_ok, other=0.0)[:, None]

    # torch.lerp's two formulas (weight below / from 0.5), as ScaleByAdam's lerp_
    d = g - m
    m = m + w1 * d if LERP_LOW else g - d * (1.0 - w1)
    v = v * beta2 + w2 * g * g  # mul_(β₂).addcmul_(g, g, value=1 − β₂)
    denom = tl.sqrt_rn(v) * c1 + c2
    d = tl.div_rn(m, denom)
    if UPDATE:  # AdamW's weight update, as galore2.kernels.adamw writes it
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        if DECAY:  # its own rounding to bf16, as the separate multiply
            p = to_bf16(p.to(tl.float32) * decay)
        tl.store(p_ptr + offs, to_bf16(tl.fma(neg_lr, d, p.to(tl.float32))), mask=mask)
    elif OUT_BF16:
        tl.store(out_ptr + offs, to_bf16(d), mask=mask)
    else:
        tl.store(out_ptr + offs, d, mask=mask)

    m = tl.where(mask, m, 0.0)  # padding must not raise a block's absmax
    v = tl.where(mask, v, 0.0)
    m_max = tl.max(tl.abs(m), axis=1)
    v_max = tl.max(v, axis=1)
    tl.store(am_out + a_offs, m_max, mask=o_ok)
    tl.store(av_out + a_offs, v_max, mask=o_ok)
    qm = _nearest_code(m, m_max[:, None], bounds_m)
    qv = _nearest_code(v, v_max[:, None], bounds_v)
    tl.store(qm_out + offs, qm.to(tl.uint8), mask=mask)
    tl.store(qv_out + offs, qv.to(tl.uint8), mask=mask)


def _tile(length: int, dim: int) -> tuple[int, int, int]:
    """(QB, OTHER, num_warps): QB covers one block (a short row's whole block when the
    blocked axis is under 256) and each thread ~8 elements (sm_90: ~65 registers for dim 1,
    ~105 for dim 0, no spills). Dim 1 tiles are contiguous along the block; dim 0 tiles
    span ≥ 16 columns (16-byte runs of codes, 64 of an fp32 direction)."""
    qb = QBLOCK if length >= QBLOCK else triton.next_power_of_2(length)
    if dim == 1:
        return qb, max(1, 1024 // qb), 4
    return qb, max(16, 4096 // qb), 16


def adam8bit_step(
    g: Tensor,
    m_codes: Tensor,
    m_absmax: Tensor,
    v_codes: Tensor,
    v_absmax: Tensor,
    *,
    dim: int,
    code_m: Tensor,
    code_v: Tensor,
    bounds_m: Tensor,
    bounds_v: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    out: Tensor | None = None,
    into: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
) -> Tensor:
    """One fused 8-bit Adam step on direction ``g`` (any float dtype); returns the fp32
    direction (``out`` when given, the shape of ``g``).

    ``m_codes`` / ``v_codes`` (uint8, the shape of ``g``) and ``m_absmax`` / ``v_absmax``
    (fp32, see the module docstring) are updated in place, or written to ``into`` =
    (m_codes, m_absmax, v_codes, v_absmax) when given (the inputs are then only read).
    ``code_*`` are the 256-value dynamic maps (signed for m, unsigned for v), ``bounds_*``
    their decision bounds (:func:`galore2.storage.dynamic8.code_bounds`); ``step`` counts
    this step (t ≥ 1). Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.
    """
    if g.dim() < 1 or g.numel() == 0:
        raise ValueError(f"the direction must be a non-empty tensor, got shape {tuple(g.shape)}")
    return _step(g, (m_codes, m_absmax, v_codes, v_absmax), False, dim, out, into,
                 (code_m, code_v, bounds_m, bounds_v), beta1, beta2, eps, step)  # fmt: skip


def adam8bit_step_stack(
    g: Tensor,
    m_codes: Tensor,
    m_absmax: Tensor,
    v_codes: Tensor,
    v_absmax: Tensor,
    *,
    dim: int,
    code_m: Tensor,
    code_v: Tensor,
    bounds_m: Tensor,
    bounds_v: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    out: Tensor | None = None,
    keep: Tensor | None = None,
    keep_at: list[int] | None = None,
) -> Tensor:
    """:func:`adam8bit_step` of a stack of ``k`` same-shape directions in one launch: ``g``
    is ``(k, *shape)``, the codes ``(k, *shape)`` and each absmax ``(k, *scales)``, every
    matrix blocked as :func:`adam8bit_step` blocks it alone (its own 2-D view ``shape[0]`` ×
    rest), with the same bits as ``k`` such calls; codes and absmax are updated in place.
    ``out``: float32, or bf16 (each direction rounded to nearest, ties to even: for a
    consumer that rounds it so, GaLore's factors of bf16 weights). ``keep``: one bool flag
    per matrix on the device, or (``keep_at``) their positions in it
    (:mod:`~galore2.kernels.keep`): a matrix flagged False has neither its codes, its
    absmax nor its ``out`` written (a deferred step's unusable gradient)."""
    if g.dim() < 2 or g.numel() == 0:
        raise ValueError(f"the stack must be a non-empty (k, *shape) tensor, got {tuple(g.shape)}")
    check("adam8bit_step_stack", keep, g.shape[0], g.device, keep_at)
    return _step(g, (m_codes, m_absmax, v_codes, v_absmax), True, dim, out, None,
                 (code_m, code_v, bounds_m, bounds_v), beta1, beta2, eps, step,
                 keep=keep, keep_at=keep_at)  # fmt: skip


def adamw8bit_step(
    p: Tensor, g: Tensor, m_codes: Tensor, m_absmax: Tensor, v_codes: Tensor,
    v_absmax: Tensor, *, lr: float, decay: float, keep: Tensor | None = None,
    keep_at: list[int] | None = None, **adam: Any,
) -> bool:  # fmt: skip
    """The whole AdamW step of one bf16 weight ``p`` (updated in place) with 8-bit moments,
    in one pass: :func:`adam8bit_step`'s moments and direction d, then ``p ← p·decay``
    rounded to bf16 and ``p − lr·d`` (one multiply-add) rounded again — what the direction
    followed by the decay and update passes computes (``apply_updates``), as
    :func:`galore2.kernels.adamw.adamw_step` writes its weight. Per element: the gradient
    and the weight read (2 + 2 bytes), the weight written (2), both codes read and written
    (4): 10 bytes, no direction stored. ``p`` contiguous bf16 of ``g``'s shape (the codes'
    layout). ``adam``: :func:`adam8bit_step`'s keywords (``dim``, the code maps and their
    bounds, ``beta1``, ``beta2``, ``eps``, ``step``). ``keep``: a one-entry flag (``keep_at``: its position in a longer one); False
    leaves the weight and its moments unwritten. Returns True."""
    if p.dtype != torch.bfloat16 or p.shape != g.shape or not p.is_contiguous():
        raise ValueError(
            f"adamw8bit_step takes a contiguous bf16 weight of the gradient's shape "
            f"{tuple(g.shape)}, got {p.dtype} {tuple(p.shape)}"
        )
    if g.dim() < 1 or g.numel() == 0:
        raise ValueError(f"the gradient must be a non-empty tensor, got shape {tuple(g.shape)}")
    check("adamw8bit_step", keep, 1, g.device, keep_at)
    missing = [k for k in _ADAM if k not in adam]
    if missing or len(adam) != len(_ADAM):
        extra = sorted(set(adam) - set(_ADAM))
        raise TypeError(f"adamw8bit_step: missing keywords {missing}, unknown {extra}")
    dim, maps = adam["dim"], tuple(adam[k] for k in _ADAM[1:5])
    _step(g, (m_codes, m_absmax, v_codes, v_absmax), False, dim, None, None, maps,  # type: ignore[arg-type]
          adam["beta1"], adam["beta2"], adam["eps"], adam["step"], weight=(p, lr, decay),
          keep=keep, keep_at=keep_at)  # fmt: skip
    return True


#: the keywords :func:`adam8bit_step` takes besides its tensors (adamw8bit_step's ``adam``)
_ADAM = ("dim", "code_m", "code_v", "bounds_m", "bounds_v", "beta1", "beta2", "eps", "step")


def _step(
    g: Tensor, states: tuple[Tensor, Tensor, Tensor, Tensor], stacked: bool, dim: int,
    out: Tensor | None, into: tuple[Tensor, Tensor, Tensor, Tensor] | None,
    maps: tuple[Tensor, Tensor, Tensor, Tensor], beta1: float, beta2: float, eps: float,
    step: int, *, weight: tuple[Tensor, float, float] | None = None,
    keep: Tensor | None = None, keep_at: list[int] | None = None,
) -> Tensor:  # fmt: skip
    """The launch of :func:`adam8bit_step`, (``stacked``) :func:`adam8bit_step_stack` and
    (``weight``: the weight, lr, decay) :func:`adamw8bit_step` (no direction written)."""
    if dim not in (0, 1):
        raise ValueError(f"dim must be 0 or 1, got {dim}")
    if step < 1:
        raise ValueError(f"step counts this step (>= 1), got {step}")
    k = g.shape[0] if stacked else 1
    shape = g.shape[1:] if stacked else g.shape
    rows = shape[0]
    cols = math.prod(shape) // rows
    g2 = g.reshape(k, rows, cols)
    blocks = -(-(cols if dim == 1 else rows) // QBLOCK)
    scales = (rows, blocks) if dim == 1 else (blocks, cols)
    for name, t, dtype, size in (
        ("m_codes", states[0], torch.uint8, rows * cols),
        ("m_absmax", states[1], torch.float32, scales[0] * scales[1]),
        ("v_codes", states[2], torch.uint8, rows * cols),
        ("v_absmax", states[3], torch.float32, scales[0] * scales[1]),
    ):
        if t.dtype != dtype or t.numel() != k * size:
            what = "×".join(map(str, ((k,) if stacked else ()) + (
                (rows, cols) if "codes" in name else scales)))  # fmt: skip
            raise ValueError(
                f"{name} must be {dtype} with {what} elements, got {t.dtype} {tuple(t.shape)}"
            )
    # contiguous 3-D views (copies when strided; copied back below)
    shapes = ((k, rows, cols), (k, *scales), (k, rows, cols), (k, *scales))
    src = [t.contiguous().view(s) for t, s in zip(states, shapes, strict=True)]
    dst = (
        src if into is None else [t.contiguous().view(s) for t, s in zip(into, shapes, strict=True)]
    )
    if weight is not None:  # the weight takes the update: no direction is written
        res = out = weight[0]
    else:
        if out is None:
            out = torch.empty(g.shape, dtype=torch.float32, device=g.device)
        if out.dtype not in (torch.float32, torch.bfloat16) or out.shape != g.shape:
            raise ValueError(
                f"out must be float32 or bfloat16 {tuple(g.shape)}, got {out.dtype} "
                f"{tuple(out.shape)}"
            )
        # a strided out through a contiguous copy of it (a flagged-out member's entries
        # are copied back as they were)
        res = out.contiguous()
    p_ptr, lr, decay = weight if weight is not None else (res, 0.0, 1.0)

    bc1 = 1 - beta1**step
    c1 = bc1 / math.sqrt(1 - beta2**step)
    w1 = 1 - beta1
    length, n_other = (cols, rows) if dim == 1 else (rows, cols)
    qb, other, warps = _tile(length, dim)
    # strides of a contiguous rows × cols matrix along (other, block)
    s_other, s_block = (cols, 1) if dim == 1 else (1, cols)
    g_s_other, g_s_block = (
        (g2.stride(1), g2.stride(2)) if dim == 1 else (g2.stride(2), g2.stride(1))
    )
    a_s_other, a_s_block = (blocks, 1) if dim == 1 else (1, cols)
    tiles = triton.cdiv(n_other, other) * blocks
    flags, has_keep = pointer(keep, g2)
    at = g2 if keep_at is None else positions(keep_at, g.device)
    with launch_device(g):
        _adam8bit_kernel[(k * tiles,)](
            g2,
            res,
            *src,
            *dst,
            *maps,
            n_other,
            length,
            blocks,
            tiles,
            g2.stride(0),
            rows * cols,
            scales[0] * scales[1],
            g_s_other,
            g_s_block,
            s_other,
            s_block,
            a_s_other,
            a_s_block,
            w1,
            beta2,
            1 - beta2,
            c1,
            bc1 * eps,
            p_ptr,
            decay,
            -lr,
            flags,
            at,
            LERP_LOW=abs(w1) < 0.5,
            OTHER=other,
            QB=qb,
            OUT_BF16=res.dtype == torch.bfloat16,
            UPDATE=weight is not None,
            DECAY=decay != 1.0,
            HAS_KEEP=has_keep,
            HAS_AT=keep_at is not None,
            num_warps=warps,
            enable_fp_fusion=True,  # FMA contraction, as nvcc compiles torch's kernels
        )
    targets = states if into is None else into
    for t, d in zip(targets, dst, strict=True):
        if t.data_ptr() != d.data_ptr():
            t.copy_(d.view(t.shape))
    if res is not out:
        out.copy_(res)
    return out


def supported(g: Tensor) -> bool:
    """Directions the kernel takes: non-empty float tensors."""
    return (
        g.numel() > 0 and g.dim() >= 1 and g.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


__all__ = ["QBLOCK", "adam8bit_step", "adam8bit_step_stack", "adamw8bit_step", "supported"]
