"""APOLLO's step over a list of same-shape matrices (Triton), one launch each way.

APOLLO scales each gradient by a channel-wise factor, limited by the growth of the
gradient's channel norms. For a shape batch of k matrices (weights ``W_i``, gradients
``G_i``, m × n) that is two passes over the gradients:

* :func:`channel_norms_list` — ``out[i] = ‖G_i‖`` per column (``dim=0``, reducing over the
  rows: ``out`` is k × 1 × n) or per row (``dim=1``: k × m × 1), squares summed in float32
  (``torch.linalg.vector_norm(G_i, dim, keepdim=True, dtype=torch.float32)`` up to the
  summation order);
* :func:`scaled_add_list` — ``W_i ← β·W_i + α·G_i ⊙ f_i`` with ``f`` a float32 stack of
  factors that broadcast over each matrix (k × 1 × n, k × m × 1 or k × 1 × 1), what
  ``W_i.mul_(β); W_i.addcmul_(G_i, f_i, value=α)`` gives: with β ≠ 1 the product β·W_i is
  rounded to W's dtype first (torch's ``mul_``), then ``q + α·g·f`` is formed in float32
  (``(α·g)·f + q`` in one FMA, the contraction nvcc makes of torch's CUDA ``addcmul``) and
  rounded once; with β = 1 the weight is read as it is.

Each program works on one 2-D tile (rows × columns) of one entry: entry ``pid // tiles``,
its tensors found from a table of element offsets from the first entry's
(:func:`~galore2.kernels.tables.kept`, as :mod:`galore2.kernels.lowrank_list` does), so the
gradients stay where they are — no stack, no copy. The entries of a list share their shape,
strides and dtype (every offset but the base is the same); the weights' and the gradients'
layouts are independent (a transposed-layout matrix is a stride pair like any other). The
norms' programs own a block of kept channels and walk the reduced dimension, so no two
programs write one output and nothing is accumulated across programs (deterministic). The
factor is read by its strides along the dimension it varies on and broadcast along the
other (its size-1 dimensions are never indexed). Tile origins are int64 (large matrices),
in-tile offsets int32 (:func:`~galore2.kernels.lowrank.small_strides`).

Under Triton's interpreter (CPU tensors, the tests) a cast to bf16 truncates; the kernels
round there with :func:`~galore2.kernels.rounding.to_bf16` (round to nearest even, the
GPU's cast) instead. Not while a CUDA graph is captured (the table's copy): the callers'
ops run their torch path there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from .checks import factor_problem, norms_problem
from .dispatch import launch_device
from .keep import check, pointer, positions
from .lowrank import DTYPES, small_strides
from .rounding import to_bf16
from .tables import capturing, offsets

#: tile sizes (fixed, no autotune): square tiles, so that either layout of a matrix has
#: 64 consecutive elements along its contiguous dimension
BLOCK = 64
NUM_WARPS = 4

#: in ``GALORE2_KERNELS=auto`` (:func:`~galore2.kernels.dispatch.run_kernel`): one launch per
#: shape batch where the torch path launches per matrix or copies a stack; written and tested
#: under the interpreter, not yet timed on a GPU (False: auto keeps the torch path).
AUTO = True


@triton.jit
def _round(x, dtype: tl.constexpr, RNE_BF16: tl.constexpr):
    """float32 ``x`` rounded to ``dtype`` (to nearest even); ``RNE_BF16``: bf16 under the
    interpreter, whose cast truncates."""
    if RNE_BF16:
        return to_bf16(x)
    else:
        return x.to(dtype)


@triton.jit
def _norms_kernel(
    g_ptr, table, out_ptr, tiles, R, C, s_r, s_c, s_oe, s_oc, BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Channels ``c0 … c0+BLOCK_C−1`` of entry ``e``: ``sqrt(Σ_r G[r, c]²)`` over the R
    reduced indices (stride ``s_r``; kept ones stride ``s_c``), in float32."""
    pid = tl.program_id(0)
    e = pid // tiles
    c0 = (pid % tiles) * BLOCK_C
    lr = tl.arange(0, BLOCK_R)
    lc = tl.arange(0, BLOCK_C)
    c_ok = (c0 + lc) < C
    g_tile = g_ptr + tl.load(table + e) + c0.to(tl.int64) * s_c
    ptrs = g_tile + (lr[:, None] * s_r + lc[None, :] * s_c)
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        mask = ((r0 + lr) < R)[:, None] & c_ok[None, :]
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        acc += x * x
        ptrs += BLOCK_R * s_r
    norms = tl.sqrt_rn(tl.sum(acc, axis=0))
    o_tile = out_ptr + e.to(tl.int64) * s_oe + c0.to(tl.int64) * s_oc
    tl.store(o_tile + lc * s_oc, norms, mask=c_ok)


@triton.jit
def _scaled_kernel(
    p_ptr, g_ptr, f_ptr, table, count, tiles, tiles_n, M, N, s_pm, s_pn, s_gm, s_gn, s_fe,
    s_fm, s_fn, alpha, beta, keep_ptr, at_ptr, BETA_ONE: tl.constexpr, F_ROWS: tl.constexpr,
    F_COLS: tl.constexpr, RNE_BF16: tl.constexpr, HAS_KEEP: tl.constexpr,
    HAS_AT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Tile ``pid % tiles`` of entry ``pid // tiles``: ``p ← round(q + α·g·f)``, q = p or
    round(β·p). ``F_ROWS`` / ``F_COLS``: the factor varies along the rows / the columns
    (neither: one per matrix). ``HAS_KEEP``: entry e's flag is ``keep[e]`` (``HAS_AT``:
    ``keep[at[e]]``); 0 leaves it unwritten (a deferred step's unusable gradient)."""
    pid = tl.program_id(0)
    e = pid // tiles
    if HAS_KEEP:  # a constexpr branch: no load without flags
        flag = tl.load(at_ptr + e) if HAS_AT else e
        if tl.load(keep_ptr + flag) == 0:
            return
    t = pid % tiles
    m0 = (t // tiles_n) * BLOCK_M
    n0 = (t % tiles_n) * BLOCK_N
    lm = tl.arange(0, BLOCK_M)
    ln = tl.arange(0, BLOCK_N)
    m_ok = (m0 + lm) < M
    n_ok = (n0 + ln) < N
    mask = m_ok[:, None] & n_ok[None, :]
    p_tile = p_ptr + tl.load(table + e) + m0.to(tl.int64) * s_pm + n0.to(tl.int64) * s_pn
    g_tile = g_ptr + tl.load(table + count + e) + m0.to(tl.int64) * s_gm + n0.to(tl.int64) * s_gn
    p_ptrs = p_tile + (lm[:, None] * s_pm + ln[None, :] * s_pn)
    p = tl.load(p_ptrs, mask=mask, other=0.0)
    g = tl.load(g_tile + (lm[:, None] * s_gm + ln[None, :] * s_gn), mask=mask, other=0.0)
    f_entry = f_ptr + e.to(tl.int64) * s_fe
    if F_ROWS:
        f = tl.load(f_entry + m0.to(tl.int64) * s_fm + lm * s_fm, mask=m_ok, other=0.0)
        f = tl.broadcast_to(f[:, None], (BLOCK_M, BLOCK_N))
    elif F_COLS:
        f = tl.load(f_entry + n0.to(tl.int64) * s_fn + ln * s_fn, mask=n_ok, other=0.0)
        f = tl.broadcast_to(f[None, :], (BLOCK_M, BLOCK_N))
    else:
        f = tl.full((BLOCK_M, BLOCK_N), tl.load(f_entry), tl.float32)
    dtype = p_ptr.dtype.element_ty
    q = p.to(tl.float32)
    if not BETA_ONE:  # torch's p.mul_(β): rounded to p's dtype before the sum
        q = _round(beta * q, dtype, RNE_BF16).to(tl.float32)
    res = tl.fma(alpha * g.to(tl.float32), f, q)
    tl.store(p_ptrs, _round(res, dtype, RNE_BF16), mask=mask)


def _same(ts: Sequence[Tensor], first: Tensor) -> bool:
    """All of ``ts`` tensors of ``first``'s shape, strides, dtype and device."""
    shape, strides = first.shape, first.stride()
    return all(
        isinstance(t, Tensor) and t.shape == shape and t.stride() == strides
        and t.dtype == first.dtype and t.device == first.device
        for t in ts
    )  # fmt: skip


def _entries_problem(name: str, ts: Sequence[Tensor]) -> str | None:
    """Why ``ts`` is not a list the kernels take as entries (None when it is): 2 or more
    non-empty 2-D tensors of one shape, strides, dtype in DTYPES and device."""
    if not isinstance(ts, (list, tuple)) or len(ts) < 2:
        return f"{name} must be a list of 2 or more tensors"
    first = ts[0]
    if not isinstance(first, Tensor) or first.dim() != 2 or first.numel() == 0:
        return f"{name} must hold non-empty 2-D tensors"
    if first.dtype not in DTYPES:
        return f"{name} must be of one dtype among {DTYPES}, got {first.dtype}"
    if not _same(ts, first):
        return f"{name} must share one shape, strides, dtype and device"
    return None


def _norms_problem(Gs: Sequence[Tensor], dim: int, out: Tensor) -> str | None:
    problem = _entries_problem("Gs", Gs)
    if problem is not None:
        return problem
    g = Gs[0]
    problem = norms_problem(out, dim, len(Gs), *g.shape, g.device)
    if problem is not None:
        return problem
    if not small_strides(g, out):
        return "strides of 2**24 elements or more are not supported"
    if capturing(g.device):
        return "not while a CUDA graph is captured"
    return None


def _scaled_problem(ps: Sequence[Tensor], Gs: Sequence[Tensor], factor: Tensor) -> str | None:
    problem = _entries_problem("ps", ps) or _entries_problem("Gs", Gs)
    if problem is not None:
        return problem
    p, g, k = ps[0], Gs[0], len(ps)
    if len(Gs) != k or g.shape != p.shape or g.device != p.device:
        return f"Gs must be {k} tensors of ps' shape {tuple(p.shape)} on {p.device}"
    if len({t.data_ptr() for t in ps}) != k:
        return "ps must be distinct tensors (each is written once)"
    problem = factor_problem(factor, k, *p.shape, p.device)
    if problem is not None:
        return problem
    if not small_strides(p, g, factor):
        return "strides of 2**24 elements or more are not supported"
    if capturing(p.device):
        return "not while a CUDA graph is captured"
    return None


def supported_norms(Gs: list[Tensor], dim: int, out: Tensor) -> bool:
    """What :func:`channel_norms_list` takes: 2 or more non-empty 2-D tensors of one shape,
    strides, dtype (float32 / bf16 / fp16) and device; ``out`` a float32 tensor of shape
    (k, 1, n) for ``dim=0`` or (k, m, 1) for ``dim=1`` there (any strides); strides below
    2**24 elements; no CUDA graph being captured."""
    return _norms_problem(Gs, dim, out) is None


def supported_scaled(ps: list[Tensor], Gs: list[Tensor], factor: Tensor) -> bool:
    """What :func:`scaled_add_list` takes: ps, 2 or more distinct non-empty 2-D tensors of one
    shape, strides, dtype (float32 / bf16 / fp16) and device; Gs as many tensors of ps'
    shape on that device, of one dtype among those and one strides; ``factor`` a float32
    tensor of shape (k, 1, n), (k, m, 1) or (k, 1, 1) there (any strides); strides below
    2**24 elements; no CUDA graph being captured."""
    return _scaled_problem(ps, Gs, factor) is None


def channel_norms_list(Gs: list[Tensor], dim: int, out: Tensor) -> bool:
    """``out[i] ← ‖Gs[i]‖₂`` along ``dim`` (keepdim; squares summed in float32) for every i in
    one launch: per column for ``dim=0`` (``out`` k × 1 × n), per row for ``dim=1``
    (k × m × 1). The inputs as :func:`supported_norms` takes them (a ValueError naming what
    is wrong otherwise, before anything is written). CUDA tensors, or CPU ones under
    ``TRITON_INTERPRET=1``. Returns True (it ran)."""
    problem = _norms_problem(Gs, dim, out)
    if problem is not None:
        raise ValueError(f"channel_norms_list: {problem}")
    g = Gs[0]
    R, C = g.shape if dim == 0 else g.shape[::-1]
    s_r, s_c = g.stride() if dim == 0 else g.stride()[::-1]
    s_oc = out.stride(2) if dim == 0 else out.stride(1)
    tiles = triton.cdiv(C, BLOCK)
    table = offsets("channel_norms_list", (Gs,))
    with launch_device(g):
        _norms_kernel[(tiles * len(Gs),)](
            g, table, out, tiles, R, C, s_r, s_c, out.stride(0), s_oc, BLOCK_R=BLOCK,
            BLOCK_C=BLOCK, num_warps=NUM_WARPS,
        )  # fmt: skip
    return True


def scaled_add_list(
    ps: list[Tensor], Gs: list[Tensor], factor: Tensor, *, alpha: float, beta: float,
    keep: Tensor | None = None, keep_at: list[int] | None = None,
) -> bool:  # fmt: skip
    """``ps[i] ← beta·ps[i] + alpha·Gs[i] ⊙ factor[i]`` in place for every i in one launch:
    what ``p.mul_(beta); p.addcmul_(G, f, value=alpha)`` gives (β·p rounded to p's dtype
    first unless β = 1; the rest formed in float32 with one FMA and rounded once). The inputs
    as :func:`supported_scaled` takes them (a ValueError naming what is wrong otherwise,
    before anything is written). ``keep``: one bool flag per weight on the device
    (``keep_at``: their positions in it; :mod:`~galore2.kernels.keep`); a weight flagged
    False is not written. CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``. Returns
    True (it ran)."""
    problem = _scaled_problem(ps, Gs, factor)
    if problem is not None:
        raise ValueError(f"scaled_add_list: {problem}")
    check("scaled_add_list", keep, len(ps), ps[0].device, keep_at)
    p, g = ps[0], Gs[0]
    M, N = p.shape
    tiles_n = triton.cdiv(N, BLOCK)
    tiles = triton.cdiv(M, BLOCK) * tiles_n
    table = offsets("scaled_add_list", (ps, Gs))
    f_rows, f_cols = factor.shape[1] != 1, factor.shape[2] != 1
    flags, has_keep = pointer(keep, table)
    at = table if keep_at is None else positions(keep_at, p.device)
    with launch_device(p):
        _scaled_kernel[(tiles * len(ps),)](
            p, g, factor, table, len(ps), tiles, tiles_n, M, N, p.stride(0), p.stride(1),
            g.stride(0), g.stride(1), factor.stride(0), factor.stride(1), factor.stride(2),
            float(alpha), float(beta), flags, at, BETA_ONE=beta == 1, F_ROWS=f_rows,
            F_COLS=f_cols, RNE_BF16=p.dtype == torch.bfloat16 and p.device.type == "cpu",
            HAS_KEEP=has_keep, HAS_AT=keep_at is not None, BLOCK_M=BLOCK, BLOCK_N=BLOCK,
            num_warps=NUM_WARPS,
            enable_fp_fusion=False,  # β·p is rounded before the sum: no contraction across it
        )  # fmt: skip
    return True


__all__ = ["channel_norms_list", "scaled_add_list", "supported_norms", "supported_scaled"]
