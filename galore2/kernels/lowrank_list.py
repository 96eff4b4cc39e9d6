"""Grouped matmuls (Triton): ``out_i ← β·p_i + α·(A_i @ B_i)`` for a list of same-shape
matrices in ONE launch.

GaLore projects each matrix of a shape batch (R_i = P_iᵀG_i or G_i·Q_i) and writes each
update back into its weight (p_i ← decay·p_i − lr·scale·P_i·N_i). With one cuBLAS call per
matrix each is read where it is — the gradient once, the weight read and written once —
but a step of Llama-350M makes 336 such calls, and on an H200 machine an eager launch cost
the host about 25 µs (BENCHMARKS.md, "GPU session"); stacking the gradients into one
``bmm`` saves the launches but copies every gradient and writes a dense update.

Here each program computes one tile of one entry — entry ``pid // tiles``, tile
``pid % tiles`` by the single-matrix kernel's tile function
(:func:`galore2.kernels.lowrank.lowrank_tile`: fp32 accumulation, the epilogue reading
p's tile once) — with the entry's operands found from a table of element offsets from the
first entry's (:func:`~galore2.kernels.tables.kept`, while the tensors stay
where they are). The entries share their shapes, strides and dtypes (a shape batch's
matrices, its stacks' views): every offset but the base is the same. With β = 0 the p_i
are not read (a projection into R's entries). A float32 operand of a bf16 product (a
stored fp32 basis against bf16 gradients or weights) is rounded to bf16 as its tiles are
loaded: the bits of casting it first, without the cast's pass over the bases.

:func:`addmm_scaled_list` is Fira's step along the data on the same launch: each weight
``p_i ← β·p_i + α·(A_i @ B_i) + γ·G_i ⊙ f_i`` (the back-projection plus the scaled residual
term; G_i the gradient, f a float32 stack of per-row, per-column or per-matrix factors), the
epilogue reading G's tile and f's entries once (the tile function's ``SCALED`` term; the
gradients' offsets a fifth list of the table).

Called through galore2's custom ops (:mod:`galore2.kernels.ops_lowrank`), which run the
torch path elsewhere (one ``mm`` / ``addmm_`` per entry: the same products up to summation
order). Not while a CUDA graph is captured (the table's copy): the ops launch per entry.
"""

from __future__ import annotations

import operator

import torch
import triton
import triton.language as tl
from torch import Tensor

from .checks import factor_problem
from .dispatch import launch_device
from .keep import check, keeps, pointer, positions
from .lowrank import DTYPES, config, lowrank_tile, matmul_precision, small_strides
from .ops_lowrank import operand_dtypes
from .tables import capturing, offsets


@triton.jit
def _lowrank_list_kernel(
    a_ptr, b_ptr, p_ptr, out_ptr, table, count, tiles, M, N, K, s_am, s_ak, s_bk, s_bn, s_pm,
    s_pn, s_om, s_on, alpha, beta, keep_ptr, at_ptr, g_ptr, s_gm, s_gn, f_ptr, s_fe, s_fm,
    s_fn, gamma, BETA_ZERO: tl.constexpr, HAS_KEEP: tl.constexpr, HAS_AT: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    A_BF16: tl.constexpr, B_BF16: tl.constexpr, SCALED: tl.constexpr,
    F_ROWS: tl.constexpr, F_COLS: tl.constexpr, RNE_BF16: tl.constexpr,
):  # fmt: skip
    """Tile ``pid % tiles`` of entry ``pid // tiles``; ``SCALED``: plus ``γ·G ⊙ f`` (G's
    offsets the table's fifth list, f the factor stack's entry e)."""
    pid = tl.program_id(0)
    e = pid // tiles
    if HAS_KEEP:  # a constexpr branch: no load without flags
        # an entry flagged 0 (a deferred step's unusable gradient) is not written
        flag = e
        if HAS_AT:  # entry e's flag is keep[at[e]]
            flag = tl.load(at_ptr + e)
        if tl.load(keep_ptr + flag) == 0:
            return
    a_off = tl.load(table + e)  # element offsets from the first entry's operands
    b_off = tl.load(table + count + e)
    p_off = tl.load(table + 2 * count + e)
    o_off = tl.load(table + 3 * count + e)
    g_entry = g_ptr
    f_entry = f_ptr
    if SCALED:
        g_entry = g_ptr + tl.load(table + 4 * count + e)
        f_entry = f_ptr + e.to(tl.int64) * s_fe
    lowrank_tile(a_ptr + a_off, b_ptr + b_off, p_ptr + p_off, out_ptr + o_off, pid % tiles,
                 M, N, K, s_am, s_ak, s_bk, s_bn, s_pm, s_pn, s_om, s_on, alpha, beta,
                 BETA_ZERO, PRECISION, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, A_BF16,
                 B_BF16, g_entry, s_gm, s_gn, f_entry, s_fm, s_fn, gamma, SCALED, F_ROWS,
                 F_COLS, RNE_BF16)  # fmt: skip


#: in ``GALORE2_KERNELS=auto`` (then every shape batch goes along the data on it where it
#: runs: :func:`galore2.optim.lowrank_batch.along_data`). Counted on the CPU, not yet timed
#: on a GPU; False puts the stacked path (a ``bmm`` each way per batch) back as the default.
AUTO = True


_LAYOUT = operator.attrgetter("shape", "dtype", "device")
_STRIDES = operator.methodcaller("stride")


def _same(ts: list[Tensor], first: Tensor) -> bool:
    """Every tensor of ``ts`` of ``first``'s shape, strides, device and dtype (C-level maps
    over the list: a step's lists hold hundreds)."""
    layout, strides = _LAYOUT(first), first.stride()
    return all(map(layout.__eq__, map(_LAYOUT, ts))) and all(
        map(strides.__eq__, map(_STRIDES, ts))
    )


def supported_list(
    outs: list[Tensor], ps: list[Tensor], As: list[Tensor], Bs: list[Tensor]
) -> bool:  # fmt: skip
    """What :func:`lowrank_list` takes: lists of one length (two entries or more) of non-empty
    2-D tensors on one device, outputs in a dtype of :data:`~galore2.kernels.lowrank.DTYPES`
    and operands in it too (or float32 for bf16 outputs: :func:`operand_dtypes`), each list's
    entries of one shape and strides (strides below 2**24 elements), ``A_i @ B_i`` of
    ``p_i``'s shape, and no CUDA graph being captured."""
    k = len(outs)
    if k < 2 or not (len(ps) == len(As) == len(Bs) == k):
        return False
    firsts = (outs[0], ps[0], As[0], Bs[0])
    dtype, device = outs[0].dtype, outs[0].device
    if dtype not in DTYPES or capturing(device):
        return False
    dtypes = [dtype, dtype, *(operand_dtypes(dtype, As[0].dtype, Bs[0].dtype) or (None, None))]
    if any(t.dim() != 2 or t.dtype != d or t.device != device
           for t, d in zip(firsts, dtypes, strict=True)):  # fmt: skip
        return False
    o, p, a, b = firsts
    if not (p.shape == o.shape == (a.shape[0], b.shape[1]) and a.shape[1] == b.shape[0]):
        return False
    if o.numel() == 0 or a.shape[1] == 0:  # nothing to launch for (the torch path's)
        return False
    if not small_strides(*firsts):
        return False
    return all(_same(ts, t) for ts, t in zip((outs, ps, As, Bs), firsts, strict=True))


def lowrank_list(
    outs: list[Tensor], ps: list[Tensor], As: list[Tensor], Bs: list[Tensor], *,
    alpha: float, beta: float, keep: Tensor | None = None, keep_at: list[int] | None = None,
) -> bool:  # fmt: skip
    """``outs[i] ← beta·ps[i] + alpha·(As[i] @ Bs[i])`` for every i in one launch (``outs``
    may be ``ps``: in place; with ``beta == 0`` the ps are not read). The lists as
    :func:`supported_list` takes them. ``keep``: one bool flag per entry on the device
    (``keep_at``: their positions in it; :func:`~.keep.keeps`); an entry flagged False is
    not written. CUDA
    tensors, or CPU ones under ``TRITON_INTERPRET=1``. Returns True (it ran)."""
    if not supported_list(outs, ps, As, Bs) or not keeps(keep, len(outs), outs[0].device,
                                                         keep_at):  # fmt: skip
        raise ValueError(
            "lowrank_list takes lists of one length (2 or more) of 2-D tensors of one dtype "
            "and device, each list's entries of one shape and strides, A @ B of p's shape, "
            "outside a CUDA graph's capture"
        )
    return launch_list(outs, ps, As, Bs, alpha=alpha, beta=beta, keep=keep, keep_at=keep_at)


def launch_list(
    outs: list[Tensor], ps: list[Tensor], As: list[Tensor], Bs: list[Tensor], *,
    alpha: float, beta: float, keep: Tensor | None = None, keep_at: list[int] | None = None,
) -> bool:  # fmt: skip
    """:func:`lowrank_list` for lists :func:`supported_list` has taken already, and flags
    checked (the ops' path: their dispatch asked, so a step's hundreds of tensors are not
    walked twice)."""
    return _launch(outs, ps, As, Bs, alpha, beta, keep, keep_at)


def _launch(
    outs: list[Tensor], ps: list[Tensor], As: list[Tensor], Bs: list[Tensor], alpha: float,
    beta: float, keep: Tensor | None, keep_at: list[int] | None,
    scaled: tuple[list[Tensor], Tensor, float] | None = None,
) -> bool:  # fmt: skip
    """The one launch of :func:`lowrank_list` and (``scaled``: the gradients, the factor
    stack and γ) :func:`addmm_scaled_list`, their inputs checked already."""
    o, p, a, b = outs[0], ps[0], As[0], Bs[0]
    M, K = a.shape
    N = b.shape[1]
    precision = matmul_precision(o.dtype)
    cfg = config(o.dtype, precision)
    tiles = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
    lists = (As, Bs, ps, outs) if scaled is None else (As, Bs, ps, outs, scaled[0])
    table = offsets("lowrank_list", lists)
    flags, _ = pointer(keep, table)
    at = table if keep_at is None else positions(keep_at, o.device)
    interpreted = o.device.type == "cpu"
    if scaled is None:  # no scaled term: its pointers stand in, never read
        g, f, gamma = o, o, 0.0
        g_strides, f_strides = (0, 0), (0, 0, 0)
    else:
        Gs, f, gamma = scaled
        g, g_strides, f_strides = Gs[0], Gs[0].stride(), f.stride()
    with launch_device(o):
        _lowrank_list_kernel[(tiles * len(outs),)](
            a, b, p, o, table, len(outs), tiles, M, N, K, a.stride(0), a.stride(1),
            b.stride(0), b.stride(1), p.stride(0), p.stride(1), o.stride(0), o.stride(1),
            float(alpha), float(beta), flags, at, g, *g_strides, f, *f_strides, float(gamma),
            BETA_ZERO=beta == 0, HAS_KEEP=keep is not None, HAS_AT=keep_at is not None,
            PRECISION=precision,
            # the interpreter multiplies bf16 as raw integers (see lowrank_update)
            UPCAST=o.dtype != torch.float32 and interpreted, GROUP_M=8,
            A_BF16=a.dtype != o.dtype, B_BF16=b.dtype != o.dtype, SCALED=scaled is not None,
            F_ROWS=scaled is not None and f.shape[1] != 1,
            F_COLS=scaled is not None and f.shape[2] != 1,
            RNE_BF16=scaled is not None and o.dtype == torch.bfloat16 and interpreted,
            enable_fp_fusion=True, **cfg,
        )  # fmt: skip
    return True


def _scaled_problem(
    ps: list[Tensor], As: list[Tensor], Bs: list[Tensor], Gs: list[Tensor], factor: Tensor
) -> str | None:  # fmt: skip
    """Why :func:`addmm_scaled_list` does not take these (None when it does)."""
    if not supported_list(ps, ps, As, Bs):
        return (
            "ps, As and Bs must be lists of one length (2 or more) of non-empty 2-D tensors "
            "on one device as lowrank_list takes them (ps of one dtype among "
            f"{DTYPES}, As and Bs of ps' dtype or float32 for bf16 ps, each list's entries of "
            "one shape and strides, A @ B of p's shape), outside a CUDA graph's capture"
        )
    p, k = ps[0], len(ps)
    if len({t.data_ptr() for t in ps}) != k:
        return "ps must be distinct tensors (each is written once)"
    if not (isinstance(Gs, (list, tuple)) and len(Gs) == k and isinstance(Gs[0], Tensor)):
        return f"Gs must be a list of {k} tensors"
    g = Gs[0]
    if g.dtype not in DTYPES or g.shape != p.shape or g.device != p.device or not _same(Gs, g):
        return (
            f"Gs must be {k} tensors of ps' shape {tuple(p.shape)} on {p.device}, of one "
            f"dtype among {DTYPES} and one strides"
        )
    problem = factor_problem(factor, k, *p.shape, p.device)
    if problem is not None:
        return problem
    if not small_strides(g, factor):
        return "strides of 2**24 elements or more are not supported"
    return None


def supported_scaled_list(
    ps: list[Tensor], As: list[Tensor], Bs: list[Tensor], Gs: list[Tensor], factor: Tensor
) -> bool:  # fmt: skip
    """What :func:`addmm_scaled_list` takes: ps, As and Bs as :func:`supported_list` takes
    them for an in-place update (ps distinct); Gs as many tensors of ps' shape on their
    device, of one dtype in :data:`~galore2.kernels.lowrank.DTYPES` and one strides;
    ``factor`` a float32 tensor of shape (k, 1, n), (k, m, 1) or (k, 1, 1) there (any
    strides); strides below 2**24 elements."""
    return _scaled_problem(ps, As, Bs, Gs, factor) is None


def addmm_scaled_list(
    ps: list[Tensor], As: list[Tensor], Bs: list[Tensor], Gs: list[Tensor], factor: Tensor,
    *, alpha: float, beta: float, gamma: float, keep: Tensor | None = None,
    keep_at: list[int] | None = None,
) -> bool:  # fmt: skip
    """``ps[i] ← beta·ps[i] + alpha·(As[i] @ Bs[i]) + gamma·Gs[i] ⊙ factor[i]`` in place for
    every i in one launch (Fira's step along the data: the back-projection plus the scaled
    residual term), formed in float32 (the product accumulated in fp32) and rounded once to
    ps' dtype; with ``beta == 0`` the ps are not read. The inputs as
    :func:`supported_scaled_list` takes them (a ValueError naming what is wrong otherwise,
    before anything is written). ``keep`` / ``keep_at``: as :func:`lowrank_list` takes them.
    CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``. Returns True (it ran)."""
    problem = _scaled_problem(ps, As, Bs, Gs, factor)
    if problem is not None:
        raise ValueError(f"addmm_scaled_list: {problem}")
    check("addmm_scaled_list", keep, len(ps), ps[0].device, keep_at)
    return _launch(ps, ps, As, Bs, alpha, beta, keep, keep_at, (Gs, factor, gamma))


__all__ = [
    "addmm_scaled_list", "launch_list", "lowrank_list", "supported_list",
    "supported_scaled_list",
]  # fmt: skip
