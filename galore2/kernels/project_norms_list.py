"""A shape batch's projections and the channel norms of their residuals (Triton), one
launch, each gradient read from DRAM once.

Fira projects each gradient ``G_i`` (m × n) of a shape batch onto its stored basis and, for
its norm-growth limiter, needs the norms of the residual outside that subspace per channel
as well as those of the projection. With a left basis ``P_i`` (m × r, ``dim=0``):
``R_i = P_iᵀ G_i`` (r × n), the per-column norms of ``G_i + c·P_i R_i`` (``c = −1``: the
residual) and the per-column norms of ``R_i``. With a right basis ``Q_i`` (n × r,
``dim=1``): ``R_i = G_i Q_i`` (m × r) and the per-row norms of ``G_i + c·R_i Q_iᵀ`` and of
``R_i``. Run apart (the grouped projection of :mod:`galore2.kernels.lowrank_list`, then
:mod:`galore2.kernels.residual_list`) that is two passes over every gradient; here one.

Each program owns a block of ``BLOCK_C`` channels (columns for ``dim=0``) of one entry
(entry ``pid // tiles``; its tensors found from a table of element offsets from the first
entry's, as :mod:`galore2.kernels.lowrank_list` does, so the gradients stay where they
are) and all r rows of R for them:

1. R's tile (r padded to a power of two, at least 16, × ``BLOCK_C``) by the grouped
   matmuls' K loop over the m reduced indices (:func:`galore2.kernels.lowrank.tile_product`:
   ``tl.dot`` with fp32 accumulation, a float32 basis of a bf16 G rounded to bf16 as its
   tiles load), rounded once to G's dtype and stored (the projection), and the float32
   norms of its columns as rounded;
2. the m rows again (G's tiles from L2 on a GPU, just read by the same program): each
   ``BLOCK_K`` rows ``x = g + c·(P's tile @ R)`` with the rounded R kept in registers (never
   reloaded from memory), ``x²`` summed per channel in float32, the square root at the end.

With ``c = 0`` they are G's own channel norms (APOLLO's limiter: phase 2 then reads no
basis and multiplies nothing). So the norms are those of ``G + c·P·R`` for the R stored (its rounding included), the basis
as rounded to G's dtype, G upcast, products accumulated in fp32. No two programs write one
output and nothing is accumulated across programs (deterministic, no atomics). A right
basis is the left case on the transposes (``Gᵀ``, ``Rᵀ = Qᵀ Gᵀ``): the same kernel with the
strides swapped.

Not while a CUDA graph is captured (the table's copy); ranks above 256 are not taken (R's
tile would not fit the registers: the caller runs the two launches instead).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .checks import norms_problem
from .dispatch import launch_device
from .lowrank import channel_block, matmul_precision, small_strides, tile_product
from .lowrank_list import supported_list
from .rounding import to_bf16
from .tables import offsets

#: in ``GALORE2_KERNELS=auto``: one launch and one read of each gradient where the torch
#: path projects and forms each residual apart; written and tested under the interpreter,
#: not yet timed on a GPU (False: auto keeps the torch path).
AUTO = True

#: the largest rank taken (R's padded tile of a program, BLOCK_R × BLOCK_C, in registers)
MAX_RANK = 256


def config(dtype: torch.dtype, precision: str | None, rank: int) -> dict[str, int]:
    """Tile sizes (fixed, no autotune). ``BLOCK_R``: the rank padded to a power of two, at
    least 16 (``tl.dot``'s smallest). ``BLOCK_C``: 64 channels per program, 32 above a
    padded rank of 64 (R's fp32 tile at most 8192 values). ``BLOCK_K``: K steps of 64 for
    16-bit / 32 for TF32 / 16 for fp32 FMA, as the grouped matmuls take
    (:func:`galore2.kernels.lowrank.config`: the projection's sums split alike). 8 warps.
    Compiled for sm_90 by ptxas (not timed on a GPU), these tiles spill no registers but
    8 bytes for a bf16 G with float32 bases at a padded rank of 256; 4 warps spilled from
    fp32's 64 × 64 tile on, and 64 channels of a 128-row tile spilled with 8."""
    block_r = max(16, triton.next_power_of_2(rank))
    block_k = 64 if dtype != torch.float32 else 32 if precision == "tf32" else 16
    return {
        "BLOCK_R": block_r, "BLOCK_C": 64 if block_r <= 64 else 32, "BLOCK_K": block_k,
        "num_warps": 8, "num_stages": 2,
    }  # fmt: skip


@triton.jit
def _project_norms_kernel(
    p_ptr, g_ptr, o_ptr, table, n_ptr, rn_ptr, count, tiles, K, C, RANK, s_pk, s_pr, s_gk,
    s_gc, s_or, s_oc, s_ne, s_nc, s_re, s_rc, c, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr, P_BF16: tl.constexpr, RNE_BF16: tl.constexpr,
    RESIDUAL: tl.constexpr,
):  # fmt: skip
    """Channels ``c0 … c0+BLOCK_C−1`` of entry ``e`` (P: K × RANK, G: K × C, R: RANK × C by
    their strides): ``R ← Pᵀ G`` rounded to R's dtype, ``‖R‖`` per channel, and
    ``sqrt(Σ_k (G[k, ch] + c·(P @ R)[k, ch])²)`` over the K reduced indices, in float32."""
    e, c0, p_e, g_e, o_e = channel_block(table, count, tiles, BLOCK_C, p_ptr, g_ptr, o_ptr)
    lr = tl.arange(0, BLOCK_R)
    lc = tl.arange(0, BLOCK_C)
    lk = tl.arange(0, BLOCK_K)
    r_ok = lr < RANK
    c_ok = (c0 + lc) < C

    # 1. R = Pᵀ G for these channels (zero outside RANK × C), rounded once, stored
    acc = tile_product(p_e, g_e, tl.cast(0, tl.int32), c0, RANK, C, K, s_pr, s_pk, s_gk, s_gc,
                       PRECISION, UPCAST, BLOCK_R, BLOCK_C, BLOCK_K, P_BF16, False)  # fmt: skip
    # RNE_BF16: bf16 rounded to nearest even under the interpreter (its cast truncates)
    r_low = to_bf16(acc) if RNE_BF16 else acc.to(o_ptr.dtype.element_ty)
    o_ptrs = o_e + c0.to(tl.int64) * s_oc + (lr[:, None] * s_or + lc[None, :] * s_oc)
    tl.store(o_ptrs, r_low, mask=r_ok[:, None] & c_ok[None, :])
    r32 = r_low.to(tl.float32)
    r_norms = tl.sqrt_rn(tl.sum(r32 * r32, axis=0))
    rn_tile = rn_ptr + e.to(tl.int64) * s_re + c0.to(tl.int64) * s_rc
    tl.store(rn_tile + lc * s_rc, r_norms, mask=c_ok)

    # 2. G + c·P @ R over the K rows again, R from registers
    r_op = r_low
    if UPCAST:  # the interpreter multiplies 16-bit tiles as raw integers
        r_op = r32
    p_ptrs = p_e + (lk[:, None] * s_pk + lr[None, :] * s_pr)
    g_ptrs = g_e + c0.to(tl.int64) * s_gc + (lk[:, None] * s_gk + lc[None, :] * s_gc)
    sq = tl.zeros((BLOCK_K, BLOCK_C), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + lk) < K
        x = tl.load(g_ptrs, mask=k_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        if RESIDUAL:  # a constexpr branch: c = 0 (G's own norms) reads no basis
            p = tl.load(p_ptrs, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
            if P_BF16:
                p = to_bf16(p)
            if UPCAST:
                p = p.to(tl.float32)
            x = x + c * tl.dot(p, r_op, input_precision=PRECISION)  # zero outside the matrix
        sq += x * x
        p_ptrs += BLOCK_K * s_pk
        g_ptrs += BLOCK_K * s_gk
    norms = tl.sqrt_rn(tl.sum(sq, axis=0))
    n_tile = n_ptr + e.to(tl.int64) * s_ne + c0.to(tl.int64) * s_nc
    tl.store(n_tile + lc * s_nc, norms, mask=c_ok)


def _problem(
    Gs: list[Tensor], Bs: list[Tensor], outs: list[Tensor], dim: int, norms: Tensor,
    r_norms: Tensor,
) -> str | None:  # fmt: skip
    """Why :func:`project_norms_list` does not take these (None when it does)."""
    if isinstance(dim, bool) or dim not in (0, 1):
        return f"dim must be 0 (a left basis P, m × r) or 1 (a right one Q, n × r), got {dim!r}"
    # the grouped matmul's checks: G = P @ R (dim 0) or R = G @ Q (dim 1), shapes included
    lists = (Gs, Gs, Bs, outs) if dim == 0 else (outs, outs, Gs, Bs)
    if not supported_list(*lists):
        shapes = "P m × r and outs r × n" if dim == 0 else "Q n × r and outs m × r"
        return (
            "Gs, Bs and outs must be lists of one length (2 or more) of non-empty 2-D tensors "
            "on one device, Gs (m × n) of one dtype among float32 / bf16 / fp16, Bs of G's "
            f"dtype (or float32 for a bf16 G), {shapes} with a rank of 1 or more, each "
            "list's entries of one shape and strides, strides below 2**24 elements, outside "
            "a CUDA graph's capture"
        )
    g, b, o = Gs[0], Bs[0], outs[0]
    if o.dtype != g.dtype:
        return f"outs must be of G's dtype {g.dtype}, got {o.dtype}"
    rank = b.shape[1]
    if rank > MAX_RANK:
        return f"a rank above {MAX_RANK} is not supported, got {rank}"
    block_r = max(16, triton.next_power_of_2(rank))  # in-tile offsets along the rank: int32
    if any(abs(s) * block_r >= 2**31 for s in (b.stride(1), o.stride(dim))):
        limit = 32 - block_r.bit_length()  # 2**31 / block_r, a power of two
        return f"strides along the rank of 2**{limit} elements or more are not supported here"
    k = len(Gs)
    if len({t.data_ptr() for t in outs}) != k:
        return "outs must be distinct tensors (each is written once)"
    for name, t in (("norms", norms), ("r_norms", r_norms)):
        problem = norms_problem(t, dim, k, *g.shape, g.device)
        if problem is not None:
            return problem.replace("out must", f"{name} must", 1)
    if not small_strides(norms, r_norms):
        return "strides of 2**24 elements or more are not supported"
    return None


def supported_project_norms(
    Gs: list[Tensor], Bs: list[Tensor], outs: list[Tensor], dim: int, norms: Tensor,
    r_norms: Tensor,
) -> bool:  # fmt: skip
    """What :func:`project_norms_list` takes: lists of one length (2 or more) of non-empty
    2-D tensors on one device, each list's entries of one shape, strides and dtype — Gs
    (m × n) in float32 / bf16 / fp16, Bs their bases in G's dtype (or float32 for a bf16
    G): ``P`` m × r for ``dim=0``, ``Q`` n × r for ``dim=1``, 1 ≤ r ≤ 256; outs distinct,
    in G's dtype, r × n (``dim=0``) or m × r (``dim=1``); ``dim`` 0 or 1 (not a bool);
    ``norms`` and ``r_norms`` float32 tensors of shape (k, 1, n) for ``dim=0`` or (k, m, 1)
    for ``dim=1`` on their device (any strides); strides below 2**24 elements (below
    2**31 / r padded along the rank); no CUDA graph being captured."""
    return _problem(Gs, Bs, outs, dim, norms, r_norms) is None


def project_norms_list(
    Gs: list[Tensor], Bs: list[Tensor], outs: list[Tensor], c: float, dim: int, norms: Tensor,
    r_norms: Tensor,
) -> bool:  # fmt: skip
    """For every i in one launch: ``outs[i] ← Bs[i]ᵀ @ Gs[i]`` (``dim=0``, a left basis) or
    ``Gs[i] @ Bs[i]`` (``dim=1``, a right one), rounded to G's dtype; ``norms[i] ←
    ‖Gs[i] + c·(Bs[i] @ outs[i])‖₂`` per column (``dim=0``, ``(k, 1, n)``) or
    ``‖Gs[i] + c·(outs[i] @ Bs[i]ᵀ)‖₂`` per row (``dim=1``, ``(k, m, 1)``), and
    ``r_norms[i] ← ‖outs[i]‖₂`` along the same channels, in float32, from outs as rounded
    (see the module docstring). The inputs as :func:`supported_project_norms` takes them (a
    ValueError naming what is wrong otherwise, before anything is written). CUDA tensors, or
    CPU ones under ``TRITON_INTERPRET=1``. Returns True (it ran)."""
    problem = _problem(Gs, Bs, outs, dim, norms, r_norms)
    if problem is not None:
        raise ValueError(f"project_norms_list: {problem}")
    g, b, o = Gs[0], Bs[0], outs[0]
    rank = b.shape[1]
    if dim == 0:  # R = Pᵀ G: channels are G's columns, reducing over its m rows
        (K, C), (s_gk, s_gc), (s_or, s_oc) = g.shape, g.stride(), o.stride()
        s_nc, s_rc = norms.stride(2), r_norms.stride(2)
    else:  # Rᵀ = Qᵀ Gᵀ: the same on the transposes
        (C, K), (s_gc, s_gk), (s_oc, s_or) = g.shape, g.stride(), o.stride()
        s_nc, s_rc = norms.stride(1), r_norms.stride(1)
    s_pk, s_pr = b.stride()
    precision = matmul_precision(g.dtype)
    cfg = config(g.dtype, precision, rank)
    tiles = triton.cdiv(C, cfg["BLOCK_C"])
    table = offsets("project_norms_list", (Bs, Gs, outs))
    interpreted = g.device.type == "cpu"
    with launch_device(g):
        _project_norms_kernel[(tiles * len(Gs),)](
            b, g, o, table, norms, r_norms, len(Gs), tiles, K, C, rank, s_pk, s_pr, s_gk,
            s_gc, s_or, s_oc, norms.stride(0), s_nc, r_norms.stride(0), s_rc, float(c),
            PRECISION=precision,
            # the interpreter multiplies bf16 as raw integers (see lowrank.lowrank_update)
            UPCAST=g.dtype != torch.float32 and interpreted, P_BF16=b.dtype != g.dtype,
            RNE_BF16=g.dtype == torch.bfloat16 and interpreted, RESIDUAL=c != 0.0,
            enable_fp_fusion=True,
            **cfg,
        )  # fmt: skip
    return True


__all__ = ["project_norms_list", "supported_project_norms"]
