"""GaLore's back-projection epilogue (Triton): ``p ← β·p + α·(A @ B)`` in one pass over p.

For a weight viewed as ``M × N`` and a low-rank update ``scale · A @ B`` (A: M × K,
B: K × N, K the rank), the optimizer applies ``p ← decay·p − lr·scale·(A @ B)``
(:func:`galore2.core.apply.apply_update`; torch path ``p.addmm_(A, B,
beta=decay, alpha=−lr·scale)``). Each program computes one ``BLOCK_M × BLOCK_N`` tile of
``A @ B`` with fp32 accumulation, then its epilogue reads that tile of p, forms
``β·p + α·acc`` in fp32 (one rounding to p's dtype, as cuBLAS' addmm epilogue) and writes
it back — decoupled weight decay, the update's scale and the learning rate in the same
pass. With β = 0, p is not read (torch's ``addmm`` ignores its input then, NaN included).

Memory traffic: p read and written once (2·M·N elements), A read ⌈N / BLOCK_N⌉ times
and B ⌈M / BLOCK_M⌉ times (from L2 mostly: programs are ordered in groups of GROUP_M
row tiles that share B's column tiles). No M × N temporary.

fp32 operands use full-precision products (``input_precision="ieee"``) unless torch
allows TF32 for matmuls (``torch.backends.cuda.matmul.allow_tf32``), as cuBLAS does.
Tile sizes are fixed per dtype (not autotuned).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dispatch import launch_device
from .rounding import to_bf16

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def tile_product(
    a_ptr, b_ptr, m0, n0, M, N, K, s_am, s_ak, s_bk, s_bn, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, A_BF16: tl.constexpr, B_BF16: tl.constexpr,
):  # fmt: skip
    """The float32 ``BLOCK_M × BLOCK_N`` tile of ``A @ B`` at rows ``m0…``, columns ``n0…``
    (int32 origins), zero outside the M × N product: a K loop of ``tl.dot`` with fp32
    accumulation. ``A_BF16`` / ``B_BF16``: that operand is float32, rounded to bf16 as its
    tiles are loaded (what casting it first gives, without the cast's pass). ``UPCAST``:
    16-bit tiles multiplied as float32 (the interpreter's, see :func:`lowrank_update`)."""
    # Scalar int64 tile origins plus int32 in-tile offsets: 64-bit addressing for large
    # weights without 64-bit offset tensors (registers) in the loop.
    lm = tl.arange(0, BLOCK_M)
    ln = tl.arange(0, BLOCK_N)
    lk = tl.arange(0, BLOCK_K)
    m_ok = (m0 + lm) < M
    n_ok = (n0 + ln) < N
    a_ptrs = a_ptr + m0.to(tl.int64) * s_am + (lm[:, None] * s_am + lk[None, :] * s_ak)
    b_ptrs = b_ptr + n0.to(tl.int64) * s_bn + (lk[:, None] * s_bk + ln[None, :] * s_bn)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + lk) < K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if A_BF16:
            a = to_bf16(a)
        if B_BF16:
            b = to_bf16(b)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk
    return acc


@triton.jit
def channel_block(table, count, tiles, BLOCK_C: tl.constexpr, x_ptr, y_ptr, z_ptr):
    """A list kernel's program over channel blocks: (its entry ``e``, the block's first
    channel ``c0``, and entry ``e``'s three tensors ``x``, ``y``, ``z`` — the first entry's
    pointers plus their element offsets, the table's first three lists of ``count``)."""
    pid = tl.program_id(0)
    e = pid // tiles
    c0 = (pid % tiles) * BLOCK_C
    x_e = x_ptr + tl.load(table + e)
    y_e = y_ptr + tl.load(table + count + e)
    z_e = z_ptr + tl.load(table + 2 * count + e)
    return e, c0, x_e, y_e, z_e


@triton.jit
def lowrank_tile(
    a_ptr, b_ptr, p_ptr, out_ptr, pid, M, N, K, s_am, s_ak, s_bk, s_bn, s_pm, s_pn, s_om,
    s_on, alpha, beta, BETA_ZERO: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, A_BF16: tl.constexpr,
    B_BF16: tl.constexpr, g_ptr, s_gm, s_gn, f_ptr, s_fm, s_fn, gamma,
    SCALED: tl.constexpr, F_ROWS: tl.constexpr, F_COLS: tl.constexpr,
    RNE_BF16: tl.constexpr,
):  # fmt: skip
    """Tile ``pid`` of ``out ← β·p + α·(A @ B)`` for one matrix (the kernel of one matrix,
    and of each entry of :mod:`galore2.kernels.lowrank_list`'s grouped launch); the product
    by :func:`tile_product`.

    ``SCALED``: plus ``γ·g ⊙ f`` (Fira's scaled residual term), g an M × N tile read by its
    strides (any float dtype, upcast), f float32 broadcast over the matrix — one per row
    (``F_ROWS``, stride ``s_fm``), per column (``F_COLS``, stride ``s_fn``) or one value —
    all in float32 and rounded once to out's dtype; ``RNE_BF16``: that rounding to bf16 by
    :func:`~galore2.kernels.rounding.to_bf16` (the interpreter's cast truncates). Without
    ``SCALED`` the g / f arguments are not read (callers pass any pointer there)."""
    # Grouped program order: GROUP_M consecutive row tiles walk the column tiles together.
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    acc = tile_product(a_ptr, b_ptr, m0, n0, M, N, K, s_am, s_ak, s_bk, s_bn, PRECISION,
                       UPCAST, BLOCK_M, BLOCK_N, BLOCK_K, A_BF16, B_BF16)  # fmt: skip

    lm = tl.arange(0, BLOCK_M)
    ln = tl.arange(0, BLOCK_N)
    m_ok = (m0 + lm) < M
    n_ok = (n0 + ln) < N
    mask = m_ok[:, None] & n_ok[None, :]
    res = alpha * acc
    if not BETA_ZERO:
        p_tile = p_ptr + m0.to(tl.int64) * s_pm + n0.to(tl.int64) * s_pn
        p = tl.load(p_tile + (lm[:, None] * s_pm + ln[None, :] * s_pn), mask=mask, other=0.0)
        res = res + beta * p.to(tl.float32)
    if SCALED:
        g_tile = g_ptr + m0.to(tl.int64) * s_gm + n0.to(tl.int64) * s_gn
        g = tl.load(g_tile + (lm[:, None] * s_gm + ln[None, :] * s_gn), mask=mask, other=0.0)
        if F_ROWS:
            f = tl.load(f_ptr + m0.to(tl.int64) * s_fm + lm * s_fm, mask=m_ok, other=0.0)[:, None]
        elif F_COLS:
            f = tl.load(f_ptr + n0.to(tl.int64) * s_fn + ln * s_fn, mask=n_ok, other=0.0)[None, :]
        else:
            f = tl.load(f_ptr)
        res = res + (gamma * g.to(tl.float32)) * f
    o_tile = out_ptr + m0.to(tl.int64) * s_om + n0.to(tl.int64) * s_on
    o_ptrs = o_tile + (lm[:, None] * s_om + ln[None, :] * s_on)
    if RNE_BF16:
        tl.store(o_ptrs, to_bf16(res), mask=mask)
    else:
        tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lowrank_update_kernel(
    a_ptr, b_ptr, p_ptr, out_ptr, M, N, K, s_am, s_ak, s_bk, s_bn, s_pm, s_pn, s_om, s_on,
    alpha, beta, BETA_ZERO: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    lowrank_tile(a_ptr, b_ptr, p_ptr, out_ptr, tl.program_id(0), M, N, K, s_am, s_ak, s_bk,
                 s_bn, s_pm, s_pn, s_om, s_on, alpha, beta, BETA_ZERO, PRECISION, UPCAST,
                 BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, False, False, p_ptr, 0, 0, p_ptr, 0, 0,
                 0.0, False, False, False, False)  # fmt: skip


def matmul_precision(dtype: torch.dtype) -> str | None:
    """``tl.dot``'s input precision for operands of ``dtype``: fp32 ones at full precision
    unless torch allows TF32 for matmuls (as cuBLAS reads that flag); None for 16-bit."""
    if dtype != torch.float32:
        return None
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def config(dtype: torch.dtype, precision: str | None) -> dict[str, int]:
    """Tile sizes: tensor-core tiles for bf16 / fp16 / TF32, smaller K steps for fp32 FMA."""
    if dtype != torch.float32:
        return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
    if precision == "tf32":
        return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 16, "num_warps": 8, "num_stages": 2}


def lowrank_update(
    p: Tensor,
    A: Tensor,
    B: Tensor,
    *,
    alpha: float,
    beta: float,
    out: Tensor | None = None,
) -> Tensor:
    """``out ← beta·p + alpha·(A @ B)`` (``out`` defaults to p: the in-place update).

    p and out are M × N, A is M × K, B is K × N, all of one dtype in :data:`DTYPES`
    (any strides). Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.
    """
    if A.dim() != 2 or B.dim() != 2 or p.dim() != 2:
        raise ValueError("p, A and B must be 2-D")
    M, K = A.shape
    if B.shape[0] != K or tuple(p.shape) != (M, B.shape[1]):
        raise ValueError(
            f"shapes do not match p ({tuple(p.shape)}) = A ({tuple(A.shape)}) @ B ({tuple(B.shape)})"
        )
    out = p if out is None else out
    if out.shape != p.shape or len({p.dtype, A.dtype, B.dtype, out.dtype}) != 1:
        raise ValueError(
            f"p, A, B and out must share a dtype and out p's shape; got p {p.dtype}, "
            f"A {A.dtype}, B {B.dtype}, out {out.dtype} {tuple(out.shape)}"
        )
    if p.dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {p.dtype}; the kernel takes {DTYPES}")
    if not small_strides(p, A, B, out):
        raise ValueError("strides of 2**24 elements or more are not supported")
    N = p.shape[1]
    if M == 0 or N == 0:
        return out
    if K == 0:  # addmm with an empty product: out = beta·p
        return out.copy_(p.mul(beta) if beta != 0 else torch.zeros_like(p))
    precision = matmul_precision(p.dtype)
    cfg = config(p.dtype, precision)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    with launch_device(p):
        _lowrank_update_kernel[grid](
            A,
            B,
            p,
            out,
            M,
            N,
            K,
            A.stride(0),
            A.stride(1),
            B.stride(0),
            B.stride(1),
            p.stride(0),
            p.stride(1),
            out.stride(0),
            out.stride(1),
            alpha,
            beta,
            BETA_ZERO=beta == 0,
            PRECISION=precision,
            # Triton's interpreter (CPU tensors) multiplies bf16 as raw integers in tl.dot;
            # products of bf16 / fp16 values are exact in fp32, so upcasting there is exact
            UPCAST=p.dtype != torch.float32 and p.device.type == "cpu",
            GROUP_M=8,
            enable_fp_fusion=True,  # FMA contraction, as nvcc compiles torch's kernels
            **cfg,
        )
    return out


def small_strides(*tensors: Tensor) -> bool:
    """In-tile offsets (up to 128 rows or columns times a stride) must fit int32."""
    return all(abs(s) * 128 < 2**31 for t in tensors for s in t.stride())


#: not in ``GALORE2_KERNELS=auto``: on an H100 cuBLAS' ``addmm_`` took 0.76–0.84× this
#: kernel's time at Llama-7B shapes (fp32 and bf16; ``python -m benchmarks.run --tasks
#: kernels``, 2026-11-24), so auto keeps the torch path; ``triton`` mode still runs it.
AUTO = False


def supported(p: Tensor, A: Tensor, B: Tensor) -> bool:
    """Inputs the kernel takes: 2-D operands of one dtype in :data:`DTYPES`, strides below
    2**24 elements."""
    return (
        p.dim() == A.dim() == B.dim() == 2
        and p.dtype in DTYPES
        and p.dtype == A.dtype == B.dtype
        and small_strides(p, A, B)
    )


__all__ = ["DTYPES", "lowrank_update", "supported"]
