"""Positive-negative momentum with Adam's second moment, as a transform (``ScaleByPNM``).

Acts on: whatever direction it is given — the full gradient in a plain group,
the projected r×n (or m×r) gradient inside :class:`~galore2.optim.galore.GaLore`.
State per element of the direction: 3 values in ``state_dtype`` (``pnm.exp_avg``,
``pnm.neg_exp_avg``, ``pnm.exp_avg_sq``), 4 with ``amsgrad`` (``pnm.max_exp_avg_sq``),
plus one int64 step counter (``pnm.step``: on the CPU; with ``capturable=True`` on the
direction's device, and every step's coefficients computed there from it — no host read,
so the step can replay from a CUDA graph, see :mod:`galore2.core.capture`).
``moments="dynamic8"`` (Ranger21's ``moments_8bit``) stores the moments of large
directions 8-bit blockwise instead, ~1 byte per element each, updated in fp32 (see
:mod:`galore2.storage.moments`).

Math at step t (1-based), with (β₁, β₂) = ``betas``, β₀ = ``pnm_beta0`` (default 1)::

    active  = exp_avg if t is odd else neg_exp_avg          (the other one is "passive")
    active ← β₁²·active + (1 − β₁²)·g
    v      ← β₂·v + (1 − β₂)·g²           (amsgrad: v_max ← max(v_max, v), used below)
    m̂_a = active / (1 − β₁^(2·⌈t/2⌉)),   m̂_p = passive / (1 − β₁^(2·⌊t/2⌋))   (m̂_p = 0 at t = 1)
    num = ((1 + β₀)·m̂_a − β₀·m̂_p) / √((1 + β₀)² + β₀²)
    den = √(v / (1 − β₂^t)) + eps         (softplus: softplus(√v̂, beta=softplus_beta), no eps)
    out = num / den                        (the optimizer applies −lr·out)

Bias correction. Each buffer is an EMA with coefficient a = β₁² that is updated only
every other step: the active buffer has been updated n_a = ⌈t/2⌉ times (odd steps for
``exp_avg``, even steps for ``neg_exp_avg``), the passive one n_p = ⌊t/2⌋ times. After n
updates from zero, a buffer holds Σ_{k<n} (1 − a)·aᵏ·g_{(n−k)} whose weights sum to
1 − aⁿ, so each buffer is divided by its own 1 − a^n = 1 − β₁^(2n). A constant gradient
g then gives m̂_a = m̂_p = g at every step, and with β₀ = 0 the numerator is exactly g
(Adam with momentum coefficient β₁²). The passive buffer is empty at t = 1 (n_p = 0) and
contributes nothing. The paper's single correction 1 − β₁^t is exact for neither buffer
at odd t. ``adamd=True`` (AdamD) skips the first-moment correction: the numerator uses
the raw buffers, so early updates are small instead of full-size (a built-in warmup);
the second moment is still corrected.

β₀ is the paper's positive-negative noise/momentum factor: the update mixes the current
buffer with the other (independent-noise) buffer, ``(1 + β₀)·m_t − β₀·m_{t−1}``, which
enlarges the gradient-noise part of the step (noise variance ∝ (1+β₀)² + β₀²); dividing
by √((1 + β₀)² + β₀²) keeps the noise magnitude of the step that of plain momentum.
Ranger21's reference stored β₀ but never used it; here it is used (β₀ = 0 disables PNM).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _numerics
from ..core.options import Bool, Option, Real
from ..core.transform import Context, Group, State, Transform
from ..storage.dtype import STATE_DTYPE
from ..storage.moments import is_quantized, stored_format
from .adam import BETAS, EPS
from .moments import MomentRule, bias_correction, moment_rule_kinds

PNM_BETA0 = Option(
    "pnm_beta0", 1.0, Real(low=0.0), "β₀, the weight of the negative momentum (1: Ranger21's)"
)
#: the moment module's variants (constructor switches of ScaleByPNM; defaults are Ranger21's)
PNM_SWITCHES = (
    Option("softplus", True, Bool(), "PNM: softplus(√v̂) as the denominator instead of √v̂ + eps"),
    Option("adamd", False, Bool(), "PNM: AdamD, no bias correction of the first moment"),
    Option(
        "amsgrad",
        False,
        Bool(),
        "PNM: AMSGrad, the running max of v in the denominator",
        resumable=False,
    ),
)
SOFTPLUS_BETA = Option(
    "softplus_beta", 50.0, Real(low=0.0, low_open=True), "sharpness of the softplus denominator"
)


def _corrections(t: int, beta1: float, adamd: bool) -> tuple[float, float]:
    """(bias correction of the active buffer, of the passive one; 0 = empty buffer)."""
    n_active, n_passive = (t + 1) // 2, t // 2
    if adamd:
        return 1.0, (1.0 if n_passive else 0.0)
    a = beta1 * beta1
    return bias_correction(a, n_active), (bias_correction(a, n_passive) if n_passive else 0.0)


_CPU = torch.device("cpu")
AXIS = "pnm.block_dim"  # the blocked axis of every 8-bit moment (same shape and layout)


class ScaleByPNM(MomentRule, Transform):
    """Positive-negative momentum over Adam's second moment (see the module docstring).

    Args:
        amsgrad: keep ``pnm.max_exp_avg_sq`` (running max of v) and divide by it.
        softplus: denominator ``softplus(√v̂, beta=softplus_beta)`` instead of ``√v̂ + eps``.
        adamd: no bias correction of the first moment (AdamD).
        moments: moment storage, ``"state_dtype"`` or ``"dynamic8"`` (8-bit blockwise).
    """

    name = "pnm"
    label = "PNM"
    step_key = "pnm.step"
    second_key = "pnm.exp_avg_sq"  # the EMA, not the amsgrad max
    axis = AXIS
    options = (BETAS, EPS, STATE_DTYPE, PNM_BETA0, SOFTPLUS_BETA)
    kinds: ClassVar[dict[str, str]] = moment_rule_kinds(
        "pnm", "exp_avg", "neg_exp_avg", "exp_avg_sq", "max_exp_avg_sq"
    )
    linear_keys = ("pnm.exp_avg", "pnm.neg_exp_avg")
    quadratic_keys: tuple[str, ...] = ("pnm.exp_avg_sq",)
    #: kept on the direction's device with ``capturable=True`` (see :meth:`_captured`)
    device_counters = ("pnm.step",)

    def __init__(
        self,
        *,
        amsgrad: bool = False,
        softplus: bool = False,
        adamd: bool = False,
        moments: str = "state_dtype",
    ):
        super().__init__(moments=moments)
        self.amsgrad, self.softplus, self.adamd = bool(amsgrad), bool(softplus), bool(adamd)
        if self.amsgrad:
            self.quadratic_keys = ("pnm.exp_avg_sq", "pnm.max_exp_avg_sq")

    def __repr__(self) -> str:
        return (
            f"ScaleByPNM(amsgrad={self.amsgrad}, softplus={self.softplus}, adamd={self.adamd}, "
            f"moments={self.moments!r})"
        )

    def update(self, u: Tensor, state: State, group: Group, ctx: Context) -> Tensor:
        """Update the moments with ``u`` and return the positive-negative momentum direction."""
        # each moment as a tensor to update in place: the stored one, or an fp32 copy of
        # 8-bit codes that is quantized back below
        formats = {key: stored_format(state, key, signed) for key, signed in self.moment_keys()}
        views = {key: fmt.view(state, key, AXIS) for key, fmt in formats.items()}
        out = self._step(u, views, state, group)
        for key, fmt in formats.items():
            fmt.store(state, key, views[key], AXIS)
        return out

    def _step(self, u: Tensor, views: dict[str, Tensor], state: State, group: Group) -> Tensor:
        t = self.count_step(state, group, views["pnm.exp_avg"].device)
        if isinstance(t, Tensor):  # a device counter (capturable)
            return self._captured([u], [views], t.view(1), group)[0]
        exp_avg, neg_exp_avg = views["pnm.exp_avg"], views["pnm.neg_exp_avg"]
        exp_avg_sq = views["pnm.exp_avg_sq"]
        if u.dtype != exp_avg.dtype:
            u = u.to(exp_avg.dtype)
        beta1, beta2 = group["betas"]
        beta0 = float(PNM_BETA0.of(group))
        active, passive = (exp_avg, neg_exp_avg) if t % 2 == 1 else (neg_exp_avg, exp_avg)
        active.lerp_(u, 1 - beta1 * beta1)
        exp_avg_sq.mul_(beta2).addcmul_(u, u, value=1 - beta2)
        v = exp_avg_sq
        if self.amsgrad:
            v = views["pnm.max_exp_avg_sq"]
            torch.maximum(v, exp_avg_sq, out=v)  # stored: the running max of v
        bc_active, bc_passive = _corrections(t, beta1, self.adamd)
        norm = math.sqrt((1 + beta0) ** 2 + beta0**2)
        out = torch.mul(active, (1 + beta0) / (norm * bc_active))
        if bc_passive > 0 and beta0 != 0:
            out.add_(passive, alpha=-beta0 / (norm * bc_passive))
        denom = v.sqrt().div_(math.sqrt(bias_correction(beta2, t)))
        if self.softplus:
            sp_beta = float(SOFTPLUS_BETA.of(group))
            denom = F.softplus(denom, beta=sp_beta)
        else:
            denom.add_(group["eps"])
        return out.div_(denom)

    def update_many(
        self, us: list[Tensor], states: list[State], group: Group, ctxs: list[Context]
    ) -> list[Tensor]:
        """The same arithmetic as :meth:`update`, one ``torch._foreach_*`` kernel per op for
        the tensors at the same step (8-bit moments: :meth:`update` per tensor). On the CPU
        the kernels run only when the group asks for them (``foreach=True``), as Adam's."""
        if not us or (us[0].device.type == "cpu" and not group.get("foreach")):
            return [self.update(u, s, group, c) for u, s, c in zip(us, states, ctxs, strict=True)]
        out: list[Tensor | None] = [None] * len(us)
        plain = [i for i, s in enumerate(states) if not is_quantized(s, "pnm.exp_avg")]
        if group.get("capturable"):  # device counters: one batch per moment dtype
            by_dtype: dict[torch.dtype, list[int]] = {}
            for i in plain:
                by_dtype.setdefault(states[i]["pnm.exp_avg_sq"].dtype, []).append(i)
            for batch in by_dtype.values():
                views = [{k: states[i][k] for k, _ in self.moment_keys()} for i in batch]
                device = views[0]["pnm.exp_avg"].device
                steps = self.count_steps([states[i] for i in batch], group, device)
                results = self._captured([us[i] for i in batch], views, steps, group)
                for i, r in zip(batch, results, strict=True):
                    out[i] = r
            return self.update_rest(out, us, states, group, ctxs)
        # host counters: one add and one read when packed
        steps = self.count_steps([states[i] for i in plain], group, _CPU) if plain else []
        by_step: dict[tuple[int, torch.dtype], list[int]] = {}  # usually one batch for all
        for i, t in zip(plain, steps, strict=True):
            by_step.setdefault((t, states[i]["pnm.exp_avg_sq"].dtype), []).append(i)
        for (t, _), batch in by_step.items():
            results = self._foreach([us[i] for i in batch], [states[i] for i in batch], group, t)
            for i, r in zip(batch, results, strict=True):
                out[i] = r
        return self.update_rest(out, us, states, group, ctxs)

    def _coefficients(self, steps: Tensor, group: Group, dtype: torch.dtype) -> list[Tensor]:
        """Per tensor, from its advanced device counter (``steps``, 1-D int64) by device ops:
        the lerp weights of ``exp_avg`` and ``neg_exp_avg`` (1 − β₁² for the active buffer,
        0 for the passive one), their coefficients in the numerator (the active one's
        (1 + β₀)/(norm·bc_a), the passive one's −β₀/(norm·bc_p), 0 while it is empty) and
        √(1 − β₂ᵗ): five 1-D tensors, the first four in ``dtype``, the last float64 — the
        host path's double arithmetic (:func:`_corrections`), on the device."""
        beta1, beta2 = group["betas"]
        beta0 = float(PNM_BETA0.of(group))
        a = beta1 * beta1
        norm = math.sqrt((1 + beta0) ** 2 + beta0**2)
        device = steps.device
        odd = steps.remainder(2).bool()
        if self.adamd:  # no first-moment correction: 1, and 0 for an empty passive buffer
            bc_a = torch.ones_like(steps, dtype=torch.float64)
            bc_p = steps.ge(2).to(torch.float64)
        else:
            halves = torch.stack([steps.add(1), steps]).div_(2, rounding_mode="floor")
            bc = bias_correction(_numerics.constants((a,), torch.float64, device), halves)
            bc_a, bc_p = bc.unbind()
        c = _numerics.constants((1 + beta0, -beta0), torch.float64, device)
        c_a = torch.div(c[0], bc_a.mul(norm))
        c_p = torch.div(c[1], bc_p.mul(norm)).masked_fill_(bc_p.eq(0), 0.0)
        if beta0 == 0:
            c_p.zero_()
        w = odd.to(torch.float64).mul_(1 - a)
        w_neg = torch.rsub(odd.to(torch.float64), 1).mul_(1 - a)
        c_pos, c_neg = torch.where(odd, c_a, c_p), torch.where(odd, c_p, c_a)
        bc2 = bias_correction(beta2, steps.to(torch.float64)).sqrt_()
        return [w.to(dtype), w_neg.to(dtype), c_pos.to(dtype), c_neg.to(dtype), bc2]

    def _captured(
        self, us: list[Tensor], views: list[dict[str, Tensor]], steps: Tensor, group: Group
    ) -> list[Tensor]:
        """:meth:`_step`'s math with device counters (``capturable=True``) over tensors whose
        moments (``views``) share a dtype and whose counters were advanced to ``steps`` (1-D,
        on their device): both momenta lerp with device weights (0 for the passive one,
        which leaves it as it was), so nothing depends on the host's parity of ``t``. No
        host read, no tensor made from host data after the first step."""
        exp_avgs = [v["pnm.exp_avg"] for v in views]
        neg_exp_avgs = [v["pnm.neg_exp_avg"] for v in views]
        exp_avg_sqs = [v["pnm.exp_avg_sq"] for v in views]
        dtype = exp_avgs[0].dtype
        us = [u if u.dtype == dtype else u.to(dtype) for u in us]
        _, beta2 = group["betas"]
        w_pos, w_neg, c_pos, c_neg, bc2 = (
            list(x.unbind()) for x in self._coefficients(steps, group, dtype)
        )
        torch._foreach_lerp_(exp_avgs, us, w_pos)
        torch._foreach_lerp_(neg_exp_avgs, us, w_neg)
        v = self._second_moments(exp_avg_sqs, us, beta2, views)
        out = torch._foreach_mul(exp_avgs, c_pos)
        torch._foreach_addcmul_(out, neg_exp_avgs, c_neg)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bc2)
        if self.softplus:
            sp_beta = float(SOFTPLUS_BETA.of(group))
            denom = [F.softplus(d, beta=sp_beta) for d in denom]
        else:
            torch._foreach_add_(denom, group["eps"])
        torch._foreach_div_(out, denom)
        return list(out)

    def _second_moments(
        self, exp_avg_sqs: list[Tensor], us: list[Tensor], beta2: float, states: list[State]
    ) -> list[Tensor]:
        """v ← β₂·v + (1 − β₂)·u² by foreach kernels; the v the denominators read (AMSGrad:
        the running maxima in ``states``, updated)."""
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, us, us, value=1 - beta2)
        if not self.amsgrad:
            return exp_avg_sqs
        v = [s["pnm.max_exp_avg_sq"] for s in states]
        torch._foreach_maximum_(v, exp_avg_sqs)
        return v

    def _foreach(self, us: list[Tensor], states: list[State], group: Group, t: int) -> list[Tensor]:
        """:meth:`_step`'s math over tensors (moments of one dtype) whose counters were
        advanced to ``t``; the denominators (softplus: no foreach kernel) over one buffer."""
        exp_avgs = [s["pnm.exp_avg"] for s in states]
        neg_exp_avgs = [s["pnm.neg_exp_avg"] for s in states]
        exp_avg_sqs = [s["pnm.exp_avg_sq"] for s in states]
        us = [u if u.dtype == m.dtype else u.to(m.dtype) for u, m in zip(us, exp_avgs, strict=True)]
        beta1, beta2 = group["betas"]
        beta0 = float(PNM_BETA0.of(group))
        active, passive = (exp_avgs, neg_exp_avgs) if t % 2 == 1 else (neg_exp_avgs, exp_avgs)
        torch._foreach_lerp_(active, us, 1 - beta1 * beta1)
        v = self._second_moments(exp_avg_sqs, us, beta2, states)
        bc_active, bc_passive = _corrections(t, beta1, self.adamd)
        norm = math.sqrt((1 + beta0) ** 2 + beta0**2)
        out = torch._foreach_mul(active, (1 + beta0) / (norm * bc_active))
        if bc_passive > 0 and beta0 != 0:
            torch._foreach_add_(out, passive, alpha=-beta0 / (norm * bc_passive))
        # the denominators in one buffer: the per-tensor path's ops, one kernel each
        denom = torch.cat([x.reshape(-1) for x in v]).sqrt_()
        denom.div_(math.sqrt(bias_correction(beta2, t)))
        if self.softplus:
            denom = F.softplus(denom, beta=float(SOFTPLUS_BETA.of(group)))
        else:
            denom.add_(group["eps"])
        parts = denom.split([x.numel() for x in v])
        torch._foreach_div_(out, [part.view(x.shape) for part, x in zip(parts, v, strict=True)])
        return list(out)

    def second_moment_sum_many(self, states: list[State], group: Group) -> Tensor | None:
        """Σ over ``states`` of :meth:`second_moment_sum` by one foreach kernel (v ≥ 0, so
        Σ v is its L1 norm); None where that does not apply (8-bit moments, differing
        step counts: the caller sums per tensor)."""
        if any(is_quantized(s, "pnm.exp_avg_sq") for s in states):
            return None
        if group.get("capturable"):  # device counters: each sum corrected by its own count
            td = torch.stack([s["pnm.step"] for s in states]).to(torch.float64)
            sums = torch.stack(torch._foreach_norm([s["pnm.exp_avg_sq"] for s in states], 1))
            total = sums.to(torch.float64) / bias_correction(group["betas"][1], td)
            return total.masked_fill_(td.eq(0), 0.0).sum()
        packed = self._counters.packed(states, "pnm.step")  # the step's pack: one read
        steps = set(packed.tolist()) if packed is not None else {int(s["pnm.step"]) for s in states}
        if len(steps) != 1:
            return None
        t = steps.pop()
        if t == 0:
            return torch.zeros((), dtype=torch.float64)
        sums = torch._foreach_norm([s["pnm.exp_avg_sq"] for s in states], 1)
        return torch.stack(sums).sum(dtype=torch.float64) / bias_correction(group["betas"][1], t)


__all__ = ["PNM_BETA0", "PNM_SWITCHES", "SOFTPLUS_BETA", "ScaleByPNM"]
