"""The channel norms of Fira's residuals over a list of same-shape matrices (Triton), one
launch.

Fira's norm-growth limiter needs, for each gradient ``G_i`` (m × n) of a shape batch, the
norms of the residual ``G_i + c·A_i @ B_i`` per column (``dim=0``: reducing over the rows,
``out`` k × 1 × n) or per row (``dim=1``: k × m × 1); ``c = −1`` with ``A_i @ B_i = P_i·R_i``
(a left basis) or ``R_i·Q_iᵀ`` (a right one) is the part of ``G_i`` outside its subspace
(:mod:`galore2.optim.residual`). :func:`residual_norms_list` gives
``vector_norm(G_i + c·(A_i @ B_i), dim, keepdim=True)`` in float32 without forming the
residual: G upcast, the product's operands in G's dtype (float32 ones of a bf16 G rounded to
bf16 as their tiles load: the bits of casting them first), products accumulated in fp32.

Each program owns a block of channels of one entry (entry ``pid // tiles``; its tensors
found from a table of element offsets from the first entry's, as
:mod:`galore2.kernels.lowrank_list` does, so the gradients stay where they are) and walks
the reduced dimension in tiles: each tile the product's tile by the grouped matmuls' K loop
(:func:`galore2.kernels.lowrank.tile_product`), plus G's tile, squared and summed in
float32. No two programs write one output and nothing is accumulated across programs
(deterministic, no atomics). Per-row norms are the per-column norms of the transpose
(``Gᵀ + c·Bᵀ @ Aᵀ``: the same kernel with the strides swapped).

Called through galore2's ops (``galore2::residual_norms_each``), which run the torch path
elsewhere. Not while a CUDA graph is captured (the table's copy).
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
from .tables import offsets

#: in ``GALORE2_KERNELS=auto``: one launch per shape batch where the torch path forms each
#: residual (a matmul and a norm per matrix); written and tested under the interpreter, not
#: yet timed on a GPU (False: auto keeps the torch path).
AUTO = True


def config(dtype: torch.dtype, precision: str | None) -> dict[str, int]:
    """Tile sizes (fixed, no autotune): 64 channels × 64 reduced indices per tile (more
    programs than the matmuls' 128-wide tiles: the grid spans the channels only), K steps
    of 64 for 16-bit / 32 for TF32 / 16 for fp32 FMA."""
    block_k = 64 if dtype != torch.float32 else 32 if precision == "tf32" else 16
    return {"BLOCK_R": 64, "BLOCK_C": 64, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 2}


@triton.jit
def _residual_norms_kernel(
    a_ptr, b_ptr, g_ptr, table, out_ptr, count, tiles, R, C, K, s_ar, s_ak, s_bk, s_bc,
    s_gr, s_gc, s_oe, s_oc, c, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    A_BF16: tl.constexpr, B_BF16: tl.constexpr,
):  # fmt: skip
    """Channels ``c0 … c0+BLOCK_C−1`` of entry ``e``: ``sqrt(Σ_r (G[r, ch] + c·(A @ B)[r, ch])²)``
    over the R reduced indices, in float32 (A: R × K, B: K × C, G: R × C by their strides)."""
    e, c0, a_e, b_e, g_e = channel_block(table, count, tiles, BLOCK_C, a_ptr, b_ptr, g_ptr)
    lr = tl.arange(0, BLOCK_R)
    lc = tl.arange(0, BLOCK_C)
    c_ok = (c0 + lc) < C
    g_ptrs = g_e + c0.to(tl.int64) * s_gc + (lr[:, None] * s_gr + lc[None, :] * s_gc)
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        # r0 as a tensor (the interpreter's loop index is a Python int)
        prod = tile_product(a_e, b_e, tl.cast(r0, tl.int32), c0, R, C, K, s_ar, s_ak, s_bk, s_bc, PRECISION,
                            UPCAST, BLOCK_R, BLOCK_C, BLOCK_K, A_BF16, B_BF16)  # fmt: skip
        mask = ((r0 + lr) < R)[:, None] & c_ok[None, :]
        g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        x = g + c * prod  # zero outside the matrix: both terms are
        acc += x * x
        g_ptrs += BLOCK_R * s_gr
    norms = tl.sqrt_rn(tl.sum(acc, axis=0))
    o_tile = out_ptr + e.to(tl.int64) * s_oe + c0.to(tl.int64) * s_oc
    tl.store(o_tile + lc * s_oc, norms, mask=c_ok)


def _problem(
    Gs: list[Tensor], As: list[Tensor], Bs: list[Tensor], dim: int, out: Tensor
) -> str | None:  # fmt: skip
    """Why :func:`residual_norms_list` does not take these (None when it does)."""
    if not supported_list(Gs, Gs, As, Bs):
        return (
            "Gs, As and Bs must be lists of one length (2 or more) of non-empty 2-D tensors on "
            "one device, Gs of one dtype among float32 / bf16 / fp16, As and Bs of G's dtype "
            "(or float32 for a bf16 G), each list's entries of one shape and strides, "
            "A @ B of G's shape with a rank of 1 or more, strides below 2**24 elements, "
            "outside a CUDA graph's capture"
        )
    g = Gs[0]
    problem = norms_problem(out, dim, len(Gs), *g.shape, g.device)
    if problem is not None:
        return problem
    if not small_strides(out):
        return "strides of 2**24 elements or more are not supported"
    return None


def supported_residual(
    Gs: list[Tensor], As: list[Tensor], Bs: list[Tensor], dim: int, out: Tensor
) -> bool:  # fmt: skip
    """What :func:`residual_norms_list` takes: Gs, As and Bs as
    :func:`~galore2.kernels.lowrank_list.supported_list` takes them for outputs Gs (2 or more
    non-empty 2-D entries per list, each list of one shape, strides, dtype and device;
    ``A_i @ B_i`` of G's shape, rank ≥ 1; operands in G's dtype or float32 for a bf16 G);
    ``dim`` 0 or 1; ``out`` a float32 tensor of shape (k, 1, n) for ``dim=0`` or (k, m, 1)
    for ``dim=1`` on their device (any strides); strides below 2**24 elements; no CUDA graph
    being captured."""
    return _problem(Gs, As, Bs, dim, out) is None


def residual_norms_list(
    Gs: list[Tensor], As: list[Tensor], Bs: list[Tensor], c: float, dim: int, out: Tensor
) -> bool:  # fmt: skip
    """``out[i] ← ‖Gs[i] + c·(As[i] @ Bs[i])‖₂`` along ``dim`` (keepdim) for every i in one
    launch: per column for ``dim=0`` (``out`` k × 1 × n), per row for ``dim=1`` (k × m × 1),
    in float32 (see the module docstring). The inputs as :func:`supported_residual` takes
    them (a ValueError naming what is wrong otherwise, before anything is written). CUDA
    tensors, or CPU ones under ``TRITON_INTERPRET=1``. Returns True (it ran)."""
    problem = _problem(Gs, As, Bs, dim, out)
    if problem is not None:
        raise ValueError(f"residual_norms_list: {problem}")
    g, a, b = Gs[0], As[0], Bs[0]
    K = a.shape[1]
    if dim == 0:  # columns of G + c·A @ B: reduce over the rows
        first, second, s_oc = As, Bs, out.stride(2)
        (R, C), (s_gr, s_gc) = g.shape, g.stride()
        (s_ar, s_ak), (s_bk, s_bc) = a.stride(), b.stride()
    else:  # rows: the columns of Gᵀ + c·Bᵀ @ Aᵀ
        first, second, s_oc = Bs, As, out.stride(1)
        (C, R), (s_gc, s_gr) = g.shape, g.stride()
        (s_bc, s_bk), (s_ak, s_ar) = a.stride(), b.stride()
    precision = matmul_precision(g.dtype)
    cfg = config(g.dtype, precision)
    tiles = triton.cdiv(C, cfg["BLOCK_C"])
    table = offsets("residual_list", (first, second, Gs))
    with launch_device(g):
        _residual_norms_kernel[(tiles * len(Gs),)](
            first[0], second[0], g, table, out, len(Gs), tiles, R, C, K, s_ar, s_ak, s_bk,
            s_bc, s_gr, s_gc, out.stride(0), s_oc, float(c), PRECISION=precision,
            # the interpreter multiplies bf16 as raw integers (see lowrank.lowrank_update)
            UPCAST=g.dtype != torch.float32 and g.device.type == "cpu",
            A_BF16=first[0].dtype != g.dtype, B_BF16=second[0].dtype != g.dtype,
            enable_fp_fusion=True, **cfg,
        )  # fmt: skip
    return True


__all__ = ["residual_norms_list", "supported_residual"]
