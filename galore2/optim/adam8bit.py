"""Adam with 8-bit blockwise-quantized moments: ``ScaleByAdam(moments="dynamic8")``.

Every 8-bit path of :class:`~galore2.optim.adam.ScaleByAdam` lives here; the format (block
layout, bitsandbytes' dynamic code maps, quantize / dequantize) is
:mod:`galore2.storage.dynamic8`, whose names are re-exported here for compatibility.
Each step dequantizes the moments to fp32, runs Adam's single-tensor arithmetic
(:func:`~galore2.optim.adam_paths.adam_single`) and quantizes them back; the returned
direction is computed from the fp32 moments before requantization (as bitsandbytes' 8-bit
Adam does). Per direction (:func:`update_quantized`): the fused Triton kernel
(:mod:`galore2.kernels.adam8bit`, same arithmetic and block layout, on CUDA with triton;
see :mod:`galore2.kernels.dispatch`, ``GALORE2_KERNELS``), else :func:`torch_quantized` —
on the CPU, where the storage layer quantizes in torch, chunk by chunk (~2^20 elements of
whole blocks, :func:`_update_chunks`: no full-size fp32 moments, the same bits), elsewhere
on fp32 copies of the moments (bitsandbytes' quantizer). The kernel's quantizer picks the
exact nearest code (bitsandbytes' CPU quantizer is off by a code or more on a few percent
of elements). Quantized moments are always updated in fp32 (``state_dtype`` does not apply
to them). Batched (:class:`~galore2.optim.adam.ScaleByAdam8bit`, :func:`step_batch`): the
CPU's packs (:func:`_step_packed`), and elsewhere one :func:`adam8bit_stack_` per stack of
same-shape directions. ``ScaleByAdam8bit`` itself (which only fixes the storage and turns
the batched 8-bit step on) is defined next to ``ScaleByAdam`` and re-exported by
:mod:`galore2.optim`: this module is below :mod:`galore2.optim.adam`, whose dispatcher
calls it.
"""

from __future__ import annotations

import operator
from functools import partial
from typing import Any

import torch
from torch import Tensor

from ..core import packing
from ..core.transform import Context, Group, State
from ..kernels.direct import direct
from ..kernels.dispatch import run_kernel
from ..kernels.keep import check, kept
from ..storage import dynamic8
from ..storage.dynamic8 import (
    BLOCK,
    Dynamic8Format,
    MIN_8BIT_SIZE,
    absmax_shape,
    block_dim,
    bnb_functional,
    code_bounds,
    dequantize,
    DYNAMIC8,
    UDYNAMIC8,
    dynamic_code,
    quantize_,
)
from ..storage.moments import is_quantized, stored_format
from .adam_paths import adam_single, rounding
from .moments import MomentRule

AXIS = "adam.block_dim"  # the blocked axis of both 8-bit moments (same shape and layout)
_KEYS = ("adam.exp_avg", "adam.exp_avg.absmax", "adam.exp_avg_sq", "adam.exp_avg_sq.absmax")


def step_batch(
    rule: MomentRule, us: list[Tensor], states: list[State], group: Group,
    ctxs: list[Context], out: list[Tensor | None],
) -> None:  # fmt: skip
    """The batched 8-bit step of :class:`~galore2.optim.adam.ScaleByAdam8bit` (a batch off
    the CPU's default loop, host counters), its results into ``out`` (the entries it
    leaves None step as :meth:`~galore2.optim.adam.ScaleByAdam.update_many` does: fp32
    moments by the batched paths, other 8-bit ones per tensor). Where the storage layer
    quantizes in torch (the CPU), the 8-bit directions at the same step (and direction
    dtype) are packed: their codes and absmax concatenated flat in storage order, both
    moments as the two rows of one matrix (:func:`~galore2.storage.dynamic8.pack_index`
    maps each element to its block, whatever its tensor's blocked axis), then one
    dequantize, Adam step and quantize for the whole pack — the same bits as per tensor.
    Elsewhere (CUDA; meta) the 8-bit directions of one shape, dtype, blocked axis and step
    count step as stacks (:func:`_stacks`): one :func:`adam8bit_stack_` per stack — on CUDA
    one fused kernel for all of its matrices. Sharded directions: per tensor (a shard's
    codes are not a plain tensor)."""
    local = [
        i
        for i, (state, ctx) in enumerate(zip(states, ctxs, strict=True))
        if not ctx.placement.distributed and _local_8bit(state)
    ]
    if local and _on_stacks(states[local[0]]["adam.exp_avg"]):
        _step_stacked(rule, us, states, group, ctxs, local, out)
        return
    packable = [i for i in local if _packable(states[i])]
    # every one of them steps below: their host counters advanced now (one add, one
    # read when packed, see galore2.core.counters), packs formed by the new counts
    counted = [states[i] for i in packable]
    steps = rule.count_steps(counted, group, us[0].device) if packable else []
    # their blocked axes (host scalars that never change) by one read as well
    axes = rule._counters.packed(counted, AXIS) if packable else None
    dims = dict(zip(packable, axes.tolist() if axes is not None else
                    [int(states[i][AXIS]) for i in packable], strict=True))  # fmt: skip
    packs: dict[tuple[Any, ...], list[int]] = {}
    for i, t in zip(packable, steps, strict=True):
        packs.setdefault((t - 1, us[i].device, us[i].dtype), []).append(i)
    for key, idx in packs.items():
        for part in _split(idx, [states[i]["adam.exp_avg"].numel() for i in idx]):
            done = _step_packed([us[i] for i in part], [states[i] for i in part], group,
                                key[0], [dims[i] for i in part])  # fmt: skip
            for i, r in zip(part, done, strict=True):
                out[i] = r


def _step_stacked(
    rule: MomentRule, us: list[Tensor], states: list[State], group: Group,
    ctxs: list[Context], local: list[int], out: list[Tensor | None],
) -> None:  # fmt: skip
    """:func:`step_batch` off the CPU path: the 8-bit directions ``local`` (unsharded,
    contiguous codes) by :func:`adam8bit_stack_`, one call per stack of the same shape,
    dtype, blocked axis and step count (their counters advanced first: one add, one
    read when packed), their results into ``out`` — in bf16 where every consumer rounds
    them so (:func:`~galore2.optim.adam_paths.rounding`: GaLore's factors of bf16 weights,
    no cast of them after), a deferred step's flags passed on (:attr:`Context.keep`:
    a member flagged False is not written). The stacks are kept on ``rule`` (``_stacks``,
    not pickled)."""
    counted = [states[i] for i in local]
    steps = rule.count_steps(counted, group, us[0].device)
    axes = rule._counters.packed(counted, AXIS)
    dims = axes.tolist() if axes is not None else [int(s[AXIS]) for s in counted]
    runs: dict[tuple[Any, ...], list[int]] = {}
    for i, t, dim in zip(local, steps, dims, strict=True):
        runs.setdefault((t, dim, us[i].shape, us[i].dtype, us[i].device), []).append(i)
    beta1, beta2 = group["betas"]
    cache = rule.__dict__.setdefault("_stacks", {})
    for (t, dim, *like), idx in runs.items():
        run_states = [states[i] for i in idx]
        g = packing.stacked_view([us[i] for i in idx])
        if g is None:
            g = torch.stack([us[i] for i in idx])
        m, ma, v, va = _stacks(cache, (dim, *like, len(idx)), run_states)
        run = [ctxs[i] for i in idx]
        keep, at = run[0].keep, None
        if keep is not None:  # each member's flag where the step put it
            at = [c.keep_at[0] for c in run]
        bf16 = rounding(run) == torch.bfloat16
        done = adam8bit_stack_(g, m, ma, v, va, dim, beta1, beta2, group["eps"], t, keep, at,
                               bf16)  # fmt: skip
        for i, r in zip(idx, done.unbind(0), strict=True):
            out[i] = r


def update_quantized(rule: MomentRule, u: Tensor, state: State, group: Group) -> Tensor:
    """``rule.update`` of a direction with 8-bit moments: the fused kernel, else the torch
    path (chunk by chunk on the CPU, else on fp32 copies of the moments). The step is
    counted once the kernel ran, or was not taken."""
    m_fmt = stored_format(state, "adam.exp_avg", True)
    v_fmt = stored_format(state, "adam.exp_avg_sq", False)
    assert isinstance(m_fmt, Dynamic8Format) and isinstance(v_fmt, Dynamic8Format)
    m_codes, m_absmax, dim = m_fmt.local(state, "adam.exp_avg", AXIS)
    v_codes, v_absmax, _ = v_fmt.local(state, "adam.exp_avg_sq", AXIS)
    out = run_kernel(
        "adam8bit",
        u,
        m_codes,
        v_codes,
        # the fused kernel takes the step as a host int: not for a capturable step
        supported=lambda k: not group.get("capturable") and k.supported(u),
        kernel=lambda k: partial(
            k.adam8bit_step,
            u,
            m_codes,
            m_absmax,
            v_codes,
            v_absmax,
            **_fused_args(m_fmt, v_fmt, dim, m_codes.device, state, group),
        ),
    )
    t = rule.count_step(state, group, u.device)
    if out is not None:  # the kernel updated codes and absmax in place
        return out
    return torch_quantized(u, m_fmt, v_fmt, t, state, group)


def torch_quantized(
    u: Tensor, m_fmt: Dynamic8Format, v_fmt: Dynamic8Format, t: int | Tensor, state: State,
    group: Group,
) -> Tensor:  # fmt: skip
    """Step ``t`` (counted already) of a direction with 8-bit moments on the torch path
    (no fused kernel): chunk by chunk on the CPU (:func:`_update_chunks`), else on fp32
    copies of the moments (bitsandbytes' quantizer)."""
    if dynamic8.use_torch(m_fmt.local(state, "adam.exp_avg", AXIS)[0]):
        return _update_chunks(u, m_fmt, v_fmt, t, state, group)
    m = m_fmt.view(state, "adam.exp_avg", AXIS)
    v = v_fmt.view(state, "adam.exp_avg_sq", AXIS)
    out = adam_single(u, m, v, t, group)  # the direction uses the fp32 moments
    m_fmt.store(state, "adam.exp_avg", m, AXIS)
    v_fmt.store(state, "adam.exp_avg_sq", v, AXIS)
    return out


def _fused_args(
    m_fmt: Dynamic8Format, v_fmt: Dynamic8Format, dim: int, device: torch.device,
    state: State, group: Group,
) -> dict[str, Any]:  # fmt: skip
    """The keyword arguments of the fused 8-bit step (galore2.kernels.adam8bit): the same
    arithmetic, codes and absmax updated in place, the fp32 direction returned. Its
    ``step`` is the count this step reaches: the caller counts it once the kernel ran
    or was not taken (see ``dispatch.run_kernel``)."""
    beta1, beta2 = group["betas"]
    return {
        "dim": dim,
        "code_m": m_fmt.code(device),
        "code_v": v_fmt.code(device),
        "bounds_m": m_fmt.bounds(device),
        "bounds_v": v_fmt.bounds(device),
        "beta1": beta1,
        "beta2": beta2,
        "eps": group["eps"],
        "step": int(state["adam.step"]) + 1,
    }


def _update_chunks(
    u: Tensor, m_fmt: Dynamic8Format, v_fmt: Dynamic8Format, t: int | Tensor, state: State,
    group: Group,
) -> Tensor:  # fmt: skip
    """The 8-bit torch path of step ``t`` on the CPU (where the storage layer quantizes
    in torch), in chunks of ~2^20 elements of whole blocks
    (:func:`~galore2.storage.dynamic8.row_chunks`): each chunk's moments are
    dequantized, stepped and requantized while in cache and its direction written into
    the fp32 result — :func:`~galore2.optim.adam_paths.adam_single` on whole fp32
    moments, with no full-size fp32 copy of either moment."""
    m_codes, m_absmax, dim = m_fmt.local(state, "adam.exp_avg", AXIS)
    v_codes, v_absmax, _ = v_fmt.local(state, "adam.exp_avg_sq", AXIS)
    rows = m_codes.shape[0]
    qm, qv, u2 = m_codes.view(rows, -1), v_codes.view(rows, -1), u.reshape(rows, -1)
    out = torch.empty(u2.shape, dtype=torch.float32, device=u.device)
    for r, b in dynamic8.row_chunks(rows, qm.shape[1], dim):
        m = dynamic8.dequantize(qm[r], m_absmax[b], dim, m_fmt.signed)
        v = dynamic8.dequantize(qv[r], v_absmax[b], dim, v_fmt.signed)
        adam_single(u2[r], m, v, t, group, out=out[r])
        dynamic8.quantize_(m, qm[r], m_absmax[b], dim, m_fmt.signed)
        dynamic8.quantize_(v, qv[r], v_absmax[b], dim, v_fmt.signed)
    return out.view(u.shape)


_MAX_STACKS = 64  # kept stacks per module (see _stacks)


def _on_stacks(codes: Tensor) -> bool:
    """Do 8-bit directions with codes like ``codes`` step by stacks (off the CPU's torch
    quantizer, which packs them instead)?"""
    return not dynamic8.use_torch(codes)


def local_on_stacks(state: State) -> bool:
    """Does an 8-bit direction of this state step on the fused kernel's path: plain
    contiguous codes and absmax (:func:`_local_8bit`), off the CPU's torch quantizer?"""
    return _local_8bit(state) and _on_stacks(state["adam.exp_avg"])


def _local_8bit(state: State) -> bool:
    """An 8-bit direction whose codes and absmax are plain contiguous tensors."""
    return is_quantized(state, "adam.exp_avg") and all(
        type(state[k]) is Tensor and state[k].is_contiguous() for k in _KEYS
    )


def _stacks(cache: dict[tuple[Any, ...], Any], key: tuple[Any, ...], states: list[State]
            ) -> list[Tensor]:  # fmt: skip
    """The four 8-bit state tensors of ``states`` (:data:`_KEYS`) as ``(k, …)`` stacks whose
    entries are the states' own tensors (:func:`~galore2.core.packing.as_stacks`: views,
    or the tensors packed once into one buffer per dtype), kept in ``cache`` under ``key``
    (the run's blocked axis, shape, dtype, device and size: a later list of the same run
    replaces it) while the states hold the same tensors at the same addresses."""
    tensors = [s[k] for k in _KEYS for s in states]
    kept = cache.get(key)
    if kept is not None:
        held, addresses, stacks = kept
        if all(map(operator.is_, held, tensors)) and packing.addresses(tensors) == addresses:
            return stacks
    lists = [[s[k] for s in states] for k in _KEYS]
    codes = packing.as_stacks([lists[0], lists[2]])
    absmax = packing.as_stacks([lists[1], lists[3]])
    assert codes is not None and absmax is not None  # contiguous, one dtype and device each
    stacks = [codes[0], absmax[0], codes[1], absmax[1]]
    if len(cache) >= _MAX_STACKS:
        cache.clear()
    cache[key] = (tensors, packing.addresses(tensors), stacks)
    return stacks


def _adam8bit_stack(
    g: Tensor, m_codes: Tensor, m_absmax: Tensor, v_codes: Tensor, v_absmax: Tensor, dim: int,
    beta1: float, beta2: float, eps: float, step: int, keep: Tensor | None = None,
    keep_at: list[int] | None = None, bf16: bool = False,
) -> Tensor:  # fmt: skip
    """Step ``step`` (t ≥ 1) of 8-bit Adam on a stack of ``k`` same-shape directions ``g``
    (``(k, *shape)``, any float dtype) whose moments are the ``(k, …)`` stacks of codes and
    absmax blocked along ``dim`` (updated in place, each matrix blocked as alone); returns
    the fp32 directions ``(k, *shape)`` (``bf16``: rounded to bf16, for a consumer that
    rounds them so). One op for the whole stack: on CUDA (or under
    ``GALORE2_KERNELS=triton``) the fused kernel
    (:func:`galore2.kernels.adam8bit.adam8bit_step_stack`), one launch; else the torch
    path matrix by matrix (:func:`torch_quantized`: the CPU's chunks,
    bitsandbytes elsewhere) — the bits of a per-tensor ``update`` either way. ``keep``:
    a deferred step's flags, one per matrix (``keep_at``: their positions in it,
    :mod:`galore2.kernels.keep`); a matrix flagged False has neither its moments nor its
    direction written (the torch path reads the flags on the host). On meta tensors it is
    one op that writes the moments and returns the directions (what the roofline counts)."""
    device = g.device
    k = g.shape[0]
    check("adam8bit_stack_", keep, k, device, keep_at)
    dtype = torch.bfloat16 if bf16 else torch.float32
    out = run_kernel(
        "adam8bit",
        g,
        m_codes,
        v_codes,
        supported=lambda k: k.supported(g),
        kernel=lambda k: partial(
            k.adam8bit_step_stack, g, m_codes, m_absmax, v_codes, v_absmax, dim=dim,
            code_m=DYNAMIC8.code(device), code_v=UDYNAMIC8.code(device),
            bounds_m=DYNAMIC8.bounds(device), bounds_v=UDYNAMIC8.bounds(device),
            beta1=beta1, beta2=beta2, eps=eps, step=step,
            out=torch.empty(g.shape, dtype=dtype, device=device), keep=keep, keep_at=keep_at,
        ),  # fmt: skip
    )
    if out is not None:
        return out
    group = {"betas": (beta1, beta2), "eps": eps}
    axis = torch.tensor(dim)
    out = torch.empty(g.shape, dtype=torch.float32, device=device)  # flagged out: unused
    for j in kept(keep, k, keep_at):
        state = {"adam.exp_avg": m_codes[j], "adam.exp_avg.absmax": m_absmax[j],
                 "adam.exp_avg_sq": v_codes[j], "adam.exp_avg_sq.absmax": v_absmax[j],
                 AXIS: axis}  # fmt: skip
        out[j] = torch_quantized(g[j], DYNAMIC8, UDYNAMIC8, step, state, group)
    return out.to(dtype)


adam8bit_stack_op = torch.library.custom_op(
    "galore2::adam8bit_stack_", _adam8bit_stack,
    mutates_args=("m_codes", "m_absmax", "v_codes", "v_absmax"),
)  # fmt: skip


@adam8bit_stack_op.register_fake
def _(
    g: Tensor, m_codes: Tensor, m_absmax: Tensor, v_codes: Tensor, v_absmax: Tensor, dim: int,
    beta1: float, beta2: float, eps: float, step: int, keep: Tensor | None = None,
    keep_at: list[int] | None = None, bf16: bool = False,
) -> Tensor:  # fmt: skip
    check("adam8bit_stack_", keep, g.shape[0], g.device, keep_at)
    return g.new_empty(g.shape, dtype=torch.bfloat16 if bf16 else torch.float32)


#: the op as galore2 calls it: its implementation directly in plain eager calls, the op
#: otherwise (:mod:`galore2.kernels.direct`)
adam8bit_stack_ = direct(adam8bit_stack_op, _adam8bit_stack, mutated=(1, 2, 3, 4))


_PACK = 1 << 21  # elements per pack and moment (bounded temporaries: ~50 bytes per element)
_SIGNS = (True, False)  # the packed rows: first moments (signed map), second (unsigned)


def _packable(state: State) -> bool:
    """Does an 8-bit direction step in a pack (else alone)? Packs are formed by its step
    count, device and dtype."""
    return dynamic8.use_torch(state["adam.exp_avg"])


def _split(idx: list[int], sizes: list[int]) -> list[list[int]]:
    """``idx`` in runs of at most :data:`_PACK` elements (a larger tensor alone)."""
    runs: list[list[int]] = [[]]
    total = 0
    for i, n in zip(idx, sizes, strict=True):
        if runs[-1] and total + n > _PACK:
            runs.append([])
            total = 0
        runs[-1].append(i)
        total += n
    return runs


def _step_packed(
    us: list[Tensor], states: list[State], group: Group, step: int, dims: list[int]
) -> list[Tensor]:
    """One 8-bit Adam step of directions whose states were at ``step`` (their counters
    already advanced) and whose moments are blocked along ``dims``, packed (see
    :func:`step_batch`)."""
    m_key, v_key = "adam.exp_avg", "adam.exp_avg_sq"
    layout = tuple(
        (s[m_key].shape[0], s[m_key].numel() // s[m_key].shape[0], dim)
        for s, dim in zip(states, dims, strict=True)
    )
    index, blocks = dynamic8.pack_index(layout, rows=2)
    sizes = [s[m_key].numel() for s in states]
    n = sum(sizes)
    codes = torch.cat([s[k].view(-1) for k in (m_key, v_key) for s in states]).view(2, n)
    absmax = torch.cat([s[k + ".absmax"].view(-1) for k in (m_key, v_key) for s in states])
    x = dynamic8.dequantize_packed(codes, absmax, index, _SIGNS)
    u = torch.cat([u.reshape(-1) for u in us])
    out = adam_single(u, x[0], x[1], step + 1, group)
    packed = dynamic8.quantize_packed(x, index, blocks, _SIGNS)
    if packed is None:  # a block bitsandbytes must quantize: per tensor, as update() does
        for k, row in ((m_key, 0), (v_key, 1)):
            for s, part in zip(states, x[row].split(sizes), strict=True):
                fmt = stored_format(s, k, row == 0)
                fmt.store(s, k, part.view(s[k].shape), AXIS)
    else:
        counts = [s[m_key + ".absmax"].numel() for s in states]
        dst = [s[k].view(-1) for k in (m_key, v_key) for s in states]
        dst += [s[k + ".absmax"].view(-1) for k in (m_key, v_key) for s in states]
        src = list(packed[0].view(-1).split(sizes * 2)) + list(packed[1].view(-1).split(counts * 2))
        torch._foreach_copy_(dst, src)
    return [o.view(u.shape) for o, u in zip(out.split(sizes), us, strict=True)]


__all__ = [
    "BLOCK",
    "MIN_8BIT_SIZE",
    "AXIS",
    "absmax_shape",
    "adam8bit_stack_",
    "block_dim",
    "bnb_functional",
    "code_bounds",
    "dequantize",
    "dynamic_code",
    "local_on_stacks",
    "quantize_",
    "step_batch",
    "torch_quantized",
    "update_quantized",
]
