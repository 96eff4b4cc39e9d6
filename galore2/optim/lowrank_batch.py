"""GaLore's projections batched per shape: one ``bmm`` for every same-shape matrix of a group.

The batched path (``foreach``) of :class:`~galore2.optim.galore.GaLore` projects and
back-projects each matrix with its own matmul, so a step launched two matmuls (and their
Python) per projected matrix. Weights of a transformer repeat a few shapes in every layer
(q/k/v/o, gate/up, down), so here the gradients of the matrices that share (side, shape,
dtype, device) are stacked and projected by one ``torch.bmm`` against their stacked bases,
and back-projected by another; the result is a dense update per matrix (a view of the
batch), applied by the optimizer's foreach kernels.

The side's products (and which basis they read) are its projection's
(:class:`~galore2.optim.projection.LeftProjection` / ``RightProjection``: ``basis_key``,
``project_stack``, ``back_stack``); this module only groups and stacks.

Only the common case takes this path (:func:`batchable`): a left or right projection of a
local (not sharded) 2-D weight, a dense fp32 / bf16 basis read by the base projector, no
residual (Fira / APOLLO combine the update per tensor), and no refresh due this step. Every
other matrix goes through :meth:`GaLore._project` / :meth:`GaLore._back` as before.

Only matrices of at most :data:`MAX_MATRIX_BYTES` batch: there a step is launch-bound and
the stacking copies are cheap (Llama-350M's 1024×1024 and 1024×2736). Larger ones keep
their own matmuls — stacking 32 of Llama-7B's 4096×4096 matrices into one ``bmm`` was no
faster on an H100, the copies cost what the launches saved. A batch holds at most
:data:`MAX_BATCH_BYTES` of gradients (its stacks are temporaries of that size).
Results equal the per-matrix path up to the matmul's summation order (within 1e-6).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..core.transform import Context, State
from ..projectors import Projector, get_projector
from ..projectors.base import projection_precision
from .projection import Projection

MAX_MATRIX_BYTES = 16 * 2**20
MAX_BATCH_BYTES = 256 * 2**20
_DENSE_BASES = ("fp32", "bf16")

#: (index, u, state, the projection's class): a matrix of a batch
Item = tuple[int, Tensor, State, type[Projection]]


def batchable(u: Tensor, state: State, ctx: Context, kind: type[Projection]) -> bool:
    """Can this matrix's projection (of class ``kind``) go through a shape batch this step?"""
    return (
        kind.stackable
        and u.dim() == 2
        and u.numel() * u.element_size() <= MAX_MATRIX_BYTES
        and not ctx.placement.distributed
        and not ctx.refreshed
        and int(state["galore.step"]) < int(state["galore.next_refresh"])
    )


def group_batchable(group: dict[str, Any]) -> bool:
    """Can any matrix of this group batch (dense basis, base projector, no residual)?"""
    if group.get("basis_dtype", "fp32") not in _DENSE_BASES:
        return False
    if group.get("residual", "none") != "none" or group.get("scale_type") is not None:
        return False
    projector = type(get_projector(group["projector"]))
    return (
        projector.project is Projector.project and projector.back_factors is Projector.back_factors
    )


def batches(items: list[Item]) -> list[list[Item]]:
    """:data:`Item` s split into batches of one (projection, shape, dtype, device), each at
    most :data:`MAX_BATCH_BYTES` of gradients."""
    by_key: dict[tuple, list[Item]] = {}
    for item in items:
        u = item[1]
        by_key.setdefault((item[3], u.shape, u.dtype, u.device), []).append(item)
    out = []
    for same in by_key.values():
        size = same[0][1].numel() * same[0][1].element_size()
        per = max(1, MAX_BATCH_BYTES // max(size, 1))
        out += [same[i : i + per] for i in range(0, len(same), per)]
    return out


def _basis(states: list[State], key: str, dtype: torch.dtype) -> Tensor:
    stacked = torch.stack([s[key] for s in states])
    return stacked if stacked.dtype == dtype else stacked.to(dtype)


def project(batch: list[Item], precision: str = "fp32") -> tuple[Tensor, list[Tensor]]:
    """(the stacked bases, R of each matrix): R = PᵀG (left) or G·Q (right), one ``bmm`` at
    the group's ``proj_precision`` (as :meth:`Projector.project` does per matrix)."""
    kind, dtype = batch[0][3], batch[0][1].dtype
    states = [s for _, _, s, _ in batch]
    G = torch.stack([u for _, u, _, _ in batch])
    B = _basis(states, kind.basis_key, dtype)
    at, context = projection_precision(G, precision)
    X, Y = (G, B) if at == dtype else (G.to(at), B.to(at))
    with context:
        R = kind.project_stack(X, Y)
    if R.dtype != dtype:
        R = R.to(dtype)
    return B, list(R.unbind(0))


def back(
    batch: list[Item], B: Tensor, Ns: list[Tensor], dtype: torch.dtype, factor: float
) -> list[Tensor]:
    """Dense updates ``P·(factor·N)`` (left) or ``(factor·N)·Qᵀ`` (right) in ``dtype``, one
    ``bmm`` (the factor scales the r-row stack, not the m×n result); counts each matrix's
    GaLore step."""
    kind = batch[0][3]
    N = torch.stack(Ns)  # a new tensor: scaled in place
    N, B = (N if N.dtype == dtype else N.to(dtype)), (B if B.dtype == dtype else B.to(dtype))
    if factor != 1.0:
        N.mul_(factor)
    out = kind.back_stack(N, B)
    torch._foreach_add_([state["galore.step"] for _, _, state, _ in batch], 1)  # host counters
    return list(out.unbind(0))
