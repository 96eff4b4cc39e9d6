"""The whole AdamW step of a plain group with 8-bit moments by fused kernels: each tensor
with 8-bit moments by one ``galore2::adamw8bit_`` launch (moments, direction, decoupled
decay and the weight's update in one pass), the small ones (float32 moments) by
``galore2::adamw_`` (:func:`~galore2.optim.adamw_step.adamw_fused`), which
:class:`~galore2.optim.adam.ScaleByAdam8bit`'s ``torch_adamw`` takes instead of the chain
where :func:`fused_path` allows it.

The chain's step of such a tensor on CUDA was three passes: its gradient stacked with the
group's others of its shape (2 bytes an element read, 2 written), the 8-bit kernel (the
gradient and both codes read, both codes and a float32 direction written: 10) and the
update of the weight (``apply_updates``: the weight and the direction read, the weight
written: 8) — 22 bytes an element for a bf16 weight. ``adamw8bit_`` reads the gradient, the
weight and both codes and writes the weight and both codes once: 10 (torch's fused AdamW
with bf16 moments: 14).
Its arithmetic is those passes' (:func:`galore2.kernels.adam8bit.adamw8bit_step`), and it
takes a deferred step's flag (:mod:`galore2.core.deferred`), as ``adamw_`` does.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from ..core.modules import DecoupledWeightDecay
from ..core.transform import Group, State, members
from ..kernels import ops
from ..kernels.direct import direct
from ..kernels.dispatch import run_kernel
from ..kernels.keep import check, kept
from ..kernels.tables import upload
from ..storage.dynamic8 import DYNAMIC8, UDYNAMIC8
from ..storage.moments import is_quantized
from .adam8bit import AXIS, local_on_stacks, torch_quantized
from .adamw_step import _fused_wanted, adamw_fused, mixed_path
from .moments import MomentRule

_CPU = torch.device("cpu")
_M, _V = "adam.exp_avg", "adam.exp_avg_sq"


def fused_path(
    params: list[Tensor], grads: list[Tensor], states: list[State], group: Group
) -> bool:
    """Whether galore2's fused ops run a plain AdamW group's step whose large tensors have
    8-bit moments (:func:`adamw8bit_group`): some have, where the group is batched
    (:func:`~galore2.optim.adamw_step.mixed_path`'s devices and kernels), each of them a
    bf16 weight and gradient of its codes' shape, contiguous, its codes plain tensors on
    the kernel's path, and the others as ``mixed_path`` takes them. Never on the CPU."""
    if not params or params[0].device.type not in ops.FUSED_OP_DEVICES:
        return False
    if not _fused_wanted(params, group) or not ops.triton_would_run():
        return False
    quantized = [i for i, s in enumerate(states) if is_quantized(s, _M)]
    if not quantized:
        return False
    rest = [i for i in range(len(params)) if i not in quantized]
    if rest and not mixed_path(*([xs[i] for i in rest] for xs in (params, grads, states)), group):
        return False
    device = params[0].device
    for i in quantized:
        p, g, s = params[i], grads[i], states[i]
        if (
            not (p.dtype == g.dtype == torch.bfloat16)
            or not (p.device == g.device == device)
            or not (p.shape == g.shape == s[_M].shape)
            or not (p.is_contiguous() and g.is_contiguous())
            or not local_on_stacks(s)
        ):
            return False
    return True


def adamw8bit_group(
    rule: MomentRule, params: list[Tensor], grads: list[Tensor], states: list[State],
    group: Group, keep: Tensor | None = None,
) -> None:  # fmt: skip
    """The step of a group :func:`fused_path` took: its counters advanced (one add, one
    read when packed), the float32-moment tensors by ``adamw_``, each 8-bit one by
    ``adamw8bit_``. ``keep``: a deferred step's flags, one per tensor."""
    counted, _ = members(states)
    steps = rule.count_steps(counted, group, _CPU)
    assert not isinstance(steps, Tensor)  # host counters: capturable takes the chain
    quantized = [i for i, s in enumerate(states) if is_quantized(s, _M)]
    rest = [i for i in range(len(params)) if i not in quantized]
    if rest:
        flags = keep
        if keep is not None and len(rest) < len(params):  # their flags, no host wait
            flags = keep.index_select(0, upload(rest, keep.device))  # not kept: see residual
        ps, gs, ss, ts = ([xs[i] for i in rest] for xs in (params, grads, states, steps))
        adamw_fused(ps, gs, ss, group, ts, mixed=True, keep=flags)
    beta1, beta2 = group["betas"]
    lr, decay = float(group["lr"]), DecoupledWeightDecay.factor(group)
    for i in quantized:
        s = states[i]
        adamw8bit_(params[i], grads[i], s[_M], s[_M + ".absmax"], s[_V], s[_V + ".absmax"],
                   int(s[AXIS]), beta1, beta2, group["eps"], steps[i], lr, decay, keep,
                   None if keep is None else [i])  # fmt: skip


def _adamw8bit(
    p: Tensor, g: Tensor, m_codes: Tensor, m_absmax: Tensor, v_codes: Tensor,
    v_absmax: Tensor, dim: int, beta1: float, beta2: float, eps: float, step: int, lr: float,
    decay: float, keep: Tensor | None = None, keep_at: list[int] | None = None,
) -> None:  # fmt: skip
    """Step ``step`` (≥ 1, counted already) of AdamW on the bf16 weight ``p`` with 8-bit
    moments (codes and absmax blocked along ``dim``, updated in place): ``p ← p·decay −
    lr·m̂/(√v̂ + eps)``. The fused kernel where it runs
    (:func:`galore2.kernels.adam8bit.adamw8bit_step`, one launch), else the passes it
    replaces (:func:`~galore2.optim.adam8bit.torch_quantized`, the decay, the update).
    ``keep``: a deferred step's flag (``keep_at``: its position); False writes nothing."""
    check("adamw8bit_", keep, 1, p.device, keep_at)
    device = p.device
    done = run_kernel(
        "adam8bit", g, m_codes, v_codes,
        supported=lambda k: k.supported(g) and p.dtype == torch.bfloat16,
        kernel=lambda k: partial(
            k.adamw8bit_step, p, g, m_codes, m_absmax, v_codes, v_absmax, dim=dim,
            code_m=DYNAMIC8.code(device), code_v=UDYNAMIC8.code(device),
            bounds_m=DYNAMIC8.bounds(device), bounds_v=UDYNAMIC8.bounds(device),
            beta1=beta1, beta2=beta2, eps=eps, step=step, lr=lr, decay=decay, keep=keep,
            keep_at=keep_at,
        ),
    )  # fmt: skip
    if done is not None or not kept(keep, 1, keep_at):
        return
    state = {_M: m_codes, _M + ".absmax": m_absmax, _V: v_codes, _V + ".absmax": v_absmax,
             AXIS: torch.tensor(dim)}  # fmt: skip
    d = torch_quantized(g, DYNAMIC8, UDYNAMIC8, step, state, {"betas": (beta1, beta2), "eps": eps})
    if decay != 1.0:
        p.mul_(decay)
    p.add_(d, alpha=-lr)


adamw8bit_op = torch.library.custom_op(
    "galore2::adamw8bit_", _adamw8bit,
    mutates_args=("p", "m_codes", "m_absmax", "v_codes", "v_absmax"),
)  # fmt: skip


@adamw8bit_op.register_fake
def _(
    p: Tensor, g: Tensor, m_codes: Tensor, m_absmax: Tensor, v_codes: Tensor,
    v_absmax: Tensor, dim: int, beta1: float, beta2: float, eps: float, step: int, lr: float,
    decay: float, keep: Tensor | None = None, keep_at: list[int] | None = None,
) -> None:  # fmt: skip
    check("adamw8bit_", keep, 1, p.device, keep_at)


#: the op as galore2 calls it (:mod:`galore2.kernels.direct`)
adamw8bit_ = direct(adamw8bit_op, _adamw8bit, mutated=(0, 2, 3, 4, 5))


__all__ = ["adamw8bit_", "adamw8bit_group", "fused_path"]
