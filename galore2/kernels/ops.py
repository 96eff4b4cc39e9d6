"""galore2's custom ops (``torch.library``): one dispatch each, whatever runs inside; in a
plain eager call the implementation is called directly (:mod:`galore2.kernels.direct`).

* ``galore2::adamw_`` (:func:`adamw_`) — an AdamW step of weights with float32 moments
  (bf16 weights with galore2's default ``state_dtype``), for which torch has no fused
  kernel (its fused AdamW keeps the moments in the weights' dtype). The Triton kernel
  :mod:`galore2.kernels.adamw` (one launch for the whole list: each weight, gradient and
  moment read once, weights and moments written once) where :mod:`~galore2.kernels.dispatch` runs
  Triton, else the torch passes it replaces (:func:`adamw_torch`: the gradients cast to
  float32, torch's fused Adam kernel writing the directions into zeroed buffers, then the
  decay and the update of the weights). On meta tensors it only checks (shapes, no values):
  a dispatch mode sees one op per call, which is how ``benchmarks/roofline.py`` counts the
  step of a machine where the kernel runs.

* ``galore2::adam_directions_`` (:func:`adam_directions_`) — Adam's moments (float32) and
  its direction rounded to bf16, for a consumer that rounds it so anyway (GaLore along the
  data): per tensor the Triton kernel (the direction read and the result written once, in
  their 16-bit dtype), else the torch passes (float32 copies of the direction and the
  result, a zeroed buffer, torch's fused Adam, the cast).

Both take a deferred step's flags (``keep``, ``keep_at``: :mod:`galore2.kernels.keep`):
a tensor flagged False on the device is not written. This module imports no triton (the
kernel module is loaded on first use).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from .direct import direct
from .dispatch import run_kernel
from .keep import check, kept, members


def adam_directions(
    us: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], step: int,
    beta1: float, beta2: float, eps: float,
) -> list[Tensor]:  # fmt: skip
    """Step ``step`` of Adam on the float32 moments (updated in place) with float32
    directions ``us``, returning m̂/(√v̂ + eps) per tensor, by torch's fused Adam kernel (one
    launch for the lists, each moment read and written once): it updates a "parameter"
    ``p ← p − lr·m̂/(√v̂ + eps)``, here a zeroed buffer with lr = −1, which is then the
    direction."""
    out = [torch.empty_like(m) for m in exp_avgs]
    torch._foreach_zero_(out)
    t = torch.full((), float(step), dtype=torch.float32, device=exp_avgs[0].device)
    torch._fused_adam_(
        out, us, exp_avgs, exp_avg_sqs, [], [t] * len(out), lr=-1.0, beta1=beta1,
        beta2=beta2, weight_decay=0.0, eps=eps, amsgrad=False, maximize=False,
    )  # fmt: skip
    return out


def adamw_torch(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor], step: int, lr: float, beta1: float, beta2: float, eps: float,
    decay: float,
) -> None:  # fmt: skip
    """:func:`adamw_` by torch's kernels: the gradients cast to float32, the directions by
    :func:`adam_directions`, then ``p ← p·decay`` and ``p ← p − lr·direction`` (two foreach
    kernels): what galore2's plain AdamW group computes (``ScaleByAdam`` and the
    optimizer's ``apply_updates``)."""
    us = [g if g.dtype == torch.float32 else g.to(torch.float32) for g in grads]
    dirs = adam_directions(us, exp_avgs, exp_avg_sqs, step, beta1, beta2, eps)
    if decay != 1.0:
        torch._foreach_mul_(params, decay)
    torch._foreach_add_(params, dirs, alpha=-lr)


def _adamw(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor], step: int, lr: float, beta1: float, beta2: float, eps: float,
    decay: float, keep: Tensor | None = None,
) -> None:  # fmt: skip
    """Step ``step`` (≥ 1, counted already) of AdamW, ``p ← p·decay − lr·m̂/(√v̂ + eps)``,
    for each weight ``p`` of ``params`` with its gradient (in ``p``'s dtype) and float32
    moments (updated in place); see the module docstring. Where the Triton kernel runs,
    the whole list is one launch (:func:`galore2.kernels.adamw.adamw_list_step`; one call
    is one launch, as a dispatch mode counts it); else (a CUDA graph being captured, or
    inputs it does not take) one launch per weight, or the torch passes. ``keep``: one bool
    flag per weight on their device (a deferred step's, :mod:`~galore2.kernels.keep`): a
    weight flagged False is not written, nor are its moments."""
    hyper = {"step": step, "lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps,
             "decay": decay}  # fmt: skip
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    if len(params) > 1 and run_kernel(
        "adamw", *(t for ts in lists for t in ts),
        supported=lambda k: k.supported_list(*lists),
        kernel=lambda k: partial(k.launch_list, *lists, **hyper, keep=keep),  # supported_list asked
    ):  # fmt: skip
        return
    rest = []
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        args = (p, g, m, v)
        flag = None if keep is None else keep[i : i + 1]
        done = run_kernel(
            "adamw", *args,
            supported=lambda k, args=args: k.supported(*args),
            kernel=lambda k, args=args, flag=flag: partial(k.adamw_step, *args, **hyper,
                                                           keep=flag),
        )  # fmt: skip
        if done is None:  # the torch path (adamw_step returns True once it ran)
            rest.append(i)
    if rest and keep is not None:  # the torch path reads the flags on the host
        taken = set(kept(keep, len(params)))
        rest = [i for i in rest if i in taken]
    if rest:
        adamw_torch(
            [params[i] for i in rest], [grads[i] for i in rest], [exp_avgs[i] for i in rest],
            [exp_avg_sqs[i] for i in rest], step, lr, beta1, beta2, eps, decay,
        )  # fmt: skip


adamw_op = torch.library.custom_op(
    "galore2::adamw_", _adamw, mutates_args=("params", "exp_avgs", "exp_avg_sqs")
)


@adamw_op.register_fake
def _adamw_meta(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor], step: int, lr: float, beta1: float, beta2: float, eps: float,
    decay: float, keep: Tensor | None = None,
) -> None:  # fmt: skip
    if params:
        check("adamw_", keep, len(params), params[0].device)
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        if not (g.shape == m.shape == v.shape == p.shape):
            raise ValueError(
                f"adamw_: gradient and moments must have the weight's shape {tuple(p.shape)}, "
                f"got {tuple(g.shape)}, {tuple(m.shape)}, {tuple(v.shape)}"
            )


def directions_torch(
    us: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], outs: list[Tensor],
    step: int, beta1: float, beta2: float, eps: float,
) -> None:  # fmt: skip
    """:func:`adam_directions_` by torch's kernels: the directions cast to float32,
    :func:`adam_directions`, the results rounded into ``outs`` (one copy each)."""
    us32 = [u if u.dtype == torch.float32 else u.to(torch.float32) for u in us]
    dirs = adam_directions(us32, exp_avgs, exp_avg_sqs, step, beta1, beta2, eps)
    torch._foreach_copy_(outs, dirs)


def _adam_directions(
    us: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], outs: list[Tensor],
    step: int, beta1: float, beta2: float, eps: float, keep: Tensor | None = None,
    keep_at: list[int] | None = None, steps: list[int] | None = None,
) -> None:  # fmt: skip
    """Step ``step`` (≥ 1, counted already) of Adam on float32 moments (updated in place)
    with directions ``us`` (bf16 or float32), each m̂/(√v̂ + eps) rounded into its bf16
    ``outs`` entry — for a consumer that rounds the direction to bf16 before any other use
    (GaLore's low-rank update written into bf16 weights). Per tensor, the Triton kernel
    :func:`galore2.kernels.adamw.directions_step` where it runs (one launch, each byte
    touched once), else :func:`directions_torch` (what :func:`adam_directions` and the
    consumer's cast compute). ``keep`` (one direction only: a stack of k members, or one
    matrix): one bool flag per member on its device, or (``keep_at``) the members' positions
    in it (a deferred step's, :mod:`~galore2.kernels.keep`); a member flagged False has
    neither its moments nor its ``out`` written. ``steps`` (one direction only): each
    member's own step count, for a stack whose members count different steps (``step``
    unused then). Meta tensors: checked only (see the module docstring)."""
    if keep is not None or keep_at is not None or steps is not None:
        _check_directions_keep(us, keep, keep_at, steps)
    rest = []
    for i, args in enumerate(zip(us, exp_avgs, exp_avg_sqs, outs, strict=True)):
        done = run_kernel(
            "adamw", *args,
            supported=lambda k, args=args: k.supported_directions(*args),
            kernel=lambda k, args=args: partial(
                k.directions_step, *args, step=step, beta1=beta1, beta2=beta2, eps=eps,
                keep=keep, keep_at=keep_at, steps=steps,
            ),
        )  # fmt: skip
        if done is None:
            rest.append(i)
    if rest and (keep is not None or steps is not None):  # one direction, by its members
        _directions_kept(us[0], exp_avgs[0], exp_avg_sqs[0], outs[0], step, beta1, beta2, eps,
                         keep, keep_at, steps)  # fmt: skip
    elif rest:
        directions_torch(
            [us[i] for i in rest], [exp_avgs[i] for i in rest], [exp_avg_sqs[i] for i in rest],
            [outs[i] for i in rest], step, beta1, beta2, eps,
        )  # fmt: skip


def _check_directions_keep(
    us: list[Tensor], keep: Tensor | None, keep_at: list[int] | None, steps: list[int] | None
) -> None:
    """``keep`` and ``steps`` of :func:`_adam_directions`: one direction, one flag and one
    count per member."""
    if len(us) != 1:
        raise ValueError(f"adam_directions_: keep and steps take one direction, got {len(us)}")
    u = us[0]
    count = members(keep, keep_at, steps)
    if keep is not None or keep_at is not None:
        check("adam_directions_", keep, count, u.device, keep_at)
    if count != 1 and (u.dim() == 0 or u.shape[0] != count):
        raise ValueError(
            f"adam_directions_: {count} flags or steps for a direction of shape "
            f"{tuple(u.shape)}: one, or one per entry of its first dimension"
        )


def _directions_kept(
    u: Tensor, m: Tensor, v: Tensor, out: Tensor, step: int, beta1: float, beta2: float,
    eps: float, keep: Tensor | None, keep_at: list[int] | None, steps: list[int] | None,
) -> None:  # fmt: skip
    """:func:`directions_torch` of the members ``keep`` flags True (read on the host), each
    at its own step count where ``steps`` gives them (one member at a time then)."""
    count = members(keep, keep_at, steps)
    taken = kept(keep, count, keep_at)
    if steps is not None:
        for j in taken:
            directions_torch([u[j]], [m[j]], [v[j]], [out[j]], steps[j], beta1, beta2, eps)
        return
    if len(taken) == count:
        directions_torch([u], [m], [v], [out], step, beta1, beta2, eps)
        return
    if not taken:
        return
    pick = torch.tensor(taken, device=u.device)
    mu, vu, ou = m[pick], v[pick], out[pick]
    directions_torch([u[pick]], [mu], [vu], [ou], step, beta1, beta2, eps)
    m[pick], v[pick], out[pick] = mu, vu, ou


adam_directions_op = torch.library.custom_op(
    "galore2::adam_directions_", _adam_directions, mutates_args=("exp_avgs", "exp_avg_sqs", "outs")
)


@adam_directions_op.register_fake
def _directions_meta(
    us: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], outs: list[Tensor],
    step: int, beta1: float, beta2: float, eps: float, keep: Tensor | None = None,
    keep_at: list[int] | None = None, steps: list[int] | None = None,
) -> None:  # fmt: skip
    if keep is not None or keep_at is not None or steps is not None:
        _check_directions_keep(us, keep, keep_at, steps)
    for u, m, v, o in zip(us, exp_avgs, exp_avg_sqs, outs, strict=True):
        if not (m.shape == v.shape == o.shape == u.shape):
            raise ValueError(
                f"adam_directions_: moments and out must have the direction's shape "
                f"{tuple(u.shape)}, got {tuple(m.shape)}, {tuple(v.shape)}, {tuple(o.shape)}"
            )


#: the ops as galore2 calls them: the implementation itself in plain eager calls (no
#: torch.library wrapper walking 200 tensors per call), the op for everything else
#: (:mod:`galore2.kernels.direct`)
adamw_ = direct(adamw_op, _adamw, mutated=(0, 2, 3))
adam_directions_ = direct(adam_directions_op, _adam_directions, mutated=(1, 2, 3))


#: the device types where a step takes galore2's fused ops instead of its own arithmetic
#: (:func:`~galore2.optim.adamw_step.mixed_path`, :func:`~galore2.optim.adam_paths.rounded_path`):
#: CUDA, and meta (a count of that step). The CPU keeps its own; tests add it, with
#: Triton's interpreter.
FUSED_OP_DEVICES: tuple[str, ...] = ("cuda", "meta")


def triton_would_run() -> bool:
    """Whether :func:`adamw_` runs its Triton kernel on an NVIDIA GPU of this setup
    (``GALORE2_KERNELS`` not ``torch``, triton importable): what a step on meta tensors
    stands for (see :func:`~galore2.kernels.dispatch.use_triton`)."""
    from .dispatch import kernel_mode, triton_available

    return kernel_mode() != "torch" and triton_available()


__all__ = [
    "FUSED_OP_DEVICES",
    "adam_directions",
    "adam_directions_",
    "adamw_",
    "adamw_torch",
    "directions_torch",
    "triton_would_run",
]
