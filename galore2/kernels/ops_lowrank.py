"""galore2's grouped-matmul ops (``torch.library``): a shape batch's projections and
back-projections, one dispatch each.

Operands are rounded to the output's dtype first; a float32 operand of a bf16 output (a
stored fp32 basis) is rounded by the grouped kernel as it loads it (:func:`operand_dtypes`).

* ``galore2::mm_each_`` (:func:`mm_each_`) — ``outs[i] ← As[i] @ Bs[i]``: GaLore's
  projection of each gradient of a shape batch into its entry of the stack R, each
  gradient read where it is (no stack of the gradients).
* ``galore2::addmm_each_`` (:func:`addmm_each_`) — ``ps[i] ← beta·ps[i] + alpha·(As[i] @
  Bs[i])``: the back-projection written into each weight, decay and update in the matmul
  (no m×n update made).
* ``galore2::addmm_scaled_each_`` (:func:`addmm_scaled_each_`) — the same plus
  ``gamma·Gs[i] ⊙ factor[i]`` in the epilogue: Fira's update (its scaled residual's
  gradient part) in the one pass over each weight.

Where :mod:`~galore2.kernels.dispatch` runs Triton, one launch for the whole list
(:mod:`galore2.kernels.lowrank_list`); elsewhere one ``mm`` / ``addmm_`` per entry (the
same products up to summation order). On meta tensors they only check shapes: a dispatch
mode sees one op per call, which is how ``benchmarks/roofline.py`` counts a step of a
machine where the kernel runs. In plain eager calls the implementation is called directly
(:mod:`galore2.kernels.direct`).

This module imports no triton (the kernel module is loaded on first use).
"""

from __future__ import annotations

import importlib
from functools import partial

import torch
from torch import Tensor

from .direct import direct
from .dispatch import disabled_kernels, kernel_mode, run_kernel, triton_available, use_triton
from .keep import check, kept


def _grouped(outs: list[Tensor], ps: list[Tensor], As: list[Tensor], Bs: list[Tensor],
             alpha: float, beta: float, keep: Tensor | None = None,
             keep_at: list[int] | None = None) -> bool:  # fmt: skip
    """The list kernel's launch where it runs (True), else False (the torch path)."""
    if len(outs) < 2:
        return False
    lists = (outs, ps, As, Bs)
    done = run_kernel(
        "lowrank_list", *(t for ts in lists for t in ts),
        supported=lambda k: k.supported_list(*lists),
        kernel=lambda k: partial(  # supported_list took them; the op checked the flags
            k.launch_list, *lists, alpha=alpha, beta=beta, keep=keep, keep_at=keep_at
        ),
    )  # fmt: skip
    return done is not None


def operand_dtypes(
    out: torch.dtype, a: torch.dtype, b: torch.dtype
) -> tuple[torch.dtype, torch.dtype] | None:  # fmt: skip
    """(a, b) when the ops take operands of these dtypes for an output in ``out``: the
    output's dtype, or float32 rounded to bf16 first for a bf16 output (a stored fp32
    basis against bf16 gradients or weights; the grouped kernel rounds its tiles as it
    loads them, so no cast pass); None otherwise."""
    ok = (out,) if out != torch.bfloat16 else (out, torch.float32)
    return (a, b) if a in ok and b in ok else None


def _in(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _mm_each(As: list[Tensor], Bs: list[Tensor], outs: list[Tensor]) -> None:
    """``outs[i] ← As[i] @ Bs[i]`` for each i, the operands rounded to the output's dtype
    first (see the module docstring)."""
    if _grouped(outs, outs, As, Bs, 1.0, 0.0):
        return
    for a, b, out in zip(As, Bs, outs, strict=True):
        torch.mm(_in(a, out.dtype), _in(b, out.dtype), out=out)


def _addmm_each(
    ps: list[Tensor], As: list[Tensor], Bs: list[Tensor], alpha: float, beta: float,
    keep: Tensor | None = None, keep_at: list[int] | None = None,
) -> None:  # fmt: skip
    """``ps[i] ← beta·ps[i] + alpha·(As[i] @ Bs[i])`` in place for each i (2-D ``ps``), the
    operands rounded to the weights' dtype first. ``keep``: one bool flag per weight on
    their device, or (``keep_at``) the weights' positions in it (a deferred step's,
    :mod:`~galore2.kernels.keep`); a weight flagged False is not written (the grouped
    kernel reads the flags; the torch path picks on the host)."""
    if ps:
        check("addmm_each_", keep, len(ps), ps[0].device, keep_at)
    if _grouped(ps, ps, As, Bs, alpha, beta, keep, keep_at):
        return
    for i in kept(keep, len(ps), keep_at):
        p = ps[i]
        p.addmm_(_in(As[i], p.dtype), _in(Bs[i], p.dtype), beta=beta, alpha=alpha)


def _addmm_scaled_each(
    ps: list[Tensor], As: list[Tensor], Bs: list[Tensor], Gs: list[Tensor], factor: Tensor,
    alpha: float, beta: float, gamma: float, keep: Tensor | None = None,
    keep_at: list[int] | None = None,
) -> None:  # fmt: skip
    """``ps[i] ← beta·ps[i] + alpha·(As[i] @ Bs[i]) + gamma·Gs[i] ⊙ factor[i]`` in place for
    each i (2-D ``ps``; ``factor``: a float32 ``(k, 1, n)``, ``(k, m, 1)`` or ``(k, 1, 1)``
    stack): Fira's update along the data, the residual's scaled gradient in the
    back-projection's epilogue (one rounding of each weight where the grouped kernel runs;
    elsewhere an ``addmm_`` then an ``addcmul_`` per weight). ``keep`` / ``keep_at``: as
    :func:`addmm_each_` takes them (a weight flagged False is not written)."""
    _check_gradients(ps, Gs, factor)
    if keep is not None or keep_at is not None:
        check("addmm_scaled_each_", keep, len(ps), ps[0].device, keep_at)
    if len(ps) > 1:
        done = run_kernel(
            "lowrank_list", *ps, *As, *Bs, *Gs, factor,
            supported=lambda k: k.supported_scaled_list(ps, As, Bs, Gs, factor),
            kernel=lambda k: partial(k.addmm_scaled_list, ps, As, Bs, Gs, factor,
                                     alpha=alpha, beta=beta, gamma=gamma, keep=keep,
                                     keep_at=keep_at),
        )  # fmt: skip
        if done is not None:
            return
    taken = set(kept(keep, len(ps), keep_at))
    for i, (p, a, b, g, f) in enumerate(zip(ps, As, Bs, Gs, factor.unbind(0), strict=True)):
        if i not in taken:
            continue
        p.addmm_(_in(a, p.dtype), _in(b, p.dtype), beta=beta, alpha=alpha)
        p.addcmul_(g, f, value=gamma)


def _check_gradients(ps: list[Tensor], Gs: list[Tensor], factor: Tensor) -> None:
    if len(Gs) != len(ps) or any(g.shape != p.shape for g, p in zip(Gs, ps, strict=True)):
        raise ValueError("addmm_scaled_each_: one gradient of each weight's shape per weight")
    shape = tuple(factor.shape)
    if ps and (factor.dtype != torch.float32 or len(shape) != 3 or shape[0] != len(ps)
               or shape[1:] not in ((1, ps[0].shape[1]), (ps[0].shape[0], 1), (1, 1))):  # fmt: skip
        raise ValueError(
            f"addmm_scaled_each_: a {factor.dtype} factor of shape {shape} for {len(ps)} "
            "weights; it takes a float32 (k, 1, n), (k, m, 1) or (k, 1, 1) stack"
        )


def _check(name: str, outs: list[Tensor], As: list[Tensor], Bs: list[Tensor]) -> None:
    if not (len(outs) == len(As) == len(Bs)):
        raise ValueError(f"{name}: lists of one length, got {len(outs)}, {len(As)}, {len(Bs)}")
    for o, a, b in zip(outs, As, Bs, strict=True):
        if operand_dtypes(o.dtype, a.dtype, b.dtype) is None:
            raise ValueError(
                f"{name}: operands of {a.dtype} and {b.dtype} for an output in {o.dtype}; "
                "they take the output's dtype, or float32 for a bf16 output"
            )
        if (
            a.dim() != 2
            or b.dim() != 2
            or a.shape[1] != b.shape[0]
            or (tuple(o.shape) != (a.shape[0], b.shape[1]))
        ):
            raise ValueError(
                f"{name}: {tuple(o.shape)} is not the product of {tuple(a.shape)} and "
                f"{tuple(b.shape)}"
            )


mm_each_op = torch.library.custom_op("galore2::mm_each_", _mm_each, mutates_args=("outs",))
addmm_each_op = torch.library.custom_op("galore2::addmm_each_", _addmm_each, mutates_args=("ps",))
addmm_scaled_each_op = torch.library.custom_op(
    "galore2::addmm_scaled_each_", _addmm_scaled_each, mutates_args=("ps",)
)


@mm_each_op.register_fake
def _mm_each_meta(As: list[Tensor], Bs: list[Tensor], outs: list[Tensor]) -> None:
    _check("mm_each_", outs, As, Bs)


@addmm_each_op.register_fake
def _addmm_each_meta(
    ps: list[Tensor], As: list[Tensor], Bs: list[Tensor], alpha: float, beta: float,
    keep: Tensor | None = None, keep_at: list[int] | None = None,
) -> None:  # fmt: skip
    _check("addmm_each_", ps, As, Bs)
    if ps:
        check("addmm_each_", keep, len(ps), ps[0].device, keep_at)


@addmm_scaled_each_op.register_fake
def _addmm_scaled_each_meta(
    ps: list[Tensor], As: list[Tensor], Bs: list[Tensor], Gs: list[Tensor], factor: Tensor,
    alpha: float, beta: float, gamma: float, keep: Tensor | None = None,
    keep_at: list[int] | None = None,
) -> None:  # fmt: skip
    _check("addmm_scaled_each_", ps, As, Bs)
    _check_gradients(ps, Gs, factor)
    if keep is not None or keep_at is not None:
        check("addmm_scaled_each_", keep, len(ps), ps[0].device, keep_at)


mm_each_ = direct(mm_each_op, _mm_each, mutated=(2,))
addmm_scaled_each_ = direct(addmm_scaled_each_op, _addmm_scaled_each, mutated=(0,))
addmm_each_ = direct(addmm_each_op, _addmm_each, mutated=(0,))


def grouped_would_run(t: Tensor, name: str = "lowrank_list") -> bool:
    """Would a list of matrices like ``t`` take the grouped kernel ``name`` (one launch per
    list; a module of :mod:`galore2.kernels`)? On meta tensors: whether it would on an
    NVIDIA GPU of this setup (what a step on meta tensors stands for, as
    :func:`~galore2.kernels.ops.triton_would_run` says). In ``auto`` mode not when the
    kernel opted out (``AUTO = False`` in its module) or was switched off after a
    failure."""
    mode = kernel_mode()
    if t.is_meta:
        runs = mode != "torch" and triton_available()
    else:
        try:
            runs = use_triton(t)
        except RuntimeError:  # GALORE2_KERNELS=triton where it cannot run: the op will say so
            return False
    if not runs or mode != "auto":
        return runs
    if name in disabled_kernels():
        return False
    return getattr(importlib.import_module(f"{__package__}.{name}"), "AUTO", True)


__all__ = ["addmm_each_", "addmm_scaled_each_", "grouped_would_run", "mm_each_", "operand_dtypes"]
