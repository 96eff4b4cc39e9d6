"""galore2's ops for a shape batch's scaled gradients (APOLLO along the data), one dispatch
each (``torch.library``).

APOLLO's update of a matrix is its raw gradient scaled per channel, ``G ⊙ f``; Fira's
adds its residual G − P·R so scaled (:mod:`galore2.optim.residual`). Along the data the
gradients of a shape batch stay where they are (no stack of them), so each pass over them
is one grouped launch:

* ``galore2::channel_norms_each`` (:func:`channel_norms_each`) — the float32 norms of each
  gradient's columns (``dim=0``: a ``(k, 1, n)`` stack) or rows (``dim=1``: ``(k, m, 1)``),
  what the norm-growth limiter needs of G;
* ``galore2::residual_norms_each`` (:func:`residual_norms_each`) — the same norms of
  ``G_i + c·(A_i @ B_i)``: Fira's residual G − P·R, for its limiter, never made;
* ``galore2::project_norms_each`` (:func:`project_norms_each`) — Fira's projection of a
  shape batch (R = PᵀG or G·Q into given outputs) with both norms its step needs, the
  residuals' (APOLLO's: the gradients', ``c = 0``) and R's, by channel: each gradient
  read once;
* ``galore2::scaled_add_each_`` (:func:`scaled_add_each_`) — ``p_i ← β·p_i + α·G_i ⊙ f_i``
  into each weight (``f``: a float32 ``(k, 1, n)``, ``(k, m, 1)`` or ``(k, 1, 1)`` stack),
  the weight read and written once.

Where :mod:`~galore2.kernels.dispatch` runs Triton, one launch per list
(:mod:`galore2.kernels.scaled_list`, :mod:`galore2.kernels.residual_list`,
:mod:`galore2.kernels.project_norms_list`); elsewhere the torch ops per matrix that the
stacked path runs (``vector_norm``; ``mul_`` and ``addcmul_``, as
:func:`galore2.core.apply.apply_update` applies one
:class:`~galore2.core.transform.ScaledUpdate`). On meta tensors they only check shapes: a
dispatch mode sees one op per call (how ``benchmarks/roofline.py`` counts a step where the
kernels run). This module imports no triton.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from .direct import direct
from .dispatch import run_kernel
from .keep import check, kept
from .ops_lowrank import mm_each_


def _norms_shape(Gs: list[Tensor], dim: int) -> tuple[int, int, int]:
    if dim not in (0, 1):
        raise ValueError(f"channel_norms_each: dim must be 0 (columns) or 1 (rows), got {dim}")
    if not Gs or any(g.dim() != 2 or g.shape != Gs[0].shape for g in Gs):
        raise ValueError("channel_norms_each takes one or more 2-D tensors of one shape")
    m, n = Gs[0].shape
    return (len(Gs), 1, n) if dim == 0 else (len(Gs), m, 1)


def _channel_norms(Gs: list[Tensor], dim: int) -> Tensor:
    """Each matrix's float32 2-norms over ``dim`` (kept): a ``(k, 1, n)`` or ``(k, m, 1)``
    stack."""
    out = torch.empty(_norms_shape(Gs, dim), dtype=torch.float32, device=Gs[0].device)
    if len(Gs) > 1:
        done = run_kernel(
            "scaled_list", *Gs, out,
            supported=lambda k: k.supported_norms(Gs, dim, out),
            kernel=lambda k: partial(k.channel_norms_list, Gs, dim, out),
        )  # fmt: skip
        if done is not None:
            return out
    for g, o in zip(Gs, out.unbind(0), strict=True):  # float64 summed in float64, rounded
        wide = torch.float32 if g.dtype != torch.float64 else None
        o.copy_(torch.linalg.vector_norm(g, dim=dim, keepdim=True, dtype=wide))
    return out


def _residual_norms(
    Gs: list[Tensor], As: list[Tensor], Bs: list[Tensor], c: float, dim: int
) -> Tensor:  # fmt: skip
    """Each matrix's float32 2-norms over ``dim`` (kept) of ``G_i + c·(A_i @ B_i)``, the
    product's operands rounded to G's dtype first (a float32 basis against bf16 gradients):
    the norms of Fira's residual G − P·R (or G − R·Qᵀ), never made, for its norm-growth
    limiter."""
    out = torch.empty(_norms_shape(Gs, dim), dtype=torch.float32, device=Gs[0].device)
    if len(As) != len(Gs) or len(Bs) != len(Gs) or any(
        a.dim() != 2 or b.dim() != 2 or (a.shape[0], b.shape[1]) != g.shape
        or a.shape[1] != b.shape[0] for g, a, b in zip(Gs, As, Bs, strict=True)
    ):  # fmt: skip
        raise ValueError("residual_norms_each: one A (m × r) and B (r × n) per m × n gradient")
    if len(Gs) > 1:
        done = run_kernel(
            "residual_list", *Gs, *As, *Bs, out,
            supported=lambda k: k.supported_residual(Gs, As, Bs, dim, out),
            kernel=lambda k: partial(k.residual_norms_list, Gs, As, Bs, c, dim, out),
        )  # fmt: skip
        if done is not None:
            return out
    for g, a, b, o in zip(Gs, As, Bs, out.unbind(0), strict=True):
        a, b = (x if x.dtype == g.dtype else x.to(g.dtype) for x in (a, b))
        residual = torch.addmm(g.float(), a.float(), b.float(), alpha=c)
        torch.linalg.vector_norm(residual, dim=dim, keepdim=True, out=o)
    return out


def _project_norms_shapes(Gs: list[Tensor], Bs: list[Tensor], outs: list[Tensor], dim: int):
    """Refuse lists :func:`_project_norms` does not take (before anything is written)."""
    if dim not in (0, 1):
        raise ValueError(
            f"project_norms_each: dim must be 0 (a left basis) or 1 (a right one), got {dim}"
        )
    if not Gs or len(Bs) != len(Gs) or len(outs) != len(Gs):
        raise ValueError("project_norms_each: one basis and one output per gradient (1 or more)")
    if any(g.dim() != 2 or g.shape != Gs[0].shape for g in Gs):
        raise ValueError("project_norms_each: it takes 2-D gradients of one shape")
    m, n = Gs[0].shape
    for b, o in zip(Bs, outs, strict=True):
        rows, r = (m, b.shape[-1]) if dim == 0 else (n, b.shape[-1])
        want = (r, n) if dim == 0 else (m, r)
        if b.dim() != 2 or b.shape[0] != rows or o.dim() != 2 or tuple(o.shape) != want:
            raise ValueError(
                f"project_norms_each: {m} × {n} gradients take "
                f"{'P (m × r) and outputs r × n' if dim == 0 else 'Q (n × r) and outputs m × r'}"
                f"; got a basis {tuple(b.shape)} and an output {tuple(o.shape)}"
            )


def _project_norms(
    Gs: list[Tensor], Bs: list[Tensor], outs: list[Tensor], c: float, dim: int
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Fira's (and APOLLO's, ``c = 0``) projection of a shape batch with the norms its step
    needs of it, in one pass over the gradients where the kernel runs: ``outs[i] ←
    P_iᵀ @ G_i`` (``dim=0``: a left basis ``Bs[i] = P_i``) or ``G_i @ Q_i`` (``dim=1``:
    ``Bs[i] = Q_i``), in the outputs' dtype; returns the float32 channel norms (columns for ``dim=0``, ``(k, 1, n)``; rows
    for ``dim=1``, ``(k, m, 1)``) of the residuals ``G_i + c·P_i @ outs[i]`` (``G_i +
    c·outs[i] @ Q_iᵀ``) and of the ``outs[i]`` themselves, each as rounded to its dtype.
    Elsewhere: the grouped projection (``galore2::mm_each_``), the residuals' norms
    (``galore2::residual_norms_each``) and one ``vector_norm`` per output."""
    _project_norms_shapes(Gs, Bs, outs, dim)
    norms = torch.empty(_norms_shape(Gs, dim), dtype=torch.float32, device=Gs[0].device)
    r_norms = torch.empty_like(norms)
    if len(Gs) > 1:
        done = run_kernel(
            "project_norms_list", *Gs, *Bs, *outs, norms,
            supported=lambda k: k.supported_project_norms(Gs, Bs, outs, dim, norms, r_norms),
            kernel=lambda k: partial(k.project_norms_list, Gs, Bs, outs, c, dim, norms, r_norms),
        )  # fmt: skip
        if done is not None:
            return norms, r_norms
    if dim == 0:  # R = PᵀG; the residual G + c·P·R
        mm_each_([b.mT for b in Bs], Gs, outs)
    else:  # R = G·Q; the residual G + c·R·Qᵀ
        mm_each_(Gs, Bs, outs)
    if c == 0.0:  # G's own norms (APOLLO's)
        norms.copy_(_channel_norms(Gs, dim))
    elif dim == 0:
        norms.copy_(_residual_norms(Gs, Bs, outs, c, 0))
    else:
        norms.copy_(_residual_norms(Gs, outs, [b.mT for b in Bs], c, 1))
    for o, n in zip(outs, r_norms.unbind(0), strict=True):
        torch.linalg.vector_norm(o, dim=dim, keepdim=True, dtype=torch.float32, out=n)
    return norms, r_norms


def _check_scaled(
    ps: list[Tensor], Gs: list[Tensor], factor: Tensor, keep: Tensor | None = None,
    keep_at: list[int] | None = None,
) -> None:  # fmt: skip
    if len(ps) != len(Gs) or factor.dim() != 3 or factor.shape[0] != len(ps):
        raise ValueError(
            f"scaled_add_each_: {len(ps)} weights, {len(Gs)} gradients and a factor of shape "
            f"{tuple(factor.shape)}; it takes lists of one length k and a (k, 1, n), "
            "(k, m, 1) or (k, 1, 1) factor"
        )
    if factor.dtype != torch.float32:
        raise ValueError(f"scaled_add_each_: the factor is float32, got {factor.dtype}")
    for p, g in zip(ps, Gs, strict=True):
        if g.dim() != 2 or p.numel() != g.numel() or not p.is_contiguous():
            raise ValueError(
                "scaled_add_each_: each weight is contiguous with its 2-D gradient's "
                f"elements; got {tuple(p.shape)} and {tuple(g.shape)}"
            )
    if ps:
        m, n = Gs[0].shape
        if factor.shape[1:] not in ((1, n), (m, 1), (1, 1)):
            raise ValueError(
                f"scaled_add_each_: a factor of shape {tuple(factor.shape)} for {m} × {n} "
                "gradients; it takes (k, 1, n), (k, m, 1) or (k, 1, 1)"
            )
        if keep is not None or keep_at is not None:
            check("scaled_add_each_", keep, len(ps), ps[0].device, keep_at)


def _scaled_add_each(
    ps: list[Tensor], Gs: list[Tensor], factor: Tensor, alpha: float, beta: float,
    keep: Tensor | None = None, keep_at: list[int] | None = None,
) -> None:  # fmt: skip
    """``ps[i] ← beta·ps[i] + alpha·Gs[i] ⊙ factor[i]`` in place for each i (a weight
    viewed as its gradient's shape; ``beta·p`` rounded to p's dtype first, as ``mul_``
    does, then one rounding). ``keep``: one bool flag per weight on their device, or
    (``keep_at``) their positions in it (a deferred step's, :mod:`~galore2.kernels.keep`);
    a weight flagged False is not written (the torch path reads the flags on the host)."""
    _check_scaled(ps, Gs, factor, keep, keep_at)
    targets = [p.view(g.shape) for p, g in zip(ps, Gs, strict=True)]
    if len(ps) > 1:
        done = run_kernel(
            "scaled_list", *targets, *Gs, factor,
            supported=lambda k: k.supported_scaled(targets, Gs, factor),
            kernel=lambda k: partial(
                k.scaled_add_list, targets, Gs, factor, alpha=alpha, beta=beta, keep=keep,
                keep_at=keep_at,
            ),
        )  # fmt: skip
        if done is not None:
            return
    taken = set(kept(keep, len(ps), keep_at))
    for i, (t, g, f) in enumerate(zip(targets, Gs, factor.unbind(0), strict=True)):
        if i not in taken:
            continue
        if beta != 1.0:
            t.mul_(beta)
        t.addcmul_(g, f, value=alpha)


channel_norms_op = torch.library.custom_op(
    "galore2::channel_norms_each", _channel_norms, mutates_args=()
)
scaled_add_op = torch.library.custom_op(
    "galore2::scaled_add_each_", _scaled_add_each, mutates_args=("ps",)
)


residual_norms_op = torch.library.custom_op(
    "galore2::residual_norms_each", _residual_norms, mutates_args=()
)


project_norms_op = torch.library.custom_op(
    "galore2::project_norms_each", _project_norms, mutates_args=("outs",)
)


@project_norms_op.register_fake
def _project_norms_meta(
    Gs: list[Tensor], Bs: list[Tensor], outs: list[Tensor], c: float, dim: int
) -> tuple[Tensor, Tensor]:  # fmt: skip
    _project_norms_shapes(Gs, Bs, outs, dim)
    norms = Gs[0].new_empty(_norms_shape(Gs, dim), dtype=torch.float32)
    return norms, torch.empty_like(norms)


@residual_norms_op.register_fake
def _residual_norms_meta(
    Gs: list[Tensor], As: list[Tensor], Bs: list[Tensor], c: float, dim: int
) -> Tensor:  # fmt: skip
    return Gs[0].new_empty(_norms_shape(Gs, dim), dtype=torch.float32)


@channel_norms_op.register_fake
def _channel_norms_meta(Gs: list[Tensor], dim: int) -> Tensor:
    return Gs[0].new_empty(_norms_shape(Gs, dim), dtype=torch.float32)


@scaled_add_op.register_fake
def _scaled_add_meta(
    ps: list[Tensor], Gs: list[Tensor], factor: Tensor, alpha: float, beta: float,
    keep: Tensor | None = None, keep_at: list[int] | None = None,
) -> None:  # fmt: skip
    _check_scaled(ps, Gs, factor, keep, keep_at)


channel_norms_each = direct(channel_norms_op, _channel_norms, mutated=())
residual_norms_each = direct(residual_norms_op, _residual_norms, mutated=())
project_norms_each = direct(project_norms_op, _project_norms, mutated=(2,))
scaled_add_each_ = direct(scaled_add_op, _scaled_add_each, mutated=(0,))

__all__ = ["channel_norms_each", "project_norms_each", "residual_norms_each", "scaled_add_each_"]
