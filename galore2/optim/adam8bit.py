"""Adam with 8-bit blockwise-quantized moments: ``ScaleByAdam(moments="dynamic8")``.

:class:`ScaleByAdam8bit` only fixes the moment storage of
:class:`~galore2.optim.adam.ScaleByAdam`; the update, the fused Triton kernel and the
small-tensor rule live there and in :mod:`galore2.storage.dynamic8` (the format: block
layout, bitsandbytes' dynamic code maps, quantize / dequantize), whose names are
re-exported here for compatibility.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..core.state import counter
from ..core.transform import Context, Group, State
from ..storage import dynamic8
from ..storage.dynamic8 import (
    BLOCK,
    DYNAMIC8,
    MIN_8BIT_SIZE,
    UDYNAMIC8,
    absmax_shape,
    block_dim,
    bnb_functional,
    code_bounds,
    dequantize,
    dynamic_code,
    quantize_,
)
from ..storage.moments import is_quantized
from .adam import AXIS, ScaleByAdam

_KEYS = ("adam.exp_avg", "adam.exp_avg.absmax", "adam.exp_avg_sq", "adam.exp_avg_sq.absmax")


class ScaleByAdam8bit(ScaleByAdam):
    """``ScaleByAdam(moments="dynamic8")``: Adam whose moments of large directions are stored
    8-bit blockwise (bitsandbytes' dynamic map); constructing it without bitsandbytes raises
    ``ImportError``."""

    def __init__(self) -> None:
        super().__init__(moments="dynamic8")

    def update_many(
        self, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context]
    ) -> list[Tensor]:
        """Batched :meth:`update`. Where the storage layer quantizes in torch (the CPU), 8-bit
        directions whose blocks line up — blocked along dim 1 with the same row length, or
        along dim 0 with the same column length, at the same step — are concatenated
        (rows, respectively columns: blocks never straddle two tensors) and stepped as one:
        one dequantize, Adam step and quantize per such bucket, the same bits as per tensor.
        The rest as :meth:`ScaleByAdam.update_many` (fp32 moments: foreach kernels; 8-bit
        ones on CUDA: the fused kernel or bitsandbytes, per tensor). ``capturable=True``: per
        tensor too (the buckets are formed by step count, which would be a host read)."""
        cpu_loop = us and us[0].device.type == "cpu" and not group.get("foreach")
        if not us or cpu_loop or group.get("capturable"):
            return super().update_many(us, states, group, ctxs)
        buckets: dict[tuple[Any, ...], list[int]] = {}
        for i, (u, state) in enumerate(zip(us, states, strict=True)):
            key = _bucket(u, state)
            if key is not None:
                buckets.setdefault(key, []).append(i)
        out: list[Tensor | None] = [None] * len(us)
        for key, idx in buckets.items():
            if len(idx) > 1:
                done = _step_concatenated([us[i] for i in idx], [states[i] for i in idx],
                                          group, key[0])  # fmt: skip
                for i, r in zip(idx, done, strict=True):
                    out[i] = r
        rest = [i for i, r in enumerate(out) if r is None]
        if rest:
            done = super().update_many(
                [us[i] for i in rest], [states[i] for i in rest], group, [ctxs[i] for i in rest]
            )
            for i, r in zip(rest, done, strict=True):
                out[i] = r
        return out  # type: ignore[return-value]


def _bucket(u: Tensor, state: State) -> tuple[Any, ...] | None:
    """Which concatenation an 8-bit direction can join (None: it steps alone): its blocked
    axis, the extent across it, its step, device and dtype."""
    if not is_quantized(state, "adam.exp_avg") or u.dim() < 2:
        return None
    codes = state["adam.exp_avg"]
    if not dynamic8.use_torch(codes) or not all(state[k].is_contiguous() for k in _KEYS):
        return None
    dim = int(state[AXIS])
    rows = codes.shape[0]
    extent = codes.numel() // rows if dim == 1 else rows
    return dim, extent, int(state["adam.step"]), u.device, u.dtype


def _step_concatenated(
    us: list[Tensor], states: list[State], group: Group, dim: int
) -> list[Tensor]:
    """One 8-bit Adam step of directions blocked along ``dim`` with equal extents across it,
    as one matrix: rows stacked (dim 1) or columns side by side (dim 0)."""
    axis = 0 if dim == 1 else 1

    def cat(ts: list[Tensor]) -> Tensor:
        return torch.cat([t.reshape(t.shape[0], -1) for t in ts], axis)

    joint: State = {key: cat([s[key] for s in states]) for key in _KEYS}
    joint[AXIS] = counter(dim)
    joint["adam.step"] = counter(int(states[0]["adam.step"]))
    U = cat(us)
    out = ScaleByAdam._update_chunks(U, DYNAMIC8, UDYNAMIC8, joint, group)
    sizes = [u.reshape(u.shape[0], -1).shape[axis] for u in us]
    dst, src = [], []
    for key in _KEYS:
        parts = joint[key].split([_extent(s[key], axis) for s in states], axis)
        dst += [s[key].view(p.shape) for s, p in zip(states, parts, strict=True)]
        src += parts
    torch._foreach_copy_(dst, src)
    for s in states:
        s["adam.step"] += 1
    return [o.reshape(u.shape) for o, u in zip(out.split(sizes, axis), us, strict=True)]


def _extent(t: Tensor, axis: int) -> int:
    return t.reshape(t.shape[0], -1).shape[axis]


__all__ = [
    "BLOCK",
    "MIN_8BIT_SIZE",
    "ScaleByAdam8bit",
    "absmax_shape",
    "block_dim",
    "bnb_functional",
    "code_bounds",
    "dequantize",
    "dynamic_code",
    "quantize_",
]
