"""The apply stage of a step: ``p ← decay·p − lr·u`` for a chunk of parameters.

A chain's outputs are dense updates (tensors) or factored ones, applied in one fused pass
each with no m×n temporary: low-rank (:class:`~galore2.core.transform.LowRankUpdate`, one
matmul into the weight) or a scaled gradient (:class:`~galore2.core.transform.ScaledUpdate`,
one ``addcmul_``); :func:`chunks` says which tensors of a group go through the chain together
(the group's ``foreach``). :func:`apply_masked` is the masked step's (``capturable=True``)
apply, its flags and decay factors device tensors (:mod:`galore2.core.masked`).
"""

from __future__ import annotations

import operator
from functools import partial

import torch
from torch import Tensor

from ..kernels.dispatch import run_kernel
from ..kernels.ops_lowrank import addmm_each_, addmm_scaled_each_, operand_dtypes
from ..kernels.ops_scaled import scaled_add_each_
from . import packing
from .masked import FlagBuffer, masked_updates
from .transform import FACTORED, LowRankUpdate, ResidualUpdate, ScaledUpdate


def chunks(params: list[Tensor], foreach: bool | None = None) -> list[list[int]]:
    """How a group's tensors are batched through the chain (the group's ``foreach``).

    ``None`` (automatic): on accelerators the whole group goes at once (foreach kernels,
    few launches); on the CPU each tensor goes alone — grad → update → apply while its
    data is in cache, with one tensor's temporaries alive at a time (batching a group
    measured ~1.6x slower). ``True`` batches every tensor of the group (one batch per
    device), ``False`` steps each tensor alone, wherever they are.
    """
    if foreach is False:
        return [[i] for i in range(len(params))]
    if foreach:
        if len(set(map(_DEVICE, params))) <= 1:  # one device (the usual case): one pass in C
            return [list(range(len(params)))] if params else []
        by_device: dict[torch.device, list[int]] = {}
        for i, p in enumerate(params):
            by_device.setdefault(p.device, []).append(i)
        return list(by_device.values())
    cpu = [i for i, p in enumerate(params) if p.device.type == "cpu"]
    rest = [i for i, p in enumerate(params) if p.device.type != "cpu"]
    return [[i] for i in cpu] + ([rest] if rest else [])


Update = Tensor | LowRankUpdate | ScaledUpdate | ResidualUpdate
_DEVICE = operator.attrgetter("device")


def apply_updates(params: list[Tensor], updates: list[Update], lr: float, decay: float) -> None:
    """:func:`apply_update` over a batch: dense updates of several tensors by two foreach
    kernels (decay, then ``p ← p − lr·u``), low-rank ones of one shape batch by one grouped
    ``addmm_`` (:func:`_low_rank_lists`), scaled gradients of one shape batch by one grouped
    ``addcmul_`` (:func:`_scaled_lists`), their sums (:class:`ResidualUpdate`) by one grouped
    ``addmm_`` with the scaled gradient in its epilogue, the other factored ones one by one
    (one fused pass each)."""
    kinds = set(map(type, updates))  # which groupings can find anything (one C-level pass)
    dense = [i for i, u in enumerate(updates) if not isinstance(u, FACTORED)]
    if len(dense) > 1:
        ps = [params[i] for i in dense]
        if decay != 1.0:
            torch._foreach_mul_(ps, decay)
        torch._foreach_add_(ps, [updates[i] for i in dense], alpha=-lr)  # type: ignore[misc]
    grouped = _low_rank_lists(params, updates) if LowRankUpdate in kinds else []
    for idx in grouped:
        first = updates[idx[0]]
        assert isinstance(first, LowRankUpdate)
        targets = [params[i].view(first.A.shape[0], first.B.shape[1]) for i in idx]
        As = [updates[i].A for i in idx]  # type: ignore[union-attr]
        Bs = [updates[i].B for i in idx]  # type: ignore[union-attr]
        addmm_each_(targets, As, Bs, -lr * first.scale, decay, *_flags(updates, idx))
    scaled = _scaled_lists(params, updates) if ScaledUpdate in kinds else []
    for idx in scaled:
        Gs = [updates[i].G for i in idx]  # type: ignore[union-attr]
        factors = [updates[i].factor for i in idx]  # type: ignore[union-attr]
        scaled_add_each_([params[i] for i in idx], Gs, _factors(factors), -lr, decay,
                         *_flags(updates, idx))  # fmt: skip
    residual = _residual_lists(params, updates) if ResidualUpdate in kinds else []
    for idx in residual:
        lows = [updates[i].low for i in idx]  # type: ignore[union-attr]
        highs = [updates[i].scaled for i in idx]  # type: ignore[union-attr]
        targets = [params[i].view(highs[0].G.shape) for i in idx]
        addmm_scaled_each_(targets, [u.A for u in lows], [u.B for u in lows],
                           [u.G for u in highs], _factors([u.factor for u in highs]),
                           -lr * lows[0].scale, decay, -lr, *_flags(updates, idx))  # fmt: skip
    done = {i for idx in grouped + scaled + residual for i in idx}
    for i, (p, u) in enumerate(zip(params, updates, strict=True)):
        if i not in done and isinstance(u, FACTORED) and u.keep is not None:
            raise RuntimeError("a deferred step's factored update left its shape batch's launch")
        if i not in done and (len(dense) <= 1 or isinstance(u, FACTORED)):
            apply_update(p, u, lr, decay)


def _flags(updates: list[Update], idx: list[int]) -> tuple[Tensor | None, list[int] | None]:
    """(keep, keep_at) of a shape batch's factored updates at ``idx``: a deferred step's
    flags (one tensor, each update's position in it), or (None, None) on other steps."""
    keep = updates[idx[0]].keep  # type: ignore[union-attr]
    if keep is None:
        return None, None
    if any(updates[i].keep is not keep for i in idx):  # type: ignore[union-attr]
        raise RuntimeError("a shape batch's updates carry flags of different steps")
    return keep, [p for i in idx for p in updates[i].keep_at]  # type: ignore[union-attr]


def _low_rank_lists(params: list[Tensor], updates: list[Update]) -> list[list[int]]:
    """The positions of low-rank updates that one grouped ``addmm_`` applies: two or more of
    one shape batch (the same factor shapes, strides, dtypes and scale) into contiguous
    weights of one dtype on one device, the factors in it (or a float32 basis for bf16
    weights: :func:`~galore2.kernels.ops_lowrank.operand_dtypes`). What :func:`apply_update` does to each, one
    launch for them all where the grouped kernel runs (:mod:`galore2.kernels.ops_lowrank`)."""
    by: dict[tuple, list[int]] = {}
    for i, (p, u) in enumerate(zip(params, updates, strict=True)):
        if (
            isinstance(u, LowRankUpdate)
            and p.is_contiguous()
            and operand_dtypes(p.dtype, u.A.dtype, u.B.dtype) is not None
        ):
            key = (u.A.shape, u.B.shape, u.A.stride(), u.B.stride(), u.A.dtype, u.B.dtype,
                   u.scale, p.dtype, p.device, u.keep is None)  # fmt: skip
            by.setdefault(key, []).append(i)
    return [idx for idx in by.values() if len(idx) > 1]


def _scaled_lists(params: list[Tensor], updates: list[Update]) -> list[list[int]]:
    """The positions of scaled gradients that one grouped ``addcmul_`` applies
    (``galore2::scaled_add_each_``): two or more with gradients of one shape, strides and
    dtype and factors of one shape, into contiguous weights of one dtype on one device.
    What :func:`apply_update` does to each, one launch for them all where the kernel runs
    (:mod:`galore2.kernels.ops_scaled`)."""
    by: dict[tuple, list[int]] = {}
    for i, (p, u) in enumerate(zip(params, updates, strict=True)):
        if isinstance(u, ScaledUpdate) and p.is_contiguous() and u.G.dim() == 2:
            key = (u.G.shape, u.G.stride(), u.G.dtype, u.factor.shape, u.factor.dtype,
                   p.dtype, p.device, u.keep is None)  # fmt: skip
            by.setdefault(key, []).append(i)
    return [idx for idx in by.values() if len(idx) > 1]


def _factors(factors: list[Tensor]) -> Tensor:
    """A shape batch's scaling factors as one stack: the view of the stack they are the
    entries of (a combination's own), else a new one."""
    stack = packing.stacked_view(factors)
    return torch.stack(factors) if stack is None else stack


def _residual_lists(params: list[Tensor], updates: list[Update]) -> list[list[int]]:
    """The positions of :class:`ResidualUpdate` s that one grouped ``addmm_`` with a scaled
    gradient in its epilogue applies (``galore2::addmm_scaled_each_``): two or more whose
    low-rank parts :func:`_low_rank_lists` and scaled parts :func:`_scaled_lists` would
    group alike."""
    lows = [u.low if isinstance(u, ResidualUpdate) else None for u in updates]
    highs = [u.scaled if isinstance(u, ResidualUpdate) else None for u in updates]
    by_low = {i: n for n, idx in enumerate(_low_rank_lists(params, lows)) for i in idx}  # type: ignore[arg-type]
    by: dict[tuple, list[int]] = {}
    for n, idx in enumerate(_scaled_lists(params, highs)):  # type: ignore[arg-type]
        for i in idx:
            if i in by_low:
                by.setdefault((by_low[i], n), []).append(i)
    return [idx for idx in by.values() if len(idx) > 1]


def apply_masked(
    params: list[Tensor],
    updates: list[Update],
    lr: float,
    flags: FlagBuffer,
    positions: list[int],
    decays: list[Tensor] | None,
) -> None:
    """``p ← decay·p − lr·mask·u`` with ``mask = flags.entries[position]`` (the batch's
    flags: each parameter's 0-d 1.0 / 0.0, on the device) and ``decay`` a 0-d device tensor per
    parameter (the masked step, ``capturable=True``): dense updates masked per stack they form (:func:`masked_updates`)
    and applied by foreach kernels, factored ones by one fused pass each with the mask in
    their small operand (a low-rank update's ``B``, a scaled gradient's factor). Updates are finite (a masked parameter stepped on a zero gradient), so
    ``u·0`` is 0."""
    dense = [i for i, u in enumerate(updates) if not isinstance(u, FACTORED)]
    if dense:
        ps = [params[i] for i in dense]
        if decays is not None:
            torch._foreach_mul_(ps, [decays[i] for i in dense])
        # u·mask, then p − lr·(u·mask): the same bits as the host path's p − lr·u where usable
        # (one addcmul would round (−lr·u)·mask apart from add's fused p + α·u: not the bits)
        us = masked_updates([updates[i] for i in dense], flags, [positions[i] for i in dense])  # type: ignore[misc]
        torch._foreach_add_(ps, us, alpha=-lr)
    oks = flags.entries
    for p, u, i in zip(params, updates, range(len(params)), strict=True):
        if isinstance(u, FACTORED):
            if decays is not None:
                p.mul_(decays[i])
            ok = oks[positions[i]]
            apply_update(p, _masked(u, ok), lr, 1.0)


def _masked(u: Update, ok: Tensor) -> Update:
    """A factored update times its parameter's flag ``ok`` (1.0 / 0.0), in its small operand."""
    if isinstance(u, LowRankUpdate):
        return LowRankUpdate(u.A, u.B * ok, u.shape, u.scale)
    if isinstance(u, ResidualUpdate):
        return ResidualUpdate(_masked(u.low, ok), _masked(u.scaled, ok))  # type: ignore[arg-type]
    return ScaledUpdate(u.G, u.factor * ok, u.shape)  # type: ignore[union-attr]


def apply_update(p: Tensor, u: Update, lr: float, decay: float) -> None:
    """p ← decay·p − lr·u; a low-rank u is applied by one fused ``addmm_`` (no m×n temporary),
    or on CUDA by the Triton matmul with that epilogue (:mod:`galore2.kernels.lowrank`); a
    scaled gradient by one ``addcmul_`` (p − lr·G·factor, in float32 for a 16-bit p); their
    sum (:class:`ResidualUpdate`) by the one then the other."""
    if isinstance(u, ResidualUpdate):
        apply_update(p, u.low, lr, decay)
        apply_update(p, u.scaled, lr, 1.0)
        return
    if isinstance(u, ScaledUpdate):
        if p.is_contiguous():
            target = p.view(u.G.shape)
            if decay != 1.0:
                target.mul_(decay)
            target.addcmul_(u.G, u.factor, value=-lr)
            return
        u = u.dense()  # type: ignore[assignment]
    if isinstance(u, LowRankUpdate):
        target = p.view(u.A.shape[0], u.B.shape[1]) if p.is_contiguous() else None
        if target is not None:
            if u.A.dtype != p.dtype or u.B.dtype != p.dtype:  # a fp32 basis, rounded
                u = LowRankUpdate(*u.operands(p.dtype), u.shape, u.scale)
            if (
                run_kernel(
                    "lowrank",
                    target,
                    u.A,
                    u.B,
                    supported=lambda k: k.supported(target, u.A, u.B),
                    kernel=lambda k: partial(
                        k.lowrank_update, target, u.A, u.B, alpha=-lr * u.scale, beta=decay
                    ),
                )
                is not None
            ):
                return
            target.addmm_(u.A, u.B, beta=decay, alpha=-lr * u.scale)
            return
        u = u.dense()
    if decay != 1.0:
        p.mul_(decay)
    p.add_(u, alpha=-lr)
