"""Adafactor's factored second moment as a transform (``ScaleByAdafactor``).

Acts on: whatever direction it is given — the full gradient in a plain group, the
projected r×n (or m×r) gradient inside GaLore.

State per direction of shape (…, m, n), in ``state_dtype``:

* ≥2-D (factored over the last two dims): a row vector (…, m, 1) and a column vector
  (…, 1, n) — m + n values per trailing matrix, so an r×n low-rank direction keeps r + n;
* ≤1-D (unfactored): one value per element;
* ``beta1`` set: one more value per element (the momentum ``exp_avg``);
* ``moments="dynamic8"`` (GaLoreAdafactor's ``moments_8bit``): those of the tensors above
  that the small-tensor rule allows (≥ 4096 elements, ≥2-D, a blocked axis longer than 1:
  the momentum of a large direction, a long factor of a batched direction) are stored
  8-bit blockwise, ~1 byte per element, updated in fp32 (:mod:`galore2.storage.moments`);
* three int64 scalars: ``adafactor.step`` (t, drives ρ_t),
  ``adafactor.moment_step`` (k, the age of the second-moment estimate, drives β̂₂; equal
  to t unless the estimate was restarted, see reset/rotate below) and
  ``adafactor.split_dim`` (which dim of the direction FSDP splits, from the state layout:
  row/column means over a split dim and RMS(U) are all-reduced over the shard group).
  All three on the CPU, except with ``capturable=True``: then t and k are on the
  direction's device and ρ_t and β̂₂ are computed there by device ops (no host read: the
  step can replay from a CUDA graph, see :mod:`galore2.core.capture`).

The arithmetic follows ``torch.optim.Adafactor`` (its single-tensor path), so a plain
group matches it to rounding. Per step, with G the direction (−G under ``maximize``)::

    β̂₂ = 1 − k^beta2_decay;   ρ_t = min(lr, 1/√t);   α_t = max(eps2, RMS(θ))·ρ_t
    (relative_step=False: ρ_t = lr;  scale_parameter=False: α_t = ρ_t)
    factored:   R ← β̂₂R + (1−β̂₂)·mean_n(G²),  C ← β̂₂C + (1−β̂₂)·mean_m(G²)
                V̂ = R·C / max(mean_m(R), eps1)
    unfactored: V̂ ← β̂₂V̂ + (1−β̂₂)·G²
    U = G / √max(V̂, eps1²);   Û = U / max(1, RMS(U)/d)

``eps1 = None`` means the machine epsilon of the *parameter's* dtype (torch's rule).
RMS(θ) is taken over the whole parameter before this step's weight decay (under FSDP:
a sum of squares all-reduced over the shard group), RMS(U) over the whole direction.
Torch applies ``θ ← θ(1 − lr·λ) − α_t·Û``; the optimizer applies ``θ ← θ(1 − lr·λ) − lr·u``,
so the returned direction is ``u = Û·α_t/lr``, computed as ``Û·max(eps2, RMS(θ))``
times ``(1/√t)/lr`` only when 1/√t < lr — never a division by lr, and lr = 0 leaves the
weights unchanged (torch: α_t = 0).

``relative_step`` and ``scale_parameter`` (default True, torch's rule; both switches of
galore-torch's / Hugging Face's Adafactor, with the same meaning): False drops the 1/√t
cap on the step size, respectively the RMS(θ) factor, so the step size is ``lr`` itself —
galore-torch's GaLoreAdafactor(relative_step=False, scale_parameter=False, lr=…), the
usual GaLore pre-training setting, under a schedule of your choice. With both True and
small initial weights (RMS(θ) ≈ 0.02) the effective step is ~50× below ``lr``.

``beta1`` (optional, default None as in galore-torch; torch.optim.Adafactor has none):
``exp_avg ← lerp(exp_avg, u, 1 − beta1)`` and the returned direction is ``exp_avg`` —
a momentum of the directions, applied with the current lr (torch's SGD convention;
galore-torch keeps the momentum of α_t·Û instead: the same thing while lr is constant).

Inside GaLore: ``reset`` (``moments_on_refresh="reset"``) zeroes the estimates and the
momentum and restarts k (the next step's β̂₂ = 0 rebuilds V̂ from that step's gradient
alone, as at step 1); t — the ρ_t schedule, a learning-rate schedule rather than a
statistic — keeps counting. ``rotate`` (``"project"``) rotates the momentum like Adam's
first moment and restarts the second-moment estimate as ``reset`` does: a factored
estimate cannot be rotated coordinate-wise, and rebuilding it needs to know which side
the basis acts on, which the rotate protocol does not pass.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from .._numerics import constants
from ..core.counters import Counters
from ..core.options import Bool, Option, Optional, Pair, Real
from ..core.state import counter, counter_on
from ..core.transform import Context, Group, State, Transform
from ..storage.dtype import STATE_DTYPE, warn_float16
from ..storage.moments import (
    check_moments,
    is_quantized,
    moment_format,
    moment_kinds,
    moments_capture_problem,
    reset_moments,
    stored_format,
)

BETA2_DECAY = Option(
    "beta2_decay", -0.8, Real(high=0.0), "the second-moment decay: β̂₂ = 1 − t^beta2_decay"
)
EPS = Option(
    "eps",
    (None, 1e-3),
    Pair(
        Optional(Real(low=0.0, low_open=True), "the parameter dtype's machine epsilon"),
        Real(low=0.0),
    ),
    "(eps1, eps2): the floor of the second moment and of RMS(θ) (Adafactor's pair, not Adam's)",
)
D = Option("d", 1.0, Real(low=1.0), "the update clipping threshold: Û = U / max(1, RMS(U)/d)")
BETA1 = Option(
    "beta1",
    None,
    Optional(Real(low=0.0, high=1.0, high_open=True), "no momentum"),
    "optional momentum of the updates",
)
RELATIVE_STEP = Option(
    "relative_step", True, Bool(), "cap the step size at 1/√t (False: the step size is lr)"
)
SCALE_PARAMETER = Option(
    "scale_parameter", True, Bool(), "multiply the step size by max(eps2, RMS(θ))"
)
OPTIONS = (BETA2_DECAY, EPS, D, BETA1, RELATIVE_STEP, SCALE_PARAMETER, STATE_DTYPE)


_CPU = torch.device("cpu")
_COUNTS = ("adafactor.step", "adafactor.moment_step")
_MOMENTS = ("adafactor.row_var", "adafactor.col_var", "adafactor.variance", "adafactor.exp_avg")


@functools.cache
def _machine_eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def _moment(state: State) -> str:
    """The key of a direction's second moment (its dtype is the update's)."""
    return "adafactor.row_var" if "adafactor.row_var" in state else "adafactor.variance"


# The direction's dim that a sharded parameter splits across ranks, per state layout
# (galore2.placement): "param"/"rows" split dim 0, "cols" dim 1, "replicate" none.
_SPLIT_DIM = {"param": 0, "rows": 0, "cols": 1, "replicate": -1}


def _sharded_dim(ctx: Context, state: State) -> int | None:
    """The direction's dim split across ranks in this run, None if it is whole here.

    Read from ``adafactor.split_dim``, recorded at init from ``ctx.layout`` (update's context
    carries the same layout — GaLore hands its inner rules the direction's, ``inner_view`` —
    but checkpoints of earlier releases rely on the key, and it is a host counter: no
    string lookup per step).
    """
    if not ctx.placement.distributed:
        return None
    dim = int(state["adafactor.split_dim"])
    return None if dim < 0 else dim


def _global_size(u: Tensor, dim: int, sharded: int | None, ctx: Context) -> int:
    """Size of ``u``'s dim ``dim`` over all ranks (the layouts of galore2.placement)."""
    if dim != sharded:
        return u.size(dim)
    shape = ctx.global_shape
    return int(shape[0]) if sharded == 0 else math.prod(int(s) for s in shape[1:])


def _all_reduce(ctx: Context, parts: list[Tensor]) -> list[Tensor]:
    """Σ over ranks of several tensors in one collective (float64, returned as given)."""
    flat = torch.cat([p.reshape(-1).double() for p in parts])
    flat = ctx.placement.reduce(flat)
    out, start = [], 0
    for p in parts:
        out.append(flat[start : start + p.numel()].view(p.shape).to(p.dtype))
        start += p.numel()
    return out


_COL_BLOCK = 1 << 22  # elements squared at a time by _col_sq (16 MB of fp32)


def _col_sq(u: Tensor) -> Tensor:
    """Σᵢ u²ᵢⱼ over dim −2 (keepdim), in row blocks of ≤ ``_COL_BLOCK`` elements.

    ``torch.norm(u, dim=-2)`` (torch.optim.Adafactor's op) is a strided reduction, several
    times slower on the CPU than squaring contiguous row blocks and summing them (see
    ``python -m benchmarks.run --tasks adafactor_step``); the blocks bound the temporary.
    """
    m = u.size(-2)
    rows = max(1, _COL_BLOCK // max(1, u[..., :1, :].numel()))
    if rows >= m:
        return u.square().sum(dim=-2, keepdim=True)
    out = u[..., :rows, :].square().sum(dim=-2, keepdim=True)
    for start in range(rows, m, rows):
        out.add_(u[..., start : start + rows, :].square().sum(dim=-2, keepdim=True))
    return out


def _device_counts(
    states: list[State], group: Group, dtype: torch.dtype
) -> tuple[Tensor | None, list[Tensor]]:
    """Count a step in the device counters of ``states`` (``capturable=True``) and return,
    by device ops (no host read), ρ_t/lr per tensor as a 1-D float64 tensor — min(1, (1/√t)/lr):
    the host path's factor, 1 where ρ_t = lr; None without ``relative_step`` or with lr = 0
    (ρ_t = lr) — and each tensor's lerp weight 1 − β̂₂ = k^beta2_decay, 0-d in ``dtype``
    (the host's double arithmetic, then rounded as a Python weight is)."""
    device = states[0][_moment(states[0])].device
    for s in states:
        for key in _COUNTS:
            s[key] = counter_on(s[key], device)
    counters = [s[key] for key in _COUNTS for s in states]
    torch._foreach_add_(counters, 1)
    t, k = torch.stack(counters).to(torch.float64).view(2, len(states)).unbind()
    weights = torch.pow(k, group["beta2_decay"]).to(dtype)
    lr = float(group["lr"])
    factor = None
    if RELATIVE_STEP.of(group) and lr > 0:
        factor = t.sqrt_().reciprocal_().div_(lr).clamp_(max=1.0)
    return factor, list(weights.unbind())


class ScaleByAdafactor(Transform):
    """Adafactor (torch.optim.Adafactor's conventions); see the module docstring.

    Group keys: ``lr``, ``beta2_decay`` (≤ 0), ``eps`` = (eps1 > 0 or None, eps2 ≥ 0),
    ``d`` (≥ 1), ``beta1`` (None or in [0, 1)), ``relative_step`` and
    ``scale_parameter`` (bools), ``state_dtype``.
    """

    name = "adafactor"
    options = OPTIONS
    kinds: ClassVar[dict[str, str]] = {
        **moment_kinds(
            "adafactor.row_var", "adafactor.col_var", "adafactor.variance", "adafactor.exp_avg"
        ),
        "adafactor.step": "other",
        "adafactor.moment_step": "other",
        "adafactor.split_dim": "other",
    }
    linear_keys = ("adafactor.exp_avg",)
    second_keys = ("adafactor.row_var", "adafactor.col_var", "adafactor.variance")
    #: kept on the direction's device with ``capturable=True`` (see :func:`_device_counts`)
    device_counters = _COUNTS

    def __init__(self, *, moments: str = "state_dtype") -> None:
        """``moments``: moment storage, ``"state_dtype"`` or ``"dynamic8"`` (8-bit blockwise)."""
        self.moments = check_moments(moments)
        self._counters = Counters()  # host step counters packed per batch

    def capture_problem(self, group: Group) -> str | None:
        """Why a step of this rule cannot replay from a CUDA graph (None: it can; see
        :mod:`galore2.core.capture`): 8-bit moments quantize through host-side paths."""
        return moments_capture_problem(self.moments, "Adafactor")

    def __repr__(self) -> str:
        return f"ScaleByAdafactor(moments={self.moments!r})"

    def complex_problem(self, group: Group) -> str | None:
        """Always refused: the factored second moment is not defined for complex parameters."""
        return "Adafactor's factored second moment is not defined for complex parameters"

    # ---- state -------------------------------------------------------------------
    def init(
        self, shape: torch.Size, ref: Tensor, group: Group, state: State, ctx: Context
    ) -> None:
        """Create the second moment (row and column factors for ≥2-D directions, else a full
        variance), the momentum when ``beta1`` is set, and the counters.
        """

        def zeros(s: tuple[int, ...], dtype: torch.dtype, layout: str) -> Tensor:
            return ctx.placement.zeros(s, dtype, ctx.param.device, layout)

        def allocate(key: str, s: tuple[int, ...], layout: str, signed: bool) -> None:
            fmt = moment_format(self.moments, s, layout, group["state_dtype"], signed)
            fmt.allocate(state, key, s, layout, zeros)

        warn_float16(group, ctx.warn_once)
        shape = tuple(shape)  # type: ignore[assignment]
        k = len(shape)
        if k >= 2:
            split = _SPLIT_DIM[ctx.layout]
            # A factor whose reduced dim is the split one is a sum over ranks: replicated.
            row_layout = "replicate" if split == k - 1 else ctx.layout
            col_layout = "replicate" if split == k - 2 else ctx.layout
            allocate("adafactor.row_var", (*shape[:-1], 1), row_layout, False)
            allocate("adafactor.col_var", (*shape[:-2], 1, shape[-1]), col_layout, False)
        else:
            allocate("adafactor.variance", tuple(shape), ctx.layout, False)
        if BETA1.of(group) is not None:
            allocate("adafactor.exp_avg", tuple(shape), ctx.layout, True)
        # capturable: both step counters on the direction's device (see _device_counts)
        device = ctx.param.device if group.get("capturable") else _CPU
        state["adafactor.step"] = counter_on(counter(), device)
        state["adafactor.split_dim"] = counter(_SPLIT_DIM[ctx.layout])
        state["adafactor.moment_step"] = counter_on(counter(), device)

    # ---- update ------------------------------------------------------------------
    def update(self, u: Tensor, state: State, group: Group, ctx: Context) -> Tensor:
        """Update the moments with ``u`` and return Adafactor's update direction."""
        # each moment as a tensor to update in place: the stored one, or an fp32 copy of
        # 8-bit codes that is quantized back below
        formats = {
            key: stored_format(state, key, key == "adafactor.exp_avg")
            for key in (*self.second_keys, "adafactor.exp_avg")
            if key in state
        }
        views = {key: fmt.view(state, key) for key, fmt in formats.items()}
        if any(is_quantized(state, key) for key in views):
            # 8-bit and state_dtype moments side by side (a small factor next to an 8-bit
            # momentum): all of them in fp32, the float ones rounded back by store()
            views = {key: v.float() for key, v in views.items()}
        out = self._step(u, views, state, group, ctx)
        for key, fmt in formats.items():
            fmt.store(state, key, views[key])
        return out

    def update_many(
        self, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context]
    ) -> list[Tensor]:
        """Batched :meth:`update`: directions of the same shape, dtypes, device and step
        counts are stacked, so each statistic runs once per such bucket (the row and column
        means, V̂ = R·C as one ``bmm``, RMS(U)) and the rest once for all of them (the moment
        updates by foreach kernels, the clipping and step-size scalars); no host read.
        Sharded directions and 8-bit moments step one by one (:meth:`update`)."""
        out: list[Tensor | None] = [None] * len(us)
        batched = []
        for i, (u, state, ctx) in enumerate(zip(us, states, ctxs, strict=True)):
            if self._batchable(state, group, ctx):
                batched.append(i)
            else:
                out[i] = self.update(u, state, group, ctx)
        buckets: dict[tuple[Any, ...], list[int]] = {}
        if batched:
            eps1 = group["eps"][0]
            sts = [states[i] for i in batched]
            if group.get("capturable"):  # device counters, advanced in _step_many
                counts = [()] * len(batched)
            else:  # host counters: advanced now, one add and one read per key when packed
                counts = list(zip(*(self._advance(sts, key) for key in _COUNTS), strict=True))
            for i, steps in zip(batched, counts, strict=True):
                key = self._bucket(us[i], states[i], ctxs[i], steps, eps1)
                buckets.setdefault(key, []).append(i)
        if buckets:
            idxs = list(buckets.values())
            done = self._step_many(
                [[us[i] for i in idx] for idx in idxs],
                [[states[i] for i in idx] for idx in idxs],
                [[ctxs[i] for i in idx] for idx in idxs],
                [key[-1] for key in buckets],
                group,
                None if group.get("capturable") else [key[-3:-1] for key in buckets],
            )
            for idx, results in zip(idxs, done, strict=True):
                for i, r in zip(idx, results, strict=True):
                    out[i] = r
        return out  # type: ignore[return-value]

    def _advance(self, states: list[State], key: str) -> list[int]:
        """Count a step in the host counters ``key`` of ``states``; their new values."""
        if self._counters.packed(states, key) is None:
            for s in states:  # a capturable state, now not: its device counters come back
                s[key] = counter_on(s[key], _CPU)
        return self._counters.advance(states, key)

    @staticmethod
    def _batchable(state: State, group: Group, ctx: Context) -> bool:
        """Whether a direction steps on the batched path (else :meth:`update` alone)."""
        if ctx.placement.distributed or any(k + ".absmax" in state for k in _MOMENTS):
            return False
        # without its momentum buffer, update raises the error that names it
        return BETA1.of(group) is None or "adafactor.exp_avg" in state

    @staticmethod
    def _bucket(
        u: Tensor, state: State, ctx: Context, steps: tuple[int, int], eps1: float | None
    ) -> tuple[Any, ...]:
        """The stack a batchable direction joins (its host step counts given, or none: device
        counters); its last entry is eps1, the two before it the step counts."""
        if eps1 is None:
            eps1 = _machine_eps(ctx.param.dtype)
        factored = "adafactor.row_var" in state
        moment = state["adafactor.row_var" if factored else "adafactor.variance"]
        return (factored, tuple(u.shape), u.dtype, moment.dtype, u.device, *steps, eps1)

    @staticmethod
    def _step_many(
        us: list[list[Tensor]],
        states: list[list[State]],
        ctxs: list[list[Context]],
        eps1s: list[float],
        group: Group,
        counts: list[tuple[int, int]] | None,
    ) -> list[list[Tensor]]:
        """:meth:`_step` of each bucket (same shape, dtypes, device, steps, eps1), stacked.

        The directions are concatenated once, flat, bucket after bucket; their squares, the
        clamp, ``rsqrt`` and the product with U run once over that, and each bucket's V̂
        lands in its slice of one flat buffer (``bmm`` of the stacked factors, or the stack
        of its unfactored variances). Per bucket: the row and column means, the stacks of R
        and C, V̂ = R·C / mean(R) and the scaling; per tensor nothing.

        ``counts``: each bucket's (t, k), the host counters already advanced; None: device
        counters (``capturable=True``), advanced here, ρ_t and β̂₂ per tensor by device ops."""
        if len({sts[0][_moment(sts[0])].dtype for sts in states}) > 1:  # one dtype per flat
            return [ScaleByAdafactor._step_many([b], [sts], [cs], [e], group,
                                                None if counts is None else [c])[0]
                    for b, sts, cs, e, c in zip(us, states, ctxs, eps1s,
                                                counts or [None] * len(us), strict=True)]  # fmt: skip
        lr, eps2 = float(group["lr"]), group["eps"][1]
        beta1 = BETA1.of(group)
        every = [s for sts in states for s in sts]
        dtype = states[0][0][_moment(states[0][0])].dtype
        device_counts = None if counts is not None else _device_counts(every, group, dtype)
        U = torch.cat([u.reshape(-1) for bucket in us for u in bucket])
        U = U if U.dtype == dtype else U.to(dtype)
        square = U * U
        var_flat = torch.empty_like(U)
        factors: list[float] = []
        # the moment updates: one foreach lerp per distinct weight (equal moment steps share it)
        lerps: dict[float, tuple[list[Tensor], list[Tensor]]] = {}
        slices: list[tuple[Tensor, Tensor, Tensor]] = []  # each bucket's U, U², V̂ (stacked)
        # device counters: one foreach lerp, each tensor's own weight (a 0-d device tensor)
        device_lerps: tuple[list[Tensor], list[Tensor], list[Tensor]] = ([], [], [])
        start = done = 0
        for bucket, sts in zip(us, states, strict=True):
            shape = (len(bucket), *bucket[0].shape)
            end = start + math.prod(shape)
            slices.append(tuple(t[start:end].view(shape) for t in (U, square, var_flat)))
            start = end
            sq = slices[-1][1]
            if "adafactor.row_var" in sts[0]:  # (g·g).mean(dim)
                pairs = (
                    ("adafactor.row_var", sq.mean(dim=-1, keepdim=True)),
                    ("adafactor.col_var", sq.mean(dim=-2, keepdim=True)),
                )
            else:
                pairs = (("adafactor.variance", sq),)
            if device_counts is not None:
                for key, new in pairs:
                    device_lerps[0].extend(s[key] for s in sts)
                    device_lerps[1].extend(new.unbind())
                    device_lerps[2].extend(device_counts[1][done : done + len(sts)])
                done += len(sts)
                continue
            t, k = counts[len(slices) - 1]
            rho = lr
            if RELATIVE_STEP.of(group):
                rho = min(lr, 1 / (float(t) ** 0.5))
            factors.append(rho / lr if rho < lr else 1.0)
            weight = float(k) ** group["beta2_decay"]
            to, frm = lerps.setdefault(weight, ([], []))
            for key, new in pairs:
                to += [s[key] for s in sts]
                frm += new.unbind()
        for weight, (to, frm) in lerps.items():
            torch._foreach_lerp_(to, frm, weight)
        if device_counts is not None:
            torch._foreach_lerp_(*device_lerps)
        for sts, eps1, (_, _, var) in zip(states, eps1s, slices, strict=True):
            if "adafactor.row_var" in sts[0]:
                R = torch.stack([s["adafactor.row_var"] for s in sts])
                C = torch.stack([s["adafactor.col_var"] for s in sts])
                torch.matmul(R, C, out=var)
                var.div_(R.mean(dim=-2, keepdim=True).clamp_(min=eps1))
            else:
                torch.stack([s["adafactor.variance"] for s in sts], out=var)
        if len(set(eps1s)) == 1:  # eps1² (torch's convention, see _step)
            var_flat.clamp_(min=eps1s[0] * eps1s[0])
        else:
            for (_, _, var), eps1 in zip(slices, eps1s, strict=True):
                var.clamp_(min=eps1 * eps1)
        var_flat.rsqrt_().mul_(U)
        updates = [x for _, _, var in slices for x in var.unbind()]
        device = updates[0].device
        # 1 / max(1, RMS(U)/d) = min(1, d·√numel / ‖U‖), in float64 as _step computes it
        roots = tuple(max(x.numel(), 1) ** 0.5 * group["d"] for x in updates)
        norms = torch.stack(torch._foreach_norm(updates))
        scale = torch.div(constants(roots, torch.float64, device), norms).clamp_(max=1.0)
        if SCALE_PARAMETER.of(group):
            params = [c.param for cs in ctxs for c in cs]
            sizes = tuple(max(p.numel(), 1) ** 0.5 for p in params)
            rms = torch.stack(torch._foreach_norm(params))
            rms = torch.div(rms, constants(sizes, torch.float64, device)).clamp_(min=eps2)
            scale.mul_(rms)
        start = 0
        for (_, _, var), factor in zip(slices, factors or [1.0] * len(slices), strict=True):
            if factor != 1.0:  # ρ_t/lr where ρ_t < lr (see _step)
                scale[start : start + var.shape[0]].mul_(factor)
            start += var.shape[0]
        if device_counts is not None and device_counts[0] is not None:
            scale.mul_(device_counts[0])  # (× 1 exactly where ρ_t = lr)
        scale = scale.to(dtype)  # (as _step's 0-d scale multiplies in the moments' dtype)
        start = 0
        for _, _, var in slices:
            k = var.shape[0]
            var.mul_(scale[start : start + k].view(k, *[1] * (var.dim() - 1)))
            start += k
        if beta1 is not None:
            exp_avgs = [s["adafactor.exp_avg"] for s in every]
            torch._foreach_lerp_(exp_avgs, updates, 1 - beta1)
            torch._foreach_copy_(updates, exp_avgs)
        return [list(var.unbind()) for _, _, var in slices]

    def _step(
        self, u: Tensor, views: dict[str, Tensor], state: State, group: Group, ctx: Context
    ) -> Tensor:
        factored = "adafactor.row_var" in views
        moment = views["adafactor.row_var" if factored else "adafactor.variance"]
        if u.dtype != moment.dtype:
            u = u.to(moment.dtype)
        beta1 = BETA1.of(group)
        if beta1 is not None and "adafactor.exp_avg" not in views:
            raise ValueError(
                "beta1 is set but this parameter's state was created with beta1=None (no "
                "momentum buffer); set beta1 before the first step"
            )
        eps1, eps2 = group["eps"]
        if eps1 is None:
            eps1 = torch.finfo(ctx.param.dtype).eps
        lr = float(group["lr"])
        rho = lr
        factor: Tensor | None = None  # ρ_t/lr from a device counter (capturable)
        weight: float | Tensor
        if group.get("capturable"):  # device counters: ρ_t/lr and 1 − β̂₂ by device ops
            factor, (weight,) = _device_counts([state], group, moment.dtype)
        else:
            for key in _COUNTS:  # a capturable state, now not: its counters come back
                state[key] = counter_on(state[key], _CPU)
            state["adafactor.step"] += 1
            state["adafactor.moment_step"] += 1
            if RELATIVE_STEP.of(group):
                rho = min(lr, 1 / (float(int(state["adafactor.step"])) ** 0.5))
            weight = float(int(state["adafactor.moment_step"])) ** group["beta2_decay"]  # 1 − β̂₂
        scale_parameter = SCALE_PARAMETER.of(group)

        sharded = _sharded_dim(ctx, state)
        param_sq = None  # Σθ² of this rank's shard, reduced with the moment statistics
        if ctx.placement.distributed:
            param_sq = torch.linalg.vector_norm(ctx.param, dtype=torch.float64).square()
        if factored:
            var, param_sq = self._factored(u, views, weight, eps1, sharded, param_sq, ctx)
        else:
            var = views["adafactor.variance"].lerp_(u * u, weight).clone()
            if param_sq is not None:
                (param_sq,) = _all_reduce(ctx, [param_sq])
        # The scalars below stay 0-d float64 tensors on the device (no host read): the same
        # double arithmetic as Python floats, so the result is bitwise what .item() gave.
        param_scale: Tensor | float = 1.0  # max(eps2, RMS(θ)), or 1 without scale_parameter
        if scale_parameter:
            if param_sq is None:
                param_rms = ctx.param.norm(2).double() / (max(ctx.param.numel(), 1) ** 0.5)
            else:
                param_rms = (param_sq.double() / max(ctx.global_shape.numel(), 1)).sqrt()
            param_scale = param_rms.clamp(min=eps2)

        # eps1² because of the square root that follows (torch's convention)
        update = var.clamp_(min=eps1 * eps1).rsqrt_().mul_(u)
        if sharded is None:
            update_norm, numel = update.norm(2).double(), update.numel()
        else:
            numel = math.prod(_global_size(update, i, sharded, ctx) for i in range(update.dim()))
            total = torch.linalg.vector_norm(update, dtype=torch.float64).square()
            (total,) = _all_reduce(ctx, [total])
            update_norm = total.sqrt()
        # max(1, RMS(U)/d)
        clip = (update_norm / ((max(numel, 1) ** 0.5) * group["d"])).clamp(min=1.0)
        scale = param_scale / clip
        if rho < lr:  # α_t/lr = max(eps2, RMS(θ))·ρ_t/lr; ρ_t = lr otherwise (lr = 0 included)
            scale = scale * (rho / lr)
        if factor is not None:  # the same from the device counter (× 1 where ρ_t = lr)
            scale = scale * factor[0]
        update.mul_(scale)
        if beta1 is None:
            return update
        exp_avg = views["adafactor.exp_avg"]
        exp_avg.lerp_(update, 1 - beta1)
        return update.copy_(exp_avg)

    @staticmethod
    def _factored(
        u: Tensor,
        views: dict[str, Tensor],
        weight: float | Tensor,
        eps1: float,
        sharded: int | None,
        param_sq: Tensor | None,
        ctx: Context,
    ) -> tuple[Tensor, Tensor | None]:
        """Update R and C from ``u``; return V̂ (local block) and Σθ² (reduced if given)."""
        row_var, col_var = views["adafactor.row_var"], views["adafactor.col_var"]
        k = u.dim()
        if sharded is None or sharded < k - 2:  # the trailing matrices are whole on this rank
            if param_sq is not None:
                (param_sq,) = _all_reduce(ctx, [param_sq])
            # (g·g).mean(dim) without an m×n temporary (torch's ops, for equal rounding)
            row_mean = torch.norm(u, dim=-1, keepdim=True).square_().div_(u.size(-1))
            row_var.lerp_(row_mean, weight)
            col_mean = _col_sq(u).div_(u.size(-2))
            col_var.lerp_(col_mean, weight)
            var = row_var @ col_var
            return var.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1)), param_sq
        assert param_sq is not None
        m = _global_size(u, k - 2, sharded, ctx)
        n = _global_size(u, k - 1, sharded, ctx)
        row_sq = torch.norm(u, dim=-1, keepdim=True).square_()
        col_sq = _col_sq(u)
        if sharded == k - 1:  # columns split (GaLore left side): row sums are partial
            row_sq, param_sq = _all_reduce(ctx, [row_sq, param_sq])
            row_var.lerp_(row_sq.div_(n), weight)
            col_var.lerp_(col_sq.div_(m), weight)
            row_mean_of_var = row_var.mean(dim=-2, keepdim=True)
        else:  # rows split: column sums and the mean over rows of R are partial
            row_var.lerp_(row_sq.div_(n), weight)
            row_total = row_var.sum(dim=-2, keepdim=True)
            col_sq, row_total, param_sq = _all_reduce(ctx, [col_sq, row_total, param_sq])
            col_var.lerp_(col_sq.div_(m), weight)
            row_mean_of_var = row_total.div_(m)
        var = row_var @ col_var
        return var.div_(row_mean_of_var.clamp_(min=eps1)), param_sq

    # ---- subspace changes (GaLore) -----------------------------------------------
    def reset(self, state: State, group: Group) -> None:
        """Zero every moment and the moment step counter (the lr schedule's step is kept)."""
        reset_moments(state, (*self.linear_keys, *self.second_keys))
        state["adafactor.moment_step"].zero_()

    def rotate(self, state: State, rotate_fn: Callable[[Tensor, bool], Tensor]) -> None:
        """Rotate the momentum into the new coordinates; the factored second moment cannot be
        rotated and is reset instead.
        """
        if "adafactor.exp_avg" in state:
            fmt = stored_format(state, "adafactor.exp_avg", True)
            exp_avg = fmt.view(state, "adafactor.exp_avg")
            exp_avg.copy_(rotate_fn(exp_avg, False))
            fmt.store(state, "adafactor.exp_avg", exp_avg)
        reset_moments(state, self.second_keys)
        state["adafactor.moment_step"].zero_()

    def second_moment_sum(self, state: State, group: Group) -> Tensor | None:
        """Σ V̂ of this rank's block (no bias correction: β̂₂ = 0 at k = 1 makes V̂ unbiased).

        Factored, per trailing m×n matrix, the eps1 clamp ignored: Σᵢⱼ RᵢCⱼ/mean(R) = m·ΣC
        when R is whole here; when R is split by rows (a row-sharded 2-D direction)
        n·ΣR over this rank's rows, using mean(R) = mean(C) = mean(V̂). Replicated
        factors (GaLore's full side under FSDP) are counted once per rank, like Adam's.
        """
        if group.get("capturable"):  # a device counter: no host read (0 before a step)
            empty = state["adafactor.moment_step"].eq(0)
            return self._sum(state).masked_fill_(empty, 0.0)
        if int(state["adafactor.moment_step"]) == 0:
            return torch.zeros((), dtype=torch.float64)
        return self._sum(state)

    @staticmethod
    def _sum(state: State) -> Tensor:
        """Σ V̂ of :meth:`second_moment_sum` (a step taken)."""
        if "adafactor.variance" in state:
            return state["adafactor.variance"].sum(dtype=torch.float64)
        row_var = stored_format(state, "adafactor.row_var", False).view(state, "adafactor.row_var")
        col_var = stored_format(state, "adafactor.col_var", False).view(state, "adafactor.col_var")
        if int(state["adafactor.split_dim"]) == row_var.dim() - 2:
            return row_var.sum(dtype=torch.float64) * col_var.size(-1)
        return col_var.sum(dtype=torch.float64) * row_var.size(-2)
