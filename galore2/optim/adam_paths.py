"""Adam's arithmetic, written once per execution path, as torch.optim writes its
``_single_tensor_adam`` / ``_multi_tensor_adam`` / ``_fused_adam`` siblings.

:class:`~galore2.optim.adam.ScaleByAdam` picks the path of a step in one dispatcher
(``ScaleByAdam._directions``); the 8-bit paths (:mod:`galore2.optim.adam8bit`) run
:func:`adam_single` on dequantized moments. Every path updates the moments in place and
returns the direction m̂/(√v̂ + eps); all but the fused ones share one signature of moment
coefficients (``weight1`` = 1−β₁, ``decay2`` = β₂, ``weight2`` = 1−β₂; a masked step's
first two are per-direction tensors, :func:`masked_weights`) and folded bias corrections
(``scale`` = bc₁/√bc₂, ``shift`` = bc₁·eps, :func:`corrections`):

* single tensor — :func:`adam_math` (``compile=True`` compiles this very function;
  :func:`adam_single` computes its coefficients from a step count and runs it, eager or
  compiled);
* a batch, compiled — :func:`adam_math_many` (:func:`adam_math` over a list, one graph);
* a batch, foreach kernels — :func:`adam_foreach`;
* a batch, fused — :func:`adam_fused` (torch's fused Adam kernel, float32 directions) and
  :func:`adam_rounded` (galore2's ``adam_directions_`` op, bf16 directions); they take the
  step count and compute the corrections themselves.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..core.masked import derive, usable_or_one
from ..core.transform import Context, Group, State
from ..kernels import ops
from .compiled import run_compiled
from .moments import bias_correction

#: devices where torch has a fused Adam(W) kernel (and meta: a dry run of one)
FUSED_DEVICES = frozenset({"cuda", "xpu", "mps", "hpu", "mtia", "privateuseone", "meta", "cpu"})


def corrections(beta1: float, beta2: float, eps: float, t: Any) -> tuple[Any, Any]:
    """(scale, shift) of step ``t``: ``bias_correction1 / bias_correction2_sqrt`` and
    ``bias_correction1 * eps``. ``t`` may be a device counter (``capturable=True``): then
    both are float64 tensors on its device, computed there (no host read); they equal the
    host's Python floats up to the device's ``pow`` (the last bit, for some large ``t``)."""
    if isinstance(t, Tensor):
        td = t.to(torch.float64)
        bias_correction1 = bias_correction(beta1, td)
        return bias_correction1 / bias_correction(beta2, td).sqrt(), bias_correction1 * eps
    bias_correction1 = bias_correction(beta1, t)
    bias_correction2_sqrt = math.sqrt(bias_correction(beta2, t))
    return bias_correction1 / bias_correction2_sqrt, bias_correction1 * eps


def masked_weights(
    masks: list[Tensor], dtype: torch.dtype, beta1: float, beta2: float
) -> tuple[list[Tensor], list[Tensor]]:
    """A masked step's (lerp weight, second-moment decay) per direction from its flag:
    (1 − β₁, β₂) where 1, (0, 1) where 0 — in the moments' dtype, the values the host path's
    Python floats take there (so the usable directions keep the host path's bits). A few
    kernels per batch (:func:`~galore2.core.masked.derive`)."""

    def weight(flag: Tensor, out: Tensor | None = None) -> Tensor:
        return torch.mul(flag.to(dtype), 1 - beta1, out=out)

    def decay(flag: Tensor, out: Tensor | None = None) -> Tensor:
        return usable_or_one(flag.to(dtype), beta2, out=out)

    names = (f"adam.weight {dtype} {beta1!r}", f"adam.decay {dtype} {beta2!r}")
    return derive(masks, weight, names[0]), derive(masks, decay, names[1])


def adam_math(
    u: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    weight1: Any,
    decay2: Any,
    weight2: float,
    scale: Any,
    shift: Any,
    out: Tensor | None = None,
) -> Tensor:
    """The single-tensor path, and the function ``compile=True`` compiles: ``exp_avg``,
    ``exp_avg_sq`` updated in place (lerp by ``weight1``; decay by ``decay2``, then
    ``weight2``·u²), the direction ``m / (√v·scale + shift)`` returned — m̂/(√v̂ + eps) with
    both bias corrections folded into one denominator, computed in a single buffer
    (``out`` when given) that then receives the result."""
    exp_avg.lerp_(u, weight1)
    exp_avg_sq.mul_(decay2).addcmul_(u, u, value=weight2)
    denom = torch.sqrt(exp_avg_sq, out=out).mul_(scale)
    denom.add_(shift)
    return torch.div(exp_avg, denom, out=denom)


def adam_single(
    u: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    t: int | Tensor,
    group: Group,
    out: Tensor | None = None,
    mask: Tensor | None = None,
    compile: bool = False,
) -> Tensor:
    """Step ``t`` of :func:`adam_math` on one direction (cast to the moments' dtype); where
    ``mask`` is 0 the moments are left as they are. ``t``: a host int, or a device counter
    (capturable). ``compile``: through :func:`~galore2.optim.compiled.run_compiled`
    (``compile=True``, never masked, no ``out``)."""
    if u.dtype != exp_avg.dtype:
        u = u.to(exp_avg.dtype)
    beta1, beta2 = group["betas"]
    scale, shift = corrections(beta1, beta2, group["eps"], t)
    if mask is None:
        weight, decay = 1 - beta1, beta2
    else:
        (weight,), (decay,) = masked_weights([mask], exp_avg.dtype, beta1, beta2)
    if compile:
        return run_compiled(adam_math, u, exp_avg, exp_avg_sq, weight, decay, 1 - beta2,
                            scale, shift)  # fmt: skip
    return adam_math(u, exp_avg, exp_avg_sq, weight, decay, 1 - beta2, scale, shift, out)


def adam_math_many(
    us: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    weight1: float,
    decay2: float,
    weight2: float,
    scales: list[Any],
    shifts: list[Any],
) -> list[Tensor]:
    """:func:`adam_math` for a batch of tensors, one graph (the foreach path compiled).
    Written as a loop, not ``torch._foreach_*`` ops: those take a list of scalars as
    constants, which would recompile every step."""
    return [
        adam_math(u, m, v, weight1, decay2, weight2, scale, shift)
        for u, m, v, scale, shift in zip(us, exp_avgs, exp_avg_sqs, scales, shifts, strict=True)
    ]


def adam_foreach(
    us: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    weight1: Any,
    decay2: Any,
    weight2: float,
    scales: list[Any],
    shifts: list[Any],
) -> list[Tensor]:
    """:func:`adam_math` by foreach kernels, one per op for the batch (``weight1`` and
    ``decay2``: floats, or a masked step's lists; ``scales`` and ``shifts``: floats, or
    tensors that broadcast over a stacked entry)."""
    torch._foreach_lerp_(exp_avgs, us, weight1)
    torch._foreach_mul_(exp_avg_sqs, decay2)
    torch._foreach_addcmul_(exp_avg_sqs, us, us, value=weight2)
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_mul_(denoms, scales)
    torch._foreach_add_(denoms, shifts)
    return list(torch._foreach_div(exp_avgs, denoms))


def adam_fused(
    us: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], t: int,
    beta1: float, beta2: float, eps: float,
) -> list[Tensor]:  # fmt: skip
    """Step ``t`` of Adam on the moments and the directions m̂/(√v̂ + eps), by torch's fused
    Adam kernel (:func:`~galore2.kernels.ops.adam_directions`: one launch for the batch,
    each moment read and written once). Moments and direction are :func:`adam_math`'s up
    to an ulp or so: the kernel may fuse a multiply-add, and computes m̂/(√v̂ + eps) as
    (m/bc1)/(√v/√bc2 + eps) rather than m/(√v·bc1/√bc2 + bc1·eps)."""
    return ops.adam_directions(us, exp_avgs, exp_avg_sqs, t, beta1, beta2, eps)


def adam_rounded(
    us: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    t: int | list[list[int]], beta1: float, beta2: float, eps: float,
    keeps: list[tuple[Tensor, tuple[int, ...]]] | None = None,
) -> list[Tensor]:  # fmt: skip
    """Step ``t`` of Adam with each direction written in bf16 by galore2's op
    (:func:`galore2.kernels.ops.adam_directions_`, one call per tensor), for a consumer
    that rounds it so anyway (see :func:`rounded_path`). ``t``: the batch's one count, or per
    tensor its members' counts (a stacked entry whose members count different steps: each
    its own corrections). ``keeps``: a deferred step's (flags, positions) per tensor (a
    stacked entry: its members' positions): a member flagged False has neither its moments
    nor its direction written (it is never used)."""
    outs = [torch.empty_like(u, dtype=torch.bfloat16) for u in us]
    flags = keeps if keeps is not None else [(None, None)] * len(us)
    counts = [[t]] * len(us) if isinstance(t, int) else t
    for *args, (keep, at), steps in zip(us, exp_avgs, exp_avg_sqs, outs, flags, counts,
                                        strict=True):  # fmt: skip
        own = None if steps.count(steps[0]) == len(steps) else list(steps)
        ops.adam_directions_(*([a] for a in args), steps[0], beta1, beta2, eps, keep,
                             None if at is None else list(at), own)  # fmt: skip
    return outs


def fusable(exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], us: list[Tensor]) -> bool:
    """Can torch's fused Adam kernel step this batch (:func:`adam_fused`): float32
    moments and directions, contiguous, on one device of :data:`FUSED_DEVICES`?"""
    first = exp_avgs[0]
    if first.dtype != torch.float32 or first.device.type not in FUSED_DEVICES:
        return False
    device = first.device
    return all(
        t.dtype == torch.float32 and t.device == device and t.is_contiguous()
        for ts in (exp_avgs, exp_avg_sqs, us) for t in ts
    )  # fmt: skip


def rounding(ctxs: list[Context]) -> torch.dtype | None:
    """The dtype every one of ``ctxs``' directions is rounded to by its consumer
    (:attr:`~galore2.core.module.Context.rounds_to`), or None (not all, or not one)."""
    first = ctxs[0].rounds_to if ctxs else None
    return first if first is not None and all(c.rounds_to == first for c in ctxs) else None


def rounded_path(us: list[Tensor], states: list[State], rounds: torch.dtype | None) -> bool:
    """Whether galore2's op writes a batch's directions in bf16 (``rounds``, the dtype its
    consumer rounds them to): bf16 directions and float32 moments of their shape, all
    contiguous, on CUDA (or meta: a count of that step) with the kernels on (see
    :func:`~galore2.optim.adamw_step.mixed_path`). Never on the CPU."""
    if rounds != torch.bfloat16 or not us or us[0].device.type not in ops.FUSED_OP_DEVICES:
        return False
    if not ops.triton_would_run():
        return False
    for u, s in zip(us, states, strict=True):
        m, v = s.get("adam.exp_avg"), s.get("adam.exp_avg_sq")
        if (
            m is None
            or v is None
            or u.dtype != torch.bfloat16
            or not (m.dtype == v.dtype == torch.float32)
            or not (m.shape == v.shape == u.shape)
            or not all(t.is_contiguous() for t in (u, m, v))
        ):
            return False
    return True


def per_entry(
    scale: Tensor, shift: Tensor, starts: list[int], us: list[Tensor]
) -> tuple[list[Tensor], list[Tensor]]:
    """Per entry of a batch with stacked entries (``starts``:
    :func:`~galore2.core.transform.members`'), its (scale, shift) from the members' 1-D
    ``scale`` and ``shift``: a 0-d view for a plain entry, a ``(k, 1, …)`` view that
    broadcasts over a stacked entry's ``(k, *shape)`` direction."""
    scales, shifts = [], []
    lead = 0  # the plain entries before the first stack: their 0-d views by one call each
    while lead < len(us) and starts[lead + 1] - starts[lead] == 1:
        lead += 1
    each_scale, each_shift = scale[:lead].unbind(), shift[:lead].unbind()
    for i, u in enumerate(us):
        a, b = starts[i], starts[i + 1]
        if b - a == 1:  # a plain entry (or a stack of one): a 0-d value broadcasts
            scales.append(each_scale[a] if i < lead else scale[a])
            shifts.append(each_shift[a] if i < lead else shift[a])
            continue
        shape = (b - a,) + (1,) * (u.dim() - 1)
        scales.append(scale[a:b].view(shape))
        shifts.append(shift[a:b].view(shape))
    return scales, shifts


__all__ = [
    "adam_foreach",
    "adam_fused",
    "adam_math",
    "adam_math_many",
    "adam_rounded",
    "adam_single",
    "corrections",
    "masked_weights",
]
