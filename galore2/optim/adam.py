"""Adam's moment estimates as a transform (``ScaleByAdam``).

Acts on: whatever direction it is given — the full gradient in a plain group,
the projected r×n (or m×r) gradient inside GaLore.
State per element of the direction: 2 values in ``state_dtype`` (``exp_avg``,
``exp_avg_sq``) plus one int64 step counter on the CPU.

Moment storage (the ``moments`` constructor argument, :mod:`galore2.storage.moments`):
``"state_dtype"`` (the default) keeps both moments in the group's ``state_dtype``;
``"dynamic8"`` stores those of large directions in bitsandbytes' dynamic 8-bit blockwise
format (:mod:`galore2.storage.dynamic8`; ~1.016 bytes per element and moment for blocks of
256) — 8-bit Adam (``ScaleByAdam8bit``, ``GaLoreAdamW8bit``). Each step then dequantizes the
moments to fp32, runs the same arithmetic and quantizes them back; the returned direction
is computed from the fp32 moments before requantization (as bitsandbytes' 8-bit Adam does).
On the CPU, where the storage layer quantizes in torch, that happens chunk by chunk (~2^20
elements of whole blocks), so no full-size fp32 moments are made; the results are the same
bits. On CUDA with triton installed (see :mod:`galore2.kernels.dispatch`, ``GALORE2_KERNELS``)
that step is one fused Triton kernel (:mod:`galore2.kernels.adam8bit`) with the same
arithmetic and block layout — batched (``foreach``), one launch per stack of same-shape
directions (:func:`galore2.optim.adam8bit.adam8bit_stack_`); its quantizer picks the exact nearest code (bitsandbytes' CPU
quantizer is off by a code or more on a few percent of elements). Quantized moments are
always updated in fp32 (``state_dtype`` does not apply to them); small directions keep
``state_dtype`` moments and match the default exactly.

The arithmetic follows ``torch.optim.AdamW``'s single-tensor path (lerp for the
first moment, bias-corrected square root in the denominator, ``eps`` added
after the correction), so a plain group matches ``torch.optim.AdamW`` to
rounding. The returned direction is ``m̂ / (√v̂ + eps)``; the optimizer scales it
by ``-lr``.

``compile=True`` (a group option) runs that dense math — both moment updates and the
direction, per tensor (:func:`adam_math`) or for a whole batch (:func:`adam_math_many`,
``foreach``) — through ``torch.compile(fullgraph=True, dynamic=True)``, compiled lazily
once per process (:func:`compiled`). The step-dependent scalars (the folded bias
corrections) are plain Python floats, which ``dynamic=True`` traces as symbols rather than
constants: one compile per number of dimensions and dtype (per tensor; sizes 0 and 1 are
specialized, as dynamo always does) or per batch layout (foreach), not one per step; past
:data:`RECOMPILE_LIMIT` variants a function runs eagerly, with a warning
(:func:`run_compiled`). The step counter and the scalars stay outside the graph.
Inductor may round differently (fused multiply-adds), so compiled steps match eager ones
to rounding, not bitwise; ``compile=False`` runs the eager code unchanged. Quantized
(8-bit) moments always take the eager path.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

import torch
from torch import Tensor

from .. import _numerics
from ..core.masked import derive, usable_or_one
from ..core.modules import DecoupledWeightDecay
from ..core.options import Bool, Option, Optional, Pair, Real
from ..core.transform import Context, Group, State, Transform, members
from ..kernels import ops
from ..kernels.dispatch import run_kernel
from ..kernels.ops import adam_directions
from ..storage import dynamic8
from ..storage.dtype import STATE_DTYPE
from ..storage.dynamic8 import Dynamic8Format
from ..storage.moments import is_quantized, stored_format
from .moments import MomentRule, moment_rule_kinds

_BETA = Real(low=0.0, high=1.0, high_open=True)
BETAS = Option(
    "betas",
    (0.9, 0.999),
    Pair(_BETA, _BETA),
    "(β₁, β₂): decay rates of the first and second moments",
)
EPS = Option(
    "eps", 1e-8, Real(low=0.0, low_open=True), "added to the denominator √v̂ for numerical stability"
)
COMPILE = Option(
    "compile",
    False,
    Bool(),
    "True: Adam's dense math (moments, m̂/(√v̂+eps)) runs through torch.compile, compiled "
    "once per process; 8-bit moments stay eager",
)

FUSED = Option(
    "fused",
    None,
    Optional(Bool(), "where the group is batched (off the CPU, or foreach=True)"),
    "groups whose step is plain AdamW (no rank; moments in the parameters' dtype): True: "
    "torch's fused AdamW kernel (torch.optim.AdamW(fused=True)'s bits) on any device; "
    "False: galore2's own Adam",
)


def adam_math(
    u: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    weight1: float,
    beta2: float,
    weight2: float,
    scale: float,
    shift: float,
) -> Tensor:
    """Adam's dense math, the function ``compile=True`` compiles: ``exp_avg``, ``exp_avg_sq``
    updated in place (``weight1`` = 1−β₁, ``weight2`` = 1−β₂), the direction
    ``m / (√v·scale + shift)`` returned, where ``scale`` = bc₁/√bc₂ and ``shift`` = bc₁·eps
    fold both bias corrections (it is m̂/(√v̂ + eps), as the eager path computes it)."""
    exp_avg.lerp_(u, weight1)
    exp_avg_sq.mul_(beta2).addcmul_(u, u, value=weight2)
    return exp_avg / (exp_avg_sq.sqrt() * scale + shift)


def adam_math_many(
    us: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    weight1: float,
    beta2: float,
    weight2: float,
    scales: list[float],
    shifts: list[float],
) -> list[Tensor]:
    """:func:`adam_math` for a batch of tensors, one graph (the foreach path compiled).
    Written as a loop, not ``torch._foreach_*`` ops: those take a list of scalars as
    constants, which would recompile every step."""
    return [
        adam_math(u, m, v, weight1, beta2, weight2, scale, shift)
        for u, m, v, scale, shift in zip(us, exp_avgs, exp_avg_sqs, scales, shifts, strict=True)
    ]


RECOMPILE_LIMIT = 64  # variants dynamo may compile per function (torch's default: 8)
_COMPILED: dict[Callable[..., Any], Callable[..., Any]] = {}
_OVER_LIMIT: set[Callable[..., Any]] = set()  # functions run eagerly from now on


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` under ``torch.compile(fullgraph=True, dynamic=True)``, created on first use and
    shared by every optimizer of the process (so its compiled graphs are too). A plain dict,
    not ``functools.cache``: an outer ``torch.compile(opt.step)`` traces this lookup."""
    out = _COMPILED.get(fn)
    if out is None:
        kwargs: dict[str, Any] = {"fullgraph": True, "dynamic": True}
        if "recompile_limit" in inspect.signature(torch.compile).parameters:  # recent torch only
            kwargs["recompile_limit"] = RECOMPILE_LIMIT
        out = _COMPILED[fn] = torch.compile(fn, **kwargs)
    return out


def run_compiled(fn: Callable[..., Any], *args: Any) -> Any:
    """``compiled(fn)(*args)``; once dynamo refuses another variant of ``fn`` (its recompile
    limit, an error under ``fullgraph``: say, more distinct foreach batch layouts than the
    limit), ``fn`` runs eagerly for the rest of the process, after one ``RuntimeWarning``.
    The refusal comes before the graph runs, so nothing was updated twice. Under an outer
    ``torch.compile`` (of ``opt.step``, say) ``fn`` is called as is: that compile traces it
    into its own graph."""
    if torch.compiler.is_compiling():
        return fn(*args)
    if fn not in _OVER_LIMIT:
        try:
            return compiled(fn)(*args)
        except Exception as err:
            if type(err).__name__ != "FailOnRecompileLimitHit":
                raise
            _OVER_LIMIT.add(fn)
            warnings.warn(
                f"galore2: torch.compile hit its recompile limit on {fn.__name__} ({err}); "
                "compile=True runs it eagerly from now on",
                RuntimeWarning,
                stacklevel=2,
            )
    return fn(*args)


def _corrections(beta1: float, beta2: float, eps: float, t: Any) -> tuple[Any, Any]:
    """(scale, shift) of step ``t``: the eager path's ``bias_correction1 /
    bias_correction2_sqrt`` and ``bias_correction1 * eps``, the same float arithmetic. ``t``
    may be a device counter (``capturable=True``): then both are float64 tensors on its
    device, computed there (no host read); they equal the host's Python floats up to the
    device's ``pow`` (the last bit, for some large ``t``)."""
    if isinstance(t, Tensor):
        td = t.to(torch.float64)
        bias_correction1 = 1 - torch.pow(beta1, td)
        return bias_correction1 / (1 - torch.pow(beta2, td)).sqrt(), bias_correction1 * eps
    bias_correction1 = 1 - beta1**t
    return bias_correction1 / math.sqrt(1 - beta2**t), bias_correction1 * eps


def _per_entry(
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


#: devices with torch's fused Adam kernel (``torch._fused_adam_``) that :func:`_fused_directions` uses
_FUSED_DEVICES = ("cpu", "cuda")


def _fusable(exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], us: list[Tensor]) -> bool:
    """Can torch's fused Adam kernel step this batch (:func:`_fused_directions`): float32
    moments and directions, contiguous, on one CPU or CUDA device?"""
    first = exp_avgs[0]
    if first.dtype != torch.float32 or first.device.type not in _FUSED_DEVICES:
        return False
    device = first.device
    return all(
        t.dtype == torch.float32 and t.device == device and t.is_contiguous()
        for ts in (exp_avgs, exp_avg_sqs, us) for t in ts
    )  # fmt: skip


def _fused_directions(
    us: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], t: int, group: Group
) -> list[Tensor]:
    """Step ``t`` of Adam on the moments and the directions m̂/(√v̂ + eps), by torch's fused
    Adam kernel (:func:`~galore2.kernels.ops.adam_directions`: one launch for the batch,
    each moment read and written once). Moments and direction are
    :meth:`ScaleByAdam._arith`'s up to an ulp or so: the kernel may fuse a multiply-add,
    and computes m̂/(√v̂ + eps) as (m/bc1)/(√v/√bc2 + eps) rather than
    m/(√v·bc1/√bc2 + bc1·eps)."""
    beta1, beta2 = group["betas"]
    return adam_directions(us, exp_avgs, exp_avg_sqs, t, beta1, beta2, group["eps"])


def _rounding(ctxs: list[Context]) -> torch.dtype | None:
    """The dtype every one of ``ctxs``' directions is rounded to by its consumer
    (:attr:`~galore2.core.module.Context.rounds_to`), or None (not all, or not one)."""
    first = ctxs[0].rounds_to if ctxs else None
    return first if first is not None and all(c.rounds_to == first for c in ctxs) else None


def _rounded_path(us: list[Tensor], states: list[State], rounds: torch.dtype | None) -> bool:
    """Whether galore2's op writes a batch's directions in bf16 (``rounds``, the dtype its
    consumer rounds them to): bf16 directions and float32 moments of their shape, all
    contiguous, on CUDA (or meta: a count of that step) with the kernels on (see
    :func:`mixed_path`). Never on the CPU."""
    if rounds != torch.bfloat16 or not us or us[0].device.type not in ("cuda", "meta"):
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


def _masked_weights(
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


#: devices where torch has a fused AdamW kernel (and meta: a dry run of one)
_FUSED_DEVICES = frozenset({"cuda", "xpu", "mps", "hpu", "mtia", "privateuseone", "meta", "cpu"})
_CPU = torch.device("cpu")


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
    """Whether galore2's fused AdamW op (:func:`galore2.kernels.ops.adamw_`, a Triton
    kernel per weight) runs a plain AdamW group's step of bf16 weights with float32
    moments, which torch's fused kernel does not take: where :func:`_fused_wanted`, on CUDA
    (or meta: a count of that step, :mod:`benchmarks.roofline`) with the kernels on
    (``GALORE2_KERNELS`` not ``torch``, triton importable; a GPU it cannot run on takes
    the torch passes inside the op, galore2's own arithmetic), for bf16 weights and
    gradients and float32 moments of the weights' shape, all contiguous. Never on the
    CPU, whose step stays galore2's own."""
    if not params or params[0].device.type not in ("cuda", "meta"):
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
    if not _fused_wanted(params, group) or device.type not in _FUSED_DEVICES:
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


def _step_tensors(steps: list[int], device: torch.device) -> list[Tensor]:
    """torch's float32 0-d step counters holding ``steps`` on ``device``, which its fused
    kernel reads: one fill when every count is the same (the usual step)."""
    if steps.count(steps[0]) == len(steps):
        values = torch.full((len(steps),), float(steps[0]), device=device)
    else:
        values = torch.tensor([float(t) for t in steps], device=device)
    return list(values.unbind())


AXIS = "adam.block_dim"  # the blocked axis of both 8-bit moments (same shape and layout)


class ScaleByAdam(MomentRule, Transform):
    """Adam's moments; ``moments`` picks their storage (``"state_dtype"`` or ``"dynamic8"``,
    see the module docstring). Its step is counted once per direction and step, by
    :meth:`~galore2.optim.moments.MomentRule.count_step` (one direction) or
    :meth:`~galore2.optim.moments.MomentRule.count_steps` (a batch), before the path that
    runs its arithmetic is chosen."""

    name = "adam"
    label = "Adam"
    step_key = "adam.step"
    second_key = "adam.exp_avg_sq"
    options = (BETAS, EPS, STATE_DTYPE, COMPILE, FUSED)
    # ScaleByAdam8bit kept its moments under ``adam8.*`` before storage formats were shared
    renamed_keys: ClassVar[dict[str, str]] = {
        f"adam8.{k}": f"adam.{k}"
        for k in ("exp_avg", "exp_avg.absmax", "exp_avg_sq", "exp_avg_sq.absmax", "block_dim")
    }
    kinds: ClassVar[dict[str, str]] = moment_rule_kinds("adam", "exp_avg", "exp_avg_sq")
    axis = AXIS
    linear_keys = ("adam.exp_avg",)
    quadratic_keys = ("adam.exp_avg_sq",)
    #: kept on the parameters' device with ``capturable=True`` (see
    #: :meth:`~galore2.optim.moments.MomentRule.count_step`)
    device_counters = ("adam.step",)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(moments={self.moments!r})"

    def adamw_rule(self, group: Group) -> Transform | None:
        """This rule, when its update is torch's Adam: moments kept in ``state_dtype`` (not
        8-bit), eager (not ``compile``), and ``fused`` not False."""
        if self.moments != "state_dtype" or group.get("compile") or group.get("fused") is False:
            return None
        return self

    def torch_adamw(
        self, params: list[Tensor], grads: list[Tensor], states: list[State], group: Group
    ) -> bool:
        """The whole AdamW step of a group's tensors (moments, decoupled decay, the update)
        by torch's fused AdamW kernel, one launch per (device, dtype) list, bit for bit
        ``torch.optim.AdamW(fused=True)``'s, where :func:`torch_path` allows it; bf16
        weights with float32 moments (which that kernel does not take) by galore2's fused
        op where :func:`mixed_path` allows it (one launch per weight reading and writing
        each byte once, galore2's own arithmetic to the last bit of a rounding). False
        (nothing done) otherwise: the chain runs. The step counters (``adam.step``) count
        as always; the kernel reads the counts from one fill of float32 device scalars."""
        mixed = not torch_path(params, grads, states, group)
        if mixed and not mixed_path(params, grads, states, group):
            return False
        counted, _ = members(states)
        steps = self.count_steps(counted, group, _CPU)
        assert not isinstance(steps, Tensor)  # host counters: capturable takes the chain
        beta1, beta2 = group["betas"]
        if mixed:  # bf16 weights, float32 moments: galore2's op, one call (launch) a weight
            lr = float(group["lr"])
            decay = DecoupledWeightDecay.factor(group)  # the optimizer's (see _adamw_rule)
            for p, g, s, t in zip(params, grads, states, steps, strict=True):
                ops.adamw_(
                    [p], [g], [s["adam.exp_avg"]], [s["adam.exp_avg_sq"]], t, lr, beta1,
                    beta2, group["eps"], decay,
                )  # fmt: skip
            return True
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
        return True

    def capture_problem(self, group: Group) -> str | None:
        """Why a step of this rule cannot replay from a CUDA graph (None: it can; see
        :mod:`galore2.core.capture`): 8-bit moments quantize through host-side paths, and
        ``compile=True`` compiles inside the step."""
        problem = super().capture_problem(group)
        if problem is not None:
            return problem
        if group.get("compile"):
            return "compile=True compiles inside the step: capture without it"
        return None

    def masked_keys(self, group: Group) -> tuple[str, ...]:
        """Both moments, when they are float32 or float64 tensors and the step is eager
        (no ``compile``): a masked direction's lerp weight is 0 and its second moment's
        decay 1, so they keep their bits (a zero gradient adds 0). Not for bfloat16 moments
        (a lerp by a tensor weight rounds apart from one by a Python float there: the
        snapshot keeps those bitwise equal to the host path) nor 8-bit ones."""
        if self.moments != "state_dtype" or group.get("compile"):
            return ()
        if group["state_dtype"] not in ("float32", "float64"):
            return ()
        return (*self.linear_keys, *self.quadratic_keys)

    def _masks(self, ctxs: list[Context | None], group: Group) -> list[Tensor | None]:
        """Each direction's flag when this rule masks its moments itself (:meth:`masked_keys`),
        else None (the snapshot puts them back, and the arithmetic stays the host path's)."""
        masks = [None if c is None else c.mask for c in ctxs]
        # a masked step sets every direction's flag (none is set on other steps)
        if masks and masks[0] is not None and self.masked_keys(group):
            return masks
        return [None] * len(ctxs)

    def stacks(self, group: Group, device: torch.device) -> bool:
        """Stacked entries where :meth:`update_many` runs its foreach kernels (Adam is
        elementwise; a stack's members may count different steps): not with ``compile=True``
        or on the CPU without ``foreach``. 8-bit moments of small directions are plain
        tensors and stack; quantized ones do not (the stacking checks the tensors)."""
        return not group.get("compile") and (device.type != "cpu" or bool(group.get("foreach")))

    def complex_problem(self, group: Group) -> str | None:
        """Adam is elementwise: on a complex parameter's real view it is
        ``torch.optim.AdamW``'s complex Adam (which uses that view too)."""
        if self.moments != "state_dtype":
            return "8-bit moments are not defined for complex parameters"
        return None

    def update(self, u: Tensor, state: State, group: Group, ctx: Context) -> Tensor:
        """Update both moments with ``u`` and return ``m̂ / (√v̂ + eps)``."""
        if is_quantized(state, "adam.exp_avg"):
            return self._update_quantized(u, state, group)
        t = self.count_step(state, group, u.device)
        if group.get("compile"):
            return self._compiled_step(u, t, state, group)
        return self._arith(
            u, state["adam.exp_avg"], state["adam.exp_avg_sq"], t, group,
            mask=self._masks([ctx], group)[0],
        )  # fmt: skip

    def _update_quantized(self, u: Tensor, state: State, group: Group) -> Tensor:
        """:meth:`update` of a direction with 8-bit moments: the fused kernel, else the torch
        path (chunk by chunk on the CPU, else on fp32 copies of the moments). The step is
        counted once the kernel ran, or was not taken."""
        m_fmt = stored_format(state, "adam.exp_avg", True)
        v_fmt = stored_format(state, "adam.exp_avg_sq", False)
        assert isinstance(m_fmt, Dynamic8Format) and isinstance(v_fmt, Dynamic8Format)
        m_codes, m_absmax, dim = m_fmt.local(state, "adam.exp_avg", AXIS)
        v_codes, v_absmax, _ = v_fmt.local(state, "adam.exp_avg_sq", AXIS)
        out = run_kernel(
            "adam8bit",
            u,
            m_codes,
            v_codes,
            # the fused kernel takes the step as a host int: not for a capturable step
            supported=lambda k: not group.get("capturable") and k.supported(u),
            kernel=lambda k: partial(
                k.adam8bit_step,
                u,
                m_codes,
                m_absmax,
                v_codes,
                v_absmax,
                **self._fused_args(m_fmt, v_fmt, dim, m_codes.device, state, group),
            ),
        )
        t = self.count_step(state, group, u.device)
        if out is not None:  # the kernel updated codes and absmax in place
            return out
        return self.torch_quantized(u, m_fmt, v_fmt, t, state, group)

    @staticmethod
    def torch_quantized(
        u: Tensor,
        m_fmt: Dynamic8Format,
        v_fmt: Dynamic8Format,
        t: int | Tensor,
        state: State,
        group: Group,
    ) -> Tensor:
        """Step ``t`` (counted already) of a direction with 8-bit moments on the torch path
        (no fused kernel): chunk by chunk on the CPU (:meth:`_update_chunks`), else on fp32
        copies of the moments (bitsandbytes' quantizer)."""
        if dynamic8.use_torch(m_fmt.local(state, "adam.exp_avg", AXIS)[0]):
            return ScaleByAdam._update_chunks(u, m_fmt, v_fmt, t, state, group)
        m = m_fmt.view(state, "adam.exp_avg", AXIS)
        v = v_fmt.view(state, "adam.exp_avg_sq", AXIS)
        out = ScaleByAdam._arith(u, m, v, t, group)  # the direction uses the fp32 moments
        m_fmt.store(state, "adam.exp_avg", m, AXIS)
        v_fmt.store(state, "adam.exp_avg_sq", v, AXIS)
        return out

    @staticmethod
    def _fused_args(
        m_fmt: Dynamic8Format,
        v_fmt: Dynamic8Format,
        dim: int,
        device: torch.device,
        state: State,
        group: Group,
    ) -> dict[str, Any]:
        """The keyword arguments of the fused 8-bit step (galore2.kernels.adam8bit): the same
        arithmetic, codes and absmax updated in place, the fp32 direction returned. Its
        ``step`` is the count this step reaches: the caller counts it once the kernel ran
        or was not taken (see ``dispatch.run_kernel``)."""
        beta1, beta2 = group["betas"]
        return {
            "dim": dim,
            "code_m": m_fmt.code(device),
            "code_v": v_fmt.code(device),
            "bounds_m": m_fmt.bounds(device),
            "bounds_v": v_fmt.bounds(device),
            "beta1": beta1,
            "beta2": beta2,
            "eps": group["eps"],
            "step": int(state["adam.step"]) + 1,
        }

    @staticmethod
    def _update_chunks(
        u: Tensor,
        m_fmt: Dynamic8Format,
        v_fmt: Dynamic8Format,
        t: int | Tensor,
        state: State,
        group: Group,
    ) -> Tensor:
        """The 8-bit torch path of step ``t`` on the CPU (where the storage layer quantizes
        in torch), in chunks of ~2^20 elements of whole blocks
        (:func:`~galore2.storage.dynamic8.row_chunks`): each chunk's moments are
        dequantized, stepped and requantized while in cache and its direction written into
        the fp32 result — the same elementwise arithmetic as :meth:`_arith` on whole fp32
        moments, with no full-size fp32 copy of either moment."""
        m_codes, m_absmax, dim = m_fmt.local(state, "adam.exp_avg", AXIS)
        v_codes, v_absmax, _ = v_fmt.local(state, "adam.exp_avg_sq", AXIS)
        rows = m_codes.shape[0]
        qm, qv, u2 = m_codes.view(rows, -1), v_codes.view(rows, -1), u.reshape(rows, -1)
        out = torch.empty(u2.shape, dtype=torch.float32, device=u.device)
        for r, b in dynamic8.row_chunks(rows, qm.shape[1], dim):
            m = dynamic8.dequantize(qm[r], m_absmax[b], dim, m_fmt.signed)
            v = dynamic8.dequantize(qv[r], v_absmax[b], dim, v_fmt.signed)
            ScaleByAdam._arith(u2[r], m, v, t, group, out=out[r])
            dynamic8.quantize_(m, qm[r], m_absmax[b], dim, m_fmt.signed)
            dynamic8.quantize_(v, qv[r], v_absmax[b], dim, v_fmt.signed)
        return out.view(u.shape)

    @staticmethod
    def _arith(
        u: Tensor,
        exp_avg: Tensor,
        exp_avg_sq: Tensor,
        t: int | Tensor,
        group: Group,
        out: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> Tensor:
        """Step ``t`` of Adam's arithmetic on the moments (updated in place; where ``mask``
        is 0, left as they are); the direction goes to ``out`` when given. ``t``: a host
        int, or a device counter (capturable)."""
        if u.dtype != exp_avg.dtype:
            u = u.to(exp_avg.dtype)
        beta1, beta2 = group["betas"]
        if mask is None:
            exp_avg.lerp_(u, 1 - beta1)
            exp_avg_sq.mul_(beta2)
        else:
            (w,), (d,) = _masked_weights([mask], exp_avg.dtype, beta1, beta2)
            exp_avg.lerp_(u, w)
            exp_avg_sq.mul_(d)
        exp_avg_sq.addcmul_(u, u, value=1 - beta2)
        if isinstance(t, Tensor):  # float64 device scalars, the same values (see _corrections)
            scale, shift = _corrections(beta1, beta2, group["eps"], t)
        else:
            bias_correction1 = 1 - beta1**t
            bias_correction2_sqrt = math.sqrt(1 - beta2**t)
            scale, shift = bias_correction1 / bias_correction2_sqrt, bias_correction1 * group["eps"]
        # m̂/(√v̂ + eps) = m / (bc1·√v/√bc2 + bc1·eps): both corrections folded into one
        # denominator, computed in a single buffer that then receives the result.
        denom = torch.sqrt(exp_avg_sq, out=out).mul_(scale)
        denom.add_(shift)
        return torch.div(exp_avg, denom, out=denom)

    @staticmethod
    def _compiled_step(u: Tensor, t: int | Tensor, state: State, group: Group) -> Tensor:
        """Step ``t`` of :meth:`_arith`'s math through the compiled :func:`adam_math`
        (``compile=True``)."""
        exp_avg, exp_avg_sq = state["adam.exp_avg"], state["adam.exp_avg_sq"]
        if u.dtype != exp_avg.dtype:
            u = u.to(exp_avg.dtype)
        beta1, beta2 = group["betas"]
        scale, shift = _corrections(beta1, beta2, group["eps"], t)
        return run_compiled(adam_math, u, exp_avg, exp_avg_sq, 1 - beta1, beta2, 1 - beta2,
                            scale, shift)  # fmt: skip

    def update_many(
        self, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context]
    ) -> list[Tensor]:
        """The same arithmetic as :meth:`update`, one ``torch._foreach_*`` kernel per op
        (8-bit moments: :meth:`update` per tensor). On the CPU the kernels run only when the
        group asks for them (``foreach=True``)."""
        if not us or (us[0].device.type == "cpu" and not group.get("foreach")):
            # torch's CPU foreach kernels are a slower per-tensor loop (measured: a step of
            # torch.optim.AdamW(foreach=True) takes ~1.5x its for-loop on 2 cores).
            return [self.update(u, s, group, c) for u, s, c in zip(us, states, ctxs, strict=True)]
        plain = [i for i, s in enumerate(states) if not is_quantized(s, "adam.exp_avg")]
        out: list[Tensor | None] = [None] * len(us)
        if plain:
            if group.get("compile"):
                results = self._compiled_foreach(
                    [us[i] for i in plain], [states[i] for i in plain], group
                )
            else:
                results = self._foreach(
                    [us[i] for i in plain], [states[i] for i in plain], group,
                    self._masks([ctxs[i] for i in plain], group),
                    _rounding([ctxs[i] for i in plain]),
                )  # fmt: skip
            for i, r in zip(plain, results, strict=True):
                out[i] = r
        return self.update_rest(out, us, states, group, ctxs)

    def _batch(
        self, us: list[Tensor], states: list[State], group: Group, cast: bool = True
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[float], list[float], int | None]:
        """What both batched paths start from: the moments, the directions in their dtype
        (``cast=False``: as given),
        and each tensor's (scale, shift) after counting its step (steps may differ per
        tensor: reset, parameters added later); last, the step of the whole batch when it
        is one host count (the usual step), else None."""
        beta1, beta2 = group["betas"]
        exp_avgs = [s["adam.exp_avg"] for s in states]
        exp_avg_sqs = [s["adam.exp_avg_sq"] for s in states]
        if cast:
            us = [u if u.dtype == m.dtype else u.to(m.dtype)
                  for u, m in zip(us, exp_avgs, strict=True)]  # fmt: skip
        # a stacked entry's step counters are its members' (see StackedState)
        counted, starts = members(states)
        device = exp_avgs[0].device
        steps = self.count_steps(counted, group, device)
        if isinstance(steps, Tensor):  # device counters (capturable): corrections at once
            # both β's powers by one pow (float64: the int64 counts are promoted), then
            # (1 − β₁ᵗ)/√(1 − β₂ᵗ) and (1 − β₁ᵗ)·eps: five kernels for the whole batch
            betas = _numerics.constants((beta1, beta2), torch.float64, device).view(2, 1)
            bc = torch.rsub(torch.pow(betas, steps), 1)
            both = torch.empty_like(bc)
            torch.div(bc[0], bc[1].sqrt(), out=both[0])
            torch.mul(bc[0], group["eps"], out=both[1])
            dtype = exp_avgs[0].dtype
            if dtype in (torch.float32, torch.float64):
                # in the moments' dtype, where the host path's Python floats act (its
                # rounding of the float64 values): the same bits, and a foreach multiply by
                # float32 0-d tensors is ~2.5x faster on the CPU than by float64 ones
                both = both.to(dtype)
            scale, shift = both[0], both[1]
            if len(counted) == len(states):  # no stacked entry
                return exp_avgs, exp_avg_sqs, us, list(scale.unbind()), list(shift.unbind()), None
            return exp_avgs, exp_avg_sqs, us, *_per_entry(scale, shift, starts, us), None
        first = steps[0]
        if steps.count(first) == len(steps):  # the usual step: one count for the whole batch
            scale, shift = _corrections(beta1, beta2, group["eps"], first)
            k = len(states)
            return exp_avgs, exp_avg_sqs, us, [scale] * k, [shift] * k, first
        known: dict[int, tuple[float, float]] = {}
        scales, shifts = [], []
        for t in steps:
            found = known.get(t)
            if found is None:
                found = known[t] = _corrections(beta1, beta2, group["eps"], t)
            scales.append(found[0])
            shifts.append(found[1])
        if len(counted) == len(states):
            return exp_avgs, exp_avg_sqs, us, scales, shifts, None
        return exp_avgs, exp_avg_sqs, us, *_per_entry(
            torch.tensor(scales, dtype=torch.float64, device=device),
            torch.tensor(shifts, dtype=torch.float64, device=device), starts, us,
        ), None  # fmt: skip

    def _foreach(
        self, us: list[Tensor], states: list[State], group: Group, masks: list[Tensor | None],
        rounds: torch.dtype | None = None,
    ) -> list[Tensor]:  # fmt: skip
        """:meth:`_arith` by foreach kernels (``masks``: each direction's flag of a masked
        step, or None). ``rounds``: the dtype every direction is rounded to by its consumer
        (:func:`_rounding`): where :func:`_rounded_path` allows, the directions come in it
        from galore2's op (:func:`galore2.kernels.ops.adam_directions_`)."""
        beta1, beta2 = group["betas"]
        unmasked = not masks or masks[0] is None
        given = us
        rounded = unmasked and _rounded_path(us, states, rounds)
        exp_avgs, exp_avg_sqs, us, scale, shift, t = self._batch(us, states, group, not rounded)
        if rounded and t is not None:
            outs = [torch.empty_like(u, dtype=torch.bfloat16) for u in given]
            for args in zip(given, exp_avgs, exp_avg_sqs, outs, strict=True):
                ops.adam_directions_(*([a] for a in args), t, beta1, beta2, group["eps"])
            return outs
        if rounded:  # steps differ: the directions in the moments' dtype after all
            us = [u if u.dtype == m.dtype else u.to(m.dtype)
                  for u, m in zip(us, exp_avgs, strict=True)]  # fmt: skip
        if unmasked and t is not None and _fusable(exp_avgs, exp_avg_sqs, us):
            return _fused_directions(us, exp_avgs, exp_avg_sqs, t, group)
        if not unmasked:  # a masked step: every direction has its flag
            ws, ds = _masked_weights(masks, exp_avgs[0].dtype, beta1, beta2)  # type: ignore[arg-type]
            torch._foreach_lerp_(exp_avgs, us, ws)
            torch._foreach_mul_(exp_avg_sqs, ds)
        else:
            torch._foreach_lerp_(exp_avgs, us, 1 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, us, us, value=1 - beta2)
        denoms = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_mul_(denoms, scale)  # floats, or tensors that broadcast (stacks)
        torch._foreach_add_(denoms, shift)
        return list(torch._foreach_div(exp_avgs, denoms))

    def _compiled_foreach(
        self, us: list[Tensor], states: list[State], group: Group
    ) -> list[Tensor]:
        """:meth:`_foreach`'s math through the compiled :func:`adam_math_many` (one graph)."""
        beta1, beta2 = group["betas"]
        exp_avgs, exp_avg_sqs, us, scales, shifts, _ = self._batch(us, states, group)
        return run_compiled(adam_math_many, us, exp_avgs, exp_avg_sqs, 1 - beta1, beta2,
                            1 - beta2, scales, shifts)  # fmt: skip

    def bias_correction(self, state: State, group: Group) -> float | Tensor:
        """√(1 − β₂ᵗ) / (1 − β₁ᵗ) after ``t`` steps (1 before the first); a float64 tensor on
        the counter's device for a device counter (``capturable=True``: no host read)."""
        beta1, beta2 = group["betas"]
        step = state["adam.step"]
        if group.get("capturable"):
            td = step.to(torch.float64)
            value = (1 - torch.pow(beta2, td)).sqrt() / (1 - torch.pow(beta1, td))
            return torch.where(td > 0, value, torch.ones_like(value))
        t = int(step)
        return math.sqrt(1 - beta2**t) / (1 - beta1**t) if t > 0 else 1.0

    def bias_corrections(self, states: list[State], group: Group) -> list[float | Tensor]:
        """:meth:`bias_correction` of each of ``states`` (host counters: one read when packed)."""
        if group.get("capturable"):
            return [self.bias_correction(s, group) for s in states]
        packed = self._counters.packed(states, "adam.step")
        steps = packed.tolist() if packed is not None else [int(s["adam.step"]) for s in states]
        beta1, beta2 = group["betas"]
        known: dict[int, float] = {}
        for t in steps:
            if t not in known:
                known[t] = math.sqrt(1 - beta2**t) / (1 - beta1**t) if t > 0 else 1.0
        return [known[t] for t in steps]
