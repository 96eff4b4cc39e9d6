"""The whole AdamW step of a plain group by a fused kernel (moments, decoupled decay and
the update of the weights in one launch per list or weight), which
:meth:`~galore2.optim.adam.ScaleByAdam.torch_adamw` takes instead of the chain where
:func:`torch_path` (torch's fused AdamW, its bits) or :func:`mixed_path` (galore2's
``adamw_`` op: bf16 weights with float32 moments) allows it."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.modules import DecoupledWeightDecay
from ..core.transform import Group, State
from ..kernels import ops
from ..kernels.keep import positions
from .adam_paths import FUSED_DEVICES


def _fused_wanted(params: list[Tensor], group: Group) -> bool:
    """Whether a plain AdamW group's step may leave galore2's own Adam for a fused kernel
    (see :func:`torch_path`): where the group is batched (off the CPU, or ``foreach=True``)
    unless ``foreach`` is False, or anywhere with ``fused=True``; never with
    ``fused=False``."""
    fused, foreach, device = group.get("fused"), group.get("foreach"), params[0].device
    if fused is None:
        fused = foreach is not False and (device.type != "cpu" or bool(foreach))
    return bool(fused)


def mixed_path(
    params: list[Tensor], grads: list[Tensor], states: list[State], group: Group
) -> bool:
    """Whether galore2's fused AdamW op (:func:`galore2.kernels.ops.adamw_`, one Triton
    launch for the group's weights) runs a plain AdamW group's step of bf16 weights with float32
    moments, which torch's fused kernel does not take: where :func:`_fused_wanted`, on CUDA
    (or meta: a count of that step, :mod:`benchmarks.roofline`) with the kernels on
    (``GALORE2_KERNELS`` not ``torch``, triton importable; a GPU it cannot run on takes
    the torch passes inside the op, galore2's own arithmetic), for bf16 weights and
    gradients and float32 moments of the weights' shape, all contiguous. Never on the
    CPU, whose step stays galore2's own."""
    if not params or params[0].device.type not in ops.FUSED_OP_DEVICES:
        return False
    if not _fused_wanted(params, group) or not ops.triton_would_run():
        return False
    device = params[0].device
    for p, g, s in zip(params, grads, states, strict=True):
        m, v = s.get("adam.exp_avg"), s.get("adam.exp_avg_sq")
        if (
            m is None
            or v is None
            or not (p.dtype == g.dtype == torch.bfloat16)
            or not (m.dtype == v.dtype == torch.float32)
            or not (p.device == g.device == m.device == v.device == device)
            or not (m.shape == v.shape == g.shape == p.shape)
            or not all(t.is_contiguous() for t in (p, g, m, v))
        ):
            return False
    return True


def torch_path(
    params: list[Tensor], grads: list[Tensor], states: list[State], group: Group
) -> bool:
    """Whether torch's fused AdamW kernel runs a plain AdamW group's step
    (:meth:`ScaleByAdam.torch_adamw`) instead of galore2's own Adam: where the group is
    batched (off the CPU, or ``foreach=True``: the accelerators' path) unless ``foreach``
    is False, or anywhere with ``fused=True``; never with ``fused=False``. Only for tensors
    the kernel takes as they are: floating point, each parameter's gradient and moments
    in its dtype (torch keeps its moments in the parameter's dtype: with bf16 weights,
    ``state_dtype="bfloat16"``), on one device where torch has the kernel."""
    if not params:
        return False
    device = params[0].device
    if not _fused_wanted(params, group) or device.type not in FUSED_DEVICES:
        return False
    for p, g, s in zip(params, grads, states, strict=True):
        m, v = s.get("adam.exp_avg"), s.get("adam.exp_avg_sq")
        if (
            not p.is_floating_point()
            or m is None
            or v is None
            or not (p.dtype == g.dtype == m.dtype == v.dtype)
            or not (p.device == g.device == m.device == v.device == device)
            or m.shape != p.shape
        ):
            return False
    return True


def _by_device_dtype(params: list[Tensor]) -> list[list[int]]:
    """Positions of ``params`` by (device, dtype): one torch kernel call each."""
    out: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, p in enumerate(params):
        out.setdefault((p.device, p.dtype), []).append(i)
    return list(out.values())


def _by_step(steps: list[int]) -> dict[int, list[int]]:
    """Positions by step count: one op call (one launch) each; one for the usual step."""
    out: dict[int, list[int]] = {}
    for i, t in enumerate(steps):
        out.setdefault(t, []).append(i)
    return out


def _step_tensors(steps: list[int], device: torch.device) -> list[Tensor]:
    """torch's float32 0-d step counters holding ``steps`` on ``device``, which its fused
    kernel reads: one fill when every count is the same (the usual step)."""
    if steps.count(steps[0]) == len(steps):
        values = torch.full((len(steps),), float(steps[0]), device=device)
    else:
        values = torch.tensor([float(t) for t in steps], device=device)
    return list(values.unbind())


def adamw_fused(
    params: list[Tensor], grads: list[Tensor], states: list[State], group: Group,
    steps: list[int], mixed: bool, keep: Tensor | None = None,
) -> None:  # fmt: skip
    """The step (counted already: ``steps``) of a plain AdamW group's tensors: by galore2's
    op, one call (one launch) per step count (``mixed``: :func:`mixed_path`), else by torch's fused
    AdamW kernel, one launch per (device, dtype) list (:func:`torch_path`). ``keep``: a
    deferred step's flags, one per tensor (galore2's op only: each call gets its tensors')."""
    beta1, beta2 = group["betas"]
    if mixed:  # bf16 weights, float32 moments: galore2's op, one call per step count
        lr = float(group["lr"])
        decay = DecoupledWeightDecay.factor(group)  # the optimizer's (see _adamw_rule)
        by_step = _by_step(steps)
        for t, idx in by_step.items():
            flags = keep
            if keep is not None and len(by_step) > 1:  # this count's tensors' flags
                flags = keep.index_select(0, positions(idx, keep.device))  # no host wait
            ops.adamw_(
                [params[i] for i in idx], [grads[i] for i in idx],
                [states[i]["adam.exp_avg"] for i in idx],
                [states[i]["adam.exp_avg_sq"] for i in idx], t, lr, beta1, beta2,
                group["eps"], decay, flags,
            )  # fmt: skip
        return
    for idx in _by_device_dtype(params):
        torch._fused_adamw_(
            [params[i] for i in idx], [grads[i] for i in idx],
            [states[i]["adam.exp_avg"] for i in idx],
            [states[i]["adam.exp_avg_sq"] for i in idx], [],
            _step_tensors([steps[i] for i in idx], params[idx[0]].device),
            lr=float(group["lr"]), beta1=beta1, beta2=beta2,
            weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False,
            maximize=False,  # the gradients are negated already (maximize=True)
        )  # fmt: skip


__all__ = ["adamw_fused", "mixed_path", "torch_path"]
