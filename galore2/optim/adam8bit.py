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

from ..core.transform import Context, Group, State
from ..storage import dynamic8
from ..storage.dynamic8 import (
    BLOCK,
    MIN_8BIT_SIZE,
    absmax_shape,
    block_dim,
    bnb_functional,
    code_bounds,
    dequantize,
    dynamic_code,
    quantize_,
)
from ..storage.moments import is_quantized, stored_format
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
        """Batched :meth:`update`. Where the storage layer quantizes in torch (the CPU), the
        8-bit directions at the same step (and direction dtype) are packed: their codes and
        absmax concatenated flat in storage order, both moments as the two rows of one
        matrix (:func:`~galore2.storage.dynamic8.pack_index` maps each element to its block,
        whatever its tensor's blocked axis), then one dequantize, Adam step and quantize for
        the whole pack — the same bits as per tensor. The rest as
        :meth:`ScaleByAdam.update_many` (fp32 moments: foreach kernels; 8-bit ones on CUDA:
        the fused kernel or bitsandbytes, per tensor). ``capturable=True`` and sharded
        directions: per tensor too (the packs are formed by step count, which would be a
        host read; a shard's codes are not a plain tensor)."""
        cpu_loop = us and us[0].device.type == "cpu" and not group.get("foreach")
        if not us or cpu_loop or group.get("capturable"):
            return super().update_many(us, states, group, ctxs)
        packable = [
            i
            for i, (state, ctx) in enumerate(zip(states, ctxs, strict=True))
            if not ctx.placement.distributed and _packable(state)
        ]
        # every one of them steps below: their host counters advanced now (one add, one
        # read when packed, see galore2.core.counters), packs formed by the new counts
        counted = [states[i] for i in packable]
        steps = self.count_steps(counted, group, us[0].device) if packable else []
        # their blocked axes (host scalars that never change) by one read as well
        axes = self._counters.packed(counted, AXIS) if packable else None
        dims = dict(zip(packable, axes.tolist() if axes is not None else
                        [int(states[i][AXIS]) for i in packable], strict=True))  # fmt: skip
        packs: dict[tuple[Any, ...], list[int]] = {}
        for i, t in zip(packable, steps, strict=True):
            packs.setdefault((t - 1, us[i].device, us[i].dtype), []).append(i)
        out: list[Tensor | None] = [None] * len(us)
        for key, idx in packs.items():
            for part in _split(idx, [states[i]["adam.exp_avg"].numel() for i in idx]):
                done = _step_packed([us[i] for i in part], [states[i] for i in part], group,
                                    key[0], [dims[i] for i in part])  # fmt: skip
                for i, r in zip(part, done, strict=True):
                    out[i] = r
        rest = [i for i, r in enumerate(out) if r is None]
        if rest:
            done = super().update_many(
                [us[i] for i in rest], [states[i] for i in rest], group, [ctxs[i] for i in rest]
            )
            for i, r in zip(rest, done, strict=True):
                out[i] = r
        return out  # type: ignore[return-value]


_PACK = 1 << 21  # elements per pack and moment (bounded temporaries: ~50 bytes per element)
_SIGNS = (True, False)  # the packed rows: first moments (signed map), second (unsigned)


def _packable(state: State) -> bool:
    """Does an 8-bit direction step in a pack (else alone)? Packs are formed by its step
    count, device and dtype."""
    if not is_quantized(state, "adam.exp_avg"):
        return False
    codes = state["adam.exp_avg"]
    return dynamic8.use_torch(codes) and all(state[k].is_contiguous() for k in _KEYS)


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
    :meth:`ScaleByAdam8bit.update_many`)."""
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
    out = ScaleByAdam._arith(u, x[0], x[1], step + 1, group)
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
    "ScaleByAdam8bit",
    "absmax_shape",
    "block_dim",
    "bnb_functional",
    "code_bounds",
    "dequantize",
    "dynamic_code",
    "quantize_",
]
