"""Fira's and APOLLO's batched step: a batch's stacks combined into their updates at once.

:meth:`GaLore.update_many <galore2.optim.galore.GaLore.update_many>` hands the stacks it
projected and ran through the inner chain (:mod:`.lowrank_plan`) to :func:`combine_many`,
which builds the buckets of :func:`.residual.combine_buckets` — the shape batches' stacks as
they are, the matrices projected one by one stacked per shape — and returns each matrix's
update: APOLLO's scaled gradient or Fira's low-rank-plus-scaled sum as operands along the
data (a deferred step's flags on each), a dense one otherwise.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor

from ..core import packing
from ..core.transform import (
    Context,
    Group,
    LowRankUpdate,
    ResidualUpdate,
    ScaledUpdate,
    State,
    Transform,
    dense,
)
from ..kernels import ops
from ..projectors import TUCKER
from . import lowrank_batch, residual
from .lowrank_plan import Stacked, back_bases
from .projection import Projection


def biases(inner: list[Transform], states: list[State], group: Group) -> list[float | Tensor]:
    """Each state's bias correction of the inner chain (the product of its transforms';
    a transform's ``bias_corrections`` answers for a whole list at once where it has one)."""
    out: list[Any] | None = None
    for t in inner:
        many = getattr(t, "bias_corrections", None)
        values = many(states, group) if many else [t.bias_correction(s, group) for s in states]
        out = values if out is None else [a * b for a, b in zip(out, values, strict=True)]
    return out  # type: ignore[return-value]


def combine_many(
    inner: list[Transform], projections: dict[int, Projection], stacks: list[Stacked],
    stacked_out: list[Tensor | None], N: list[Tensor | LowRankUpdate], us: list[Tensor],
    R: list[Tensor], states: list[State], group: Group, ctxs: list[Context],
    counted: list[int], decay: float,
) -> dict[int, Tensor | ScaledUpdate | ResidualUpdate]:  # fmt: skip
    """Fira / APOLLO of the whole (unsharded) matrices of a batch at once
    (:func:`.residual.combine_buckets`): the shape batches' stacks as they are, the
    matrices projected one by one stacked per shape (when two or more, or along with
    shape batches); {index: dense update, or APOLLO's scaled gradient as its operands}.
    Sharded ones go per tensor."""
    idx = [
        i
        for i, p in projections.items()
        if not p.plan.placement.distributed and p.side != TUCKER
    ]
    if not stacks and len(idx) < 2:
        return {}
    fira = group["residual"] != "none"
    # every state's, in the order the inner chain counted them: one read of packed counters
    bias: list[Any] = [None] * len(states)
    for i, b in zip(counted, biases(inner, [states[i] for i in counted], group), strict=True):
        bias[i] = b
    buckets, order = [], []
    for st, stacked in zip(stacks, stacked_out, strict=True):
        st_states = [states[i] for i in st.idx]
        Ns = stacked if stacked is not None else torch.stack([dense(N[i]) for i in st.idx])
        B = st.B if fira else None
        # along the data: the gradients as they are, never written; Fira's low-rank
        # factors in the weights' dtype, from the bases as the back-projection reads them
        G = st.G if st.G is not None else [us[i] for i in st.idx]
        factors = None
        dtype = ctxs[st.idx[0]].param.dtype
        if st.G is None and Ns.dtype != dtype and _rounds(inner, us[st.idx[0]]):
            # along the data N is rounded to the weights' dtype where galore2's ops run
            # (run_inner asks the rule for it): rounded here where the rule's path could
            # not (a stack of moments that is not contiguous: a host-indexed step that left
            # a matrix out), so φ does not depend on the path
            Ns = Ns.to(dtype)
        if st.G is None and fira:
            factors = partial(lowrank_batch.factor_lists, st.batch.kind, back_bases(st, dtype),
                              dtype=dtype)  # fmt: skip
        buckets.append(residual.Bucket(st.batch.kind.left, G, st.R, Ns, B, st_states,
                                       [bias[i] for i in st.idx],
                                       owned=st.G is not None and packing.writable(st.G),
                                       factors=factors, keep=_keeps(ctxs, st.idx),
                                       norms=st.norms))  # fmt: skip
        order.append(st.idx)
    keyed: dict[tuple[Any, ...], list[int]] = {}
    for i in idx:
        g, side = projections[i].matrix(us[i]), projections[i].side
        keyed.setdefault((side, g.shape, R[i].shape, g.dtype, g.device), []).append(i)
    for same in keyed.values():
        ps = [projections[i] for i in same]
        st_states = [states[i] for i in same]
        buckets.append(residual.Bucket(
            ps[0].left, torch.stack([p.matrix(us[i]) for p, i in zip(ps, same, strict=True)]),
            torch.stack([R[i] for i in same]), torch.stack([dense(N[i]) for i in same]),
            torch.stack([p.basis(states[i]) for p, i in zip(ps, same, strict=True)])  # type: ignore[misc]
            if fira else None,
            st_states, [bias[i] for i in same],
        ))  # fmt: skip
        order.append(same)
    out = residual.combine_buckets(buckets, group, decay)
    n_stacked = sum(len(st.idx) for st in stacks)
    done: dict[int, Tensor | ScaledUpdate | ResidualUpdate] = {}
    for same, s in zip(order, out, strict=True):
        whole = len(done) < n_stacked  # a shape batch's: 2-D matrices as they are
        if isinstance(s, (residual.Scaled, residual.Residual)):  # applied as operands
            ups = s.updates([us[i].shape for i in same])
            for i, up in zip(same, ups, strict=True):  # a deferred step's flags
                parts = (up.low, up.scaled) if isinstance(up, ResidualUpdate) else (up,)
                for part in parts:
                    part.keep, part.keep_at = ctxs[i].keep, ctxs[i].keep_at
            done.update(zip(same, ups, strict=True))
        elif whole:
            done.update(zip(same, s.unbind(0), strict=True))
        else:
            done.update((i, m.view(us[i].shape)) for i, m in zip(same, s.unbind(0), strict=True))
    for i in idx:
        states[i]["galore.step"] += 1
    return done


def _rounds(inner: list[Transform], u: Tensor) -> bool:
    """Is a batch's N along the data rounded to the weights' dtype by its rule (one inner
    rule, on a device where galore2's ops run: not the CPU, which keeps its arithmetic)?"""
    return len(inner) == 1 and u.device.type in ops.FUSED_OP_DEVICES and ops.triton_would_run()


def _keeps(ctxs: list[Context], idx: list[int]) -> tuple[Tensor, list[int]] | None:
    """A deferred step's flags of the matrices ``idx`` (one tensor, their positions in it):
    the norm-growth limiter keeps a flagged-out matrix's last norm. None on other steps."""
    keep = ctxs[idx[0]].keep
    return None if keep is None else (keep, [ctxs[i].keep_at[0] for i in idx])


__all__ = ["biases", "combine_many"]
