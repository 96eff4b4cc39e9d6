"""Fused AdamW step (Triton) of a bf16 weight with float32 moments.

torch's fused AdamW kernel takes the moments in the weights' dtype; with bf16 weights and
fp32 moments (galore2's default ``state_dtype``) its plain groups took four passes per
weight: the gradient cast to fp32, a zeroed fp32 buffer, torch's fused Adam kernel writing
the direction into it, and the decay and update of the weight (``ScaleByAdam`` and
``apply_updates``). Here one pass reads the weight, the gradient and both moments and
writes the weight and both moments once: 12 + 10 bytes per element for bf16 weights (22,
against 46 for the four passes; torch's fused AdamW with bf16 moments: 14).

The arithmetic is what those passes compute on CUDA, in their order: the moments and the
direction ``(1/bc1)·m / (√v/√bc2 + eps)`` as torch's fused Adam kernel computes them in
float32 (its explicit fused multiply-adds ``m ← fma(β₁, m, fma(−β₁, g, g))``, likewise
``v`` with g², the corrections ``1 − β^t`` in float32), then ``p ← p·decay`` rounded to
the weights' dtype (``_foreach_mul_``) and ``p − lr·direction`` (one multiply-add, as
nvcc contracts ``add_``'s ``a + α·b``) rounded again. The corrections' ``pow`` is the
host's here, the device's there (an ulp apart at most), so results agree with those
passes to the last bit of a rounding, not necessarily bit for bit.

Called through :func:`galore2.kernels.ops.adamw_` (a ``torch.library`` custom op, counted
as one launch by dispatch modes, shapes only on meta tensors): a list of weights in ONE
launch (:func:`adamw_list_step`, a multi-tensor apply reading a table of addresses), one
weight by :func:`adamw_step`. On an H200 (torch 2.11, Triton 3.6) a launch through the op
cost the host about 0.1-0.2 ms, so a plain group of 51 weights (Llama-350M's embeddings,
head and norms) launched one by one spent about 9 ms of host time per step on 3.6 ms of
device work (BENCHMARKS.md, "GPU session").
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from .dispatch import launch_device
from .keep import keeps, members, pointer, positions
from .rounding import to_bf16
from .tables import capturing, kept, upload

BLOCK = 1024


@triton.jit
def _adam_block(g_ptr, m_ptr, v_ptr, offs, mask, beta1, beta2, eps, inv_bc1, bc2_sqrt):
    """Adam's moments of one block (read, updated, written back in float32) and its
    direction ``(1/bc1)·m / (√v/√bc2 + eps)`` in float32, as torch's fused Adam kernel
    computes them (see the module docstring)."""
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    m = tl.fma(beta1, m, tl.fma(-beta1, g, g))
    g2 = g * g
    v = tl.fma(beta2, v, tl.fma(-beta2, g2, g2))
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    return tl.div_rn(inv_bc1 * m, denom)


@triton.jit
def _adamw_block(
    p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, beta1, beta2, eps, inv_bc1, bc2_sqrt, decay,
    neg_lr, DECAY: tl.constexpr,
):  # fmt: skip
    """One block of AdamW (the elements ``offs`` under ``mask``) of one weight."""
    d = _adam_block(g_ptr, m_ptr, v_ptr, offs, mask, beta1, beta2, eps, inv_bc1, bc2_sqrt)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    if DECAY:  # its own rounding to bf16, as the separate multiply
        p = to_bf16(p.to(tl.float32) * decay)
    p = tl.fma(neg_lr, d, p.to(tl.float32))
    tl.store(p_ptr + offs, to_bf16(p), mask=mask)


@triton.jit
def _adamw_kernel(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    n,
    beta1,
    beta2,
    eps,
    inv_bc1,  # float32 1 / bc1: the direction's scale (lr = -1 in torch's kernel)
    bc2_sqrt,
    decay,
    neg_lr,
    keep_ptr,  # a deferred step's flag (HAS_KEEP): 0 leaves the weight and moments unwritten
    DECAY: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if HAS_KEEP:  # flagged out: no element is read or written
        n = tl.where(tl.load(keep_ptr) != 0, n, 0)
    _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, offs, offs < n, beta1, beta2, eps, inv_bc1,
                 bc2_sqrt, decay, neg_lr, DECAY)  # fmt: skip


@triton.jit
def _adamw_list_kernel(
    table,  # int64: the weights', gradients', m's and v's addresses, sizes, first blocks
    count,  # weights in the list (T): the table's sections are T long
    block_owner,  # int64, one per block of the launch: the weight it belongs to
    beta1,
    beta2,
    eps,
    inv_bc1,
    bc2_sqrt,
    decay,
    neg_lr,
    keep_ptr,  # one flag per weight (HAS_KEEP): 0 leaves that weight and its moments unwritten
    DECAY: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # multi-tensor apply: block pid belongs to weight t (block_owner), its pid − first[t]-th
    pid = tl.program_id(0)
    t = tl.load(block_owner + pid)
    n = tl.load(table + 4 * count + t)
    first = tl.load(table + 5 * count + t)
    offs = (pid - first) * BLOCK + tl.arange(0, BLOCK)
    p_ptr = tl.load(table + t).to(tl.pointer_type(tl.bfloat16))
    g_ptr = tl.load(table + count + t).to(tl.pointer_type(tl.bfloat16))
    m_ptr = tl.load(table + 2 * count + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(table + 3 * count + t).to(tl.pointer_type(tl.float32))
    if HAS_KEEP:  # flagged out: no element of weight t is read or written
        n = tl.where(tl.load(keep_ptr + t) != 0, n, 0)
    _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, offs, offs < n, beta1, beta2, eps, inv_bc1,
                 bc2_sqrt, decay, neg_lr, DECAY)  # fmt: skip


@triton.jit
def _directions_kernel(
    g_ptr,
    m_ptr,
    v_ptr,
    out_ptr,
    n,
    beta1,
    beta2,
    eps,
    inv_bc1,
    bc2_sqrt,
    keep_ptr,  # one flag per ``per`` elements (HAS_KEEP: a stack's members): 0, unwritten
    at_ptr,  # HAS_AT: member j's flag is keep[at[j]]
    bc_ptr,  # HAS_STEPS: member j's 1/bc1 at bc[j], √bc2 at bc[members + j] (float32)
    per,
    members,
    HAS_KEEP: tl.constexpr,
    HAS_AT: tl.constexpr,
    HAS_STEPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # the moments and direction of _adamw_kernel; the direction rounded to bf16 into out
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if HAS_STEPS:  # members counting different steps: each its own corrections
        inv_bc1 = tl.load(bc_ptr + offs // per, mask=mask, other=1.0)
        bc2_sqrt = tl.load(bc_ptr + members + offs // per, mask=mask, other=1.0)
    if HAS_KEEP:
        member = offs // per
        if HAS_AT:
            member = tl.load(at_ptr + member, mask=mask, other=0)
        mask = mask & (tl.load(keep_ptr + member, mask=mask, other=0) != 0)
    d = _adam_block(g_ptr, m_ptr, v_ptr, offs, mask, beta1, beta2, eps, inv_bc1, bc2_sqrt)
    tl.store(out_ptr + offs, to_bf16(d), mask=mask)


def _f32(x: float) -> np.float32:
    return np.float32(x)


def corrections(beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """(1 / bc1, √bc2) of step ``step`` in float32, as torch's fused Adam kernel forms
    them (``1 − β^t`` with β and t in float32; the reciprocal rounded once)."""
    t = _f32(step)
    bc1 = _f32(1) - np.power(_f32(beta1), t)
    bc2 = _f32(1) - np.power(_f32(beta2), t)
    return float(_f32(1) / bc1), float(np.sqrt(bc2))


def adamw_step(
    p: Tensor, g: Tensor, m: Tensor, v: Tensor, *, step: int, lr: float, beta1: float,
    beta2: float, eps: float, decay: float, keep: Tensor | None = None,
) -> bool:  # fmt: skip
    """Step ``step`` (≥ 1, counted already) of AdamW on weight ``p`` (updated in place:
    ``p ← p·decay − lr·m̂/(√v̂ + eps)``) with gradient ``g`` and float32 moments ``m``,
    ``v`` (updated in place); every tensor contiguous with ``p``'s number of elements
    (:func:`supported`). ``keep``: a one-entry bool flag on the device (:func:`~.keep.keeps`);
    where it is False nothing is written. CUDA tensors, or CPU ones under
    ``TRITON_INTERPRET=1``. Returns True."""
    if not supported(p, g, m, v) or not keeps(keep, 1, p.device):
        raise ValueError(
            "adamw_step takes contiguous tensors of one size: a bf16 weight and gradient "
            f"and float32 moments, got {p.dtype} {tuple(p.shape)}, {g.dtype} "
            f"{tuple(g.shape)}, {m.dtype} {tuple(m.shape)}, {v.dtype} {tuple(v.shape)}"
        )
    if step < 1:
        raise ValueError(f"step counts this step (>= 1), got {step}")
    inv_bc1, bc2_sqrt = corrections(beta1, beta2, step)
    n = p.numel()
    flags, has_keep = pointer(keep, p)
    with launch_device(p):
        _adamw_kernel[(triton.cdiv(n, BLOCK),)](
            p, g, m, v, n, beta1, beta2, eps, inv_bc1, bc2_sqrt, decay, -lr, flags,
            DECAY=decay != 1.0, HAS_KEEP=has_keep, BLOCK=BLOCK,
        )  # fmt: skip
    return True  # it ran (galore2.kernels.dispatch.run_kernel: None means the torch path)


def _list_table(lists: tuple[list[Tensor], ...]) -> tuple[Tensor, Tensor, int]:
    """(table, block owners, blocks) of :func:`adamw_list_step`'s launch over ``lists``
    (weights, gradients, m, v): the addresses, sizes and first blocks, and each block's
    weight, on the weights' device, kept by :func:`~.tables.kept` for the same tensors at
    the same addresses."""
    ps = lists[0]
    sizes = [p.numel() for p in ps]
    addresses = [t.data_ptr() for ts in lists for t in ts]
    count, device = len(ps), ps[0].device

    def make() -> tuple[Tensor, Tensor, int]:
        blocks = [triton.cdiv(n, BLOCK) for n in sizes]
        firsts = np.concatenate(([0], np.cumsum(blocks)[:-1]))
        owners = np.repeat(np.arange(count), blocks)
        table = upload(np.concatenate((addresses, sizes, firsts, owners)), device)
        return table[: 6 * count], table[6 * count :], int(sum(blocks))

    key = ("adamw", *addresses, *sizes)  # the table is these numbers, nothing else
    return kept(key, device, make)


def adamw_list_step(
    ps: list[Tensor], gs: list[Tensor], ms: list[Tensor], vs: list[Tensor], *, step: int,
    lr: float, beta1: float, beta2: float, eps: float, decay: float,
    keep: Tensor | None = None,
) -> bool:  # fmt: skip
    """:func:`adamw_step` of every weight of ``ps`` in ONE launch (multi-tensor apply: a
    table of addresses read by each block), the same arithmetic element by element, so
    the same bits. Every tensor as :func:`supported` takes it, all on one device. Not
    while a CUDA graph is captured (its table would be a host→device copy): the caller
    launches per weight there (:func:`supported_list`). ``keep``: one bool flag per weight
    (:func:`~.keep.keeps`); a weight flagged False is not written, nor are its moments. Returns
    True."""
    if not supported_list(ps, gs, ms, vs) or not keeps(keep, len(ps), ps[0].device):
        raise ValueError(
            "adamw_list_step takes lists of one length on one device, each weight as "
            "adamw_step takes it, outside a CUDA graph's capture"
        )
    return launch_list(ps, gs, ms, vs, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                       decay=decay, keep=keep)  # fmt: skip


def launch_list(
    ps: list[Tensor], gs: list[Tensor], ms: list[Tensor], vs: list[Tensor], *, step: int,
    lr: float, beta1: float, beta2: float, eps: float, decay: float,
    keep: Tensor | None = None,
) -> bool:  # fmt: skip
    """:func:`adamw_list_step` for lists :func:`supported_list` has taken already (the
    op's path: its dispatch asked, so the ~200 tensors are not checked twice a step)."""
    if step < 1:
        raise ValueError(f"step counts this step (>= 1), got {step}")
    inv_bc1, bc2_sqrt = corrections(beta1, beta2, step)
    table, owners, blocks = _list_table((ps, gs, ms, vs))
    flags, has_keep = pointer(keep, table)
    with launch_device(ps[0]):
        _adamw_list_kernel[(blocks,)](
            table, len(ps), owners, beta1, beta2, eps, inv_bc1, bc2_sqrt, decay, -lr, flags,
            DECAY=decay != 1.0, HAS_KEEP=has_keep, BLOCK=BLOCK,
        )  # fmt: skip
    return True


def supported_list(ps: list[Tensor], gs: list[Tensor], ms: list[Tensor], vs: list[Tensor]) -> bool:
    """What :func:`adamw_list_step` takes: lists of one length, each weight's four tensors
    as :func:`supported` takes them, all on the first weight's device, and no CUDA graph
    being captured."""
    if not ps or not (len(ps) == len(gs) == len(ms) == len(vs)):
        return False
    device = ps[0].device
    if capturing(device):
        return False
    return all(
        supported(p, g, m, v) and p.device == g.device == m.device == v.device == device
        for p, g, m, v in zip(ps, gs, ms, vs, strict=True)
    )


def directions_step(
    g: Tensor, m: Tensor, v: Tensor, out: Tensor, *, step: int, beta1: float, beta2: float,
    eps: float, keep: Tensor | None = None, keep_at: list[int] | None = None,
    steps: list[int] | None = None,
) -> bool:  # fmt: skip
    """Step ``step`` (≥ 1) of Adam on float32 moments ``m``, ``v`` (updated in place) with
    direction ``g`` (bf16 or float32), writing m̂/(√v̂ + eps) rounded to bf16 into ``out``
    (:func:`supported_directions`): each element of ``g`` and ``out`` touched once (2 + 2
    bytes for bf16), the moments read and written once (16). ``keep``: one bool flag, or
    one per member of a stack (``g``'s first dimension; ``keep_at``: their positions in
    ``keep``; :func:`~.keep.keeps`): a member flagged False has neither its moments nor its
    ``out`` written. ``steps``: each member's step count (members of a stack that count
    different steps: one skipped once), ``step`` unused then. Returns True."""
    count = members(keep, keep_at, steps)
    if (
        not supported_directions(g, m, v, out)
        or not keeps(keep, count, g.device, keep_at)
        or (count > 1 and (g.dim() == 0 or g.shape[0] != count))
    ):
        raise ValueError(
            "directions_step takes contiguous tensors of one size: a bf16 or float32 "
            "direction, float32 moments and a bf16 out, got "
            f"{g.dtype} {tuple(g.shape)}, {m.dtype} {tuple(m.shape)}, {v.dtype} "
            f"{tuple(v.shape)}, {out.dtype} {tuple(out.shape)}"
        )
    if min(steps or [step]) < 1:
        raise ValueError(f"step counts this step (>= 1), got {steps or step}")
    inv_bc1, bc2_sqrt = corrections(beta1, beta2, steps[0] if steps else step)
    n = g.numel()
    flags, has_keep = pointer(keep, g)
    at = g if keep_at is None else positions(keep_at, g.device)
    bc = m if steps is None else _member_corrections(beta1, beta2, steps, g.device)
    with launch_device(g):
        _directions_kernel[(triton.cdiv(n, BLOCK),)](
            g, m, v, out, n, beta1, beta2, eps, inv_bc1, bc2_sqrt, flags, at, bc, n // count,
            count, HAS_KEEP=has_keep, HAS_AT=keep_at is not None, HAS_STEPS=steps is not None,
            BLOCK=BLOCK,
        )  # fmt: skip
    return True


def _member_corrections(
    beta1: float, beta2: float, steps: list[int], device: torch.device
) -> Tensor:
    """(1/bc1 of each member, then √bc2 of each) in float32 on ``device``, each as
    :func:`corrections` forms it: one queued copy from pinned memory."""
    pairs = [corrections(beta1, beta2, s) for s in steps]
    values = np.array([p[0] for p in pairs] + [p[1] for p in pairs], dtype=np.float32)
    return upload(values, device, torch.float32)


def supported_directions(g: Tensor, m: Tensor, v: Tensor, out: Tensor) -> bool:
    """What :func:`directions_step` takes: contiguous non-empty tensors of one size, the
    direction bf16 or float32, float32 moments, a bf16 out."""
    n = g.numel()
    return (
        n > 0
        and g.dtype in (torch.bfloat16, torch.float32)
        and m.dtype == v.dtype == torch.float32
        and out.dtype == torch.bfloat16
        and all(t.numel() == n and t.is_contiguous() for t in (g, m, v, out))
    )


def supported(p: Tensor, g: Tensor, m: Tensor, v: Tensor) -> bool:
    """What the kernel takes: contiguous non-empty tensors of one size, the weight and its
    gradient in bf16 (other dtypes: torch's fused AdamW takes fp32 weights with fp32
    moments, and fp16 ones keep the torch path), float32 moments."""
    n = p.numel()
    return (
        n > 0
        and p.dtype == g.dtype == torch.bfloat16
        and m.dtype == v.dtype == torch.float32
        and all(t.numel() == n and t.is_contiguous() for t in (p, g, m, v))
    )


__all__ = [
    "BLOCK", "adamw_list_step", "adamw_step", "directions_step", "launch_list", "supported",
    "supported_directions", "supported_list",
]  # fmt: skip
