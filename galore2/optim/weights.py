"""Weight modules: act on the weights after the step's update (norm loss, decay, lookahead).

They run after every group has been updated, in the order given (see
:mod:`galore2.core.modules`), on the full local weight — in GaLore groups too. Units are
those of :mod:`galore2.optim.gradient`: rows of ≥2-D parameters, the whole tensor of
≤1-D ones (norm all-reduced when sharded).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from .._numerics import generator_for, mix_seed
from ..core.counters import Counters
from ..core.masked import masked_factor, stacked_masks
from ..core.modules import WEIGHT_DECAY, ParamTransform, Stats
from ..core.options import Choice, Int, Option, Optional, Real
from ..core.state import counter
from ..core.transform import Context, Group, State
from .seeds import SEED
from .gradient import unit_norms
from .units import acc_dtype, batchable, layout

_LOOKAHEAD_TAG = 0x4C4B4148  # keeps lookahead's seeds apart from GaLore's


NORM_LOSS_FACTOR = Option(
    "norm_loss_factor", 1e-4, Real(low=0.0), "λₙ, the strength of the pull toward unit row norms"
)
NORM_LOSS_EPS = Option(
    "norm_loss_eps", 1e-8, Real(low=0.0, low_open=True), "norm loss: added to the row norm"
)
LOOKAHEAD_K = Option("lookahead_k", 5, Int(low=1), "lookahead: steps between synchronizations")
LOOKAHEAD_ALPHA = Option(
    "lookahead_alpha",
    0.5,
    Real(low=0.0, high=1.0, low_open=True),
    "lookahead: how far the slow weights move toward the fast ones",
)

LOOKAHEAD_DTYPE = Option(
    "lookahead_dtype",
    None,
    Optional(Choice(("bfloat16",)), "the parameter's dtype"),
    "lookahead: dtype of the slow weights (bfloat16 halves them, stochastic rounding)",
    resumable=False,
)


class NormLoss(ParamTransform):
    """Norm loss (Georgiou et al. 2021): pulls every unit's norm toward 1.

    Acts on: the weights after the update, per unit (rows of a ≥2-D parameter; the whole
    ≤1-D tensor — so a LayerNorm gain vector is pulled toward norm 1 as a whole; give
    such parameters ``norm_loss_factor=0`` in their own group to exclude them).
    State per element: 0.

    ``wᵢ ← wᵢ·(1 − lr·2λₙ·(1 − 1/(‖wᵢ‖ + eps)))``: a gradient step on λₙ(‖wᵢ‖ − 1)², so
    a unit of norm 1 is a fixed point, larger ones shrink, smaller ones grow. Group keys:
    ``norm_loss_factor`` (λₙ, default 1e-4) and ``norm_loss_eps`` (default 1e-8); ``lr``
    is the group's (scheduled) learning rate.
    """

    name = "norm_loss"
    options = (NORM_LOSS_FACTOR, NORM_LOSS_EPS)

    def capture_problem(self, group: Group) -> str | None:
        """None: the unit norms and factors are computed by device ops only, so a step can replay from a CUDA graph
        (:mod:`galore2.core.capture`)."""
        return None

    def apply_(self, group: Group, state: State, ctx: Context, stats: Stats | None) -> None:
        """Pull each unit of the weight ``ctx.param`` toward norm 1, in place."""
        factor = float(NORM_LOSS_FACTOR.of(group))
        lr = float(group["lr"])
        if factor == 0.0 or lr == 0.0:
            return
        w = ctx.param
        (norm,) = unit_norms([w], ctx)
        eps = float(NORM_LOSS_EPS.of(group))
        shrink = (norm + eps).reciprocal_().neg_().add_(1.0)  # 1 − 1/(‖wᵢ‖ + eps)
        # a masked step's masked parameter (ctx.mask 0.0) keeps its weights
        w.mul_(masked_factor(shrink.mul_(-2.0 * lr * factor).add_(1.0), ctx.mask))

    def apply_many(
        self, group: Group, states: list[State], ctxs: list[Context], stats: Stats | None
    ) -> None:
        """:meth:`apply_` over a batch: every unit norm by one segment reduction, the
        factors ``(1 − c) + c/(‖wᵢ‖ + eps)`` (c = 2·lr·λₙ) spread back by one foreach kernel."""
        factor = float(NORM_LOSS_FACTOR.of(group))
        lr = float(group["lr"])
        if factor == 0.0 or lr == 0.0:
            return
        ws = [ctx.param for ctx in ctxs]
        together, alone = batchable(ws, ctxs)
        for i in alone:
            self.apply_(group, states[i], ctxs[i], stats)
        if not together:
            return
        ws = [ws[i] for i in together]
        lay = layout(ws)
        values = lay.gather([ws], acc_dtype(ws[0]))
        (norm,) = lay.reduce(values, lambda region: torch.linalg.vector_norm(region, dim=-1))
        c = 2.0 * lr * factor
        scale = norm.add_(float(NORM_LOSS_EPS.of(group))).reciprocal_().mul_(c).add_(1.0 - c)
        masks = stacked_masks(lay.ordered([ctxs[i].mask for i in together]))
        if masks is not None:  # a masked step: each unit's factor 1 where its tensor is masked
            units = lay.per_tensor(masks.device, scale.dtype)[0]
            spread = torch.repeat_interleave(masks, units, output_size=scale.numel())
            scale = masked_factor(scale, spread)
        lay.scale_(values, scale)
        torch._foreach_copy_(lay.ordered(ws), lay.views(values))


class StableWeightDecay(ParamTransform):
    """Stable weight decay (Xie et al., "On the Overlooked Pitfalls of Weight Decay").

    Acts on: every parameter stepped this step, after the update. State per element: 0.

    ``w ← w·(1 − lr·λ/σ)`` with λ = the group's ``weight_decay``, lr the group's
    (scheduled) learning rate and σ = √(Σ v̂ / Σ numel) over *all* parameters stepped this
    step (:func:`galore2.core.modules.compute_stats`; GaLore's low-rank v̂ are summed as
    stored and divided by the full element count). It replaces the optimizer's
    :class:`~galore2.core.modules.DecoupledWeightDecay` (it reads the same ``weight_decay``
    option: an optimizer with this module has no decoupled decay, and GaLore folds no
    decay into its updates). Order: σ needs this step's second moments of every
    parameter, so the decay comes *after* the update — ``p ← (p − lr·u)·(1 − lr·λ/σ)``,
    galore-torch's decay-after order (``torch.optim.AdamW`` decays before).

    Guards: σ = 0 (all gradients zero so far) or non-finite → no decay this step; the
    factor is clamped at 0 (lr·λ > σ would otherwise flip the weights' sign).
    Not available to per-layer updates (``step_param``): σ needs every parameter.
    """

    name = "swd"
    options = (WEIGHT_DECAY,)  # the decoupled decay's option: this module replaces it
    needs_stats = True

    def capture_problem(self, group: Group) -> str | None:
        """None: σ and the decay factor stay on the device by device ops only, so a step can replay from a CUDA graph
        (:mod:`galore2.core.capture`)."""
        return None

    def uses_stats(self, group: Group) -> bool:
        """σ is read only where the decay is not 0."""
        return float(group["lr"]) * float(group["weight_decay"]) != 0.0

    def batch_key(self, group: Group) -> tuple:
        """Groups with the same ``lr·weight_decay`` share one batched decay."""
        return (float(group["lr"]) * float(group["weight_decay"]),)

    def apply_(self, group: Group, state: State, ctx: Context, stats: Stats | None) -> None:
        """Decay the weight ``ctx.param`` in place by ``1 − lr·λ/σ`` (σ from ``stats``).

        Raises:
            ValueError: ``stats`` is ``None`` (per-layer updates: σ needs every parameter).
        """
        factor = self._factor(group, stats)
        if factor is not None:  # a masked step's masked parameter (ctx.mask 0.0) keeps its weights
            ctx.param.mul_(masked_factor(factor, ctx.mask))

    def apply_many(
        self, group: Group, states: list[State], ctxs: list[Context], stats: Stats | None
    ) -> None:
        """:meth:`apply_` over a batch: one foreach multiply by the step's factor."""
        factor = self._factor(group, stats)
        if factor is None:
            return
        masks = stacked_masks([ctx.mask for ctx in ctxs])
        if masks is None:
            torch._foreach_mul_([ctx.param for ctx in ctxs], factor)
        else:  # a masked step: each parameter's factor, 1 where it is masked
            factors = masked_factor(factor, masks).unbind()
            torch._foreach_mul_([ctx.param for ctx in ctxs], list(factors))

    @staticmethod
    def _factor(group: Group, stats: Stats | None) -> Tensor | None:
        """This step's decay factor of ``group`` (a 0-d device tensor; None: no decay)."""
        decay = float(group["lr"]) * float(group["weight_decay"])
        if decay == 0.0:
            return None
        if stats is None:
            raise ValueError("stable weight decay needs the step's statistics (optimizer.step())")
        key = ("swd", decay)  # one factor per step and group, kept on the device
        if key not in stats.cache:
            sigma = stats.second_moment_mean.clamp(min=0.0).sqrt()
            usable = (sigma > 0) & sigma.isfinite()
            factor = (1.0 - decay / sigma).clamp(min=0.0)
            stats.cache[key] = torch.where(usable, factor, torch.ones_like(factor))
        return stats.cache[key]


def stochastic_round_bf16(x: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """``x`` (float32) stochastically rounded to bfloat16: unbiased, E[result] = x.

    Uniform random bits below bfloat16's mantissa are added to the float32 bit pattern,
    which is then truncated: x rounds up with probability (distance to the lower
    neighbour)/(gap). The float32 input is overwritten (used as the work buffer).
    """
    bits = x.view(torch.int32)
    noise = torch.randint(
        0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator
    )
    bits.add_(noise).bitwise_and_(-(1 << 16))
    return x.to(torch.bfloat16)  # exact: the low 16 bits are zero


class Lookahead(ParamTransform):
    """Lookahead (Zhang et al. 2019): every k steps, fast weights are pulled to slow ones.

    Acts on: the weights after the update (and after weight modules listed before it). State per
    element: 1 value in the parameter's dtype (``lookahead.slow``, kind ``"lookahead"``),
    or 2 bytes with ``slow_dtype="bfloat16"``; plus CPU int64 counters.

    At every step ``t ← t + 1``; when ``t % k == 0``::

        slow ← slow + α·(w − slow);   w ← slow

    ``slow`` starts as a copy of the weights. With ``slow_dtype="bfloat16"`` the new slow
    weights are computed in float32 and stochastically rounded to bfloat16 (so the fast
    weights are snapped to bfloat16 values at each sync); the random bits come from a
    generator seeded from ``lookahead.seed`` (derived from the group's ``seed`` and the
    parameter index), the step and the shard's first row, so resuming from
    ``state_dict()`` is bit-identical (with the same sharding). A skipped (non-finite)
    update does not count as a step for that parameter. Group keys: ``lookahead_k`` (k,
    default 5, int ≥ 1) and ``lookahead_alpha`` (α, default 0.5, in (0, 1]).
    """

    name = "lookahead"
    options = (LOOKAHEAD_K, LOOKAHEAD_ALPHA, SEED)
    kinds: ClassVar[dict[str, str]] = {
        "lookahead.slow": "lookahead",
        "lookahead.step": "other",
        "lookahead.seed": "other",
    }

    def __init__(self, slow_dtype: Any = None) -> None:
        if slow_dtype in ("bfloat16", "bf16", torch.bfloat16):
            self.slow_dtype: torch.dtype | None = torch.bfloat16
        elif slow_dtype is None:
            self.slow_dtype = None
        else:
            raise ValueError(f"slow_dtype must be None or 'bfloat16', got {slow_dtype!r}")
        self._counters = Counters()  # host step counters packed per batch

    def capture_problem(self, group: Group) -> str | None:
        """Refused (:mod:`galore2.core.capture`): whether a step synchronizes the slow
        weights is decided on the host from ``lookahead.step``, so a captured graph would
        repeat the branch of the step it recorded at every replay."""
        return (
            "Lookahead decides on the host which steps synchronize its slow weights (every "
            "lookahead_k-th): a graph would replay one branch; use use_lookahead=False"
        )

    def init(
        self, shape: torch.Size, ref: Tensor, group: Group, state: State, ctx: Context
    ) -> None:
        """Create the slow weights (a copy of the weights, in ``slow_dtype``) and the counters."""
        slow = ctx.zeros(shape, self.slow_dtype or ref.dtype)
        ctx.placement.local(slow).copy_(ref)
        state["lookahead.slow"] = slow
        state["lookahead.step"] = counter()
        if self.slow_dtype is not None:
            state["lookahead.seed"] = counter(mix_seed(SEED.of(group), ctx.index, _LOOKAHEAD_TAG))

    def apply_(self, group: Group, state: State, ctx: Context, stats: Stats | None) -> None:
        """Count a step; every ``lookahead_k`` steps update the slow weights, copy them back."""
        state["lookahead.step"] += 1
        step = int(state["lookahead.step"])
        if step % int(LOOKAHEAD_K.of(group)):
            return
        self._sync(group, state, ctx, step)

    def apply_many(
        self, group: Group, states: list[State], ctxs: list[Context], stats: Stats | None
    ) -> None:
        """:meth:`apply_` over a batch: the counters by one host add; slow weights in the
        parameters' dtype are synchronized by two foreach kernels (bfloat16 ones per tensor)."""
        # host counters: one add and one read when packed (galore2.core.counters)
        steps = self._counters.advance(states, "lookahead.step")
        k = int(LOOKAHEAD_K.of(group))
        due = [i for i, step in enumerate(steps) if step % k == 0]
        if not due:
            return
        if self.slow_dtype is not None or len(due) == 1:
            for i in due:
                self._sync(group, states[i], ctxs[i], steps[i])
            return
        slows = [states[i]["lookahead.slow"] for i in due]
        ws = [ctxs[i].param for i in due]
        torch._foreach_lerp_(slows, ws, float(LOOKAHEAD_ALPHA.of(group)))
        torch._foreach_copy_(ws, slows)

    def _sync(self, group: Group, state: State, ctx: Context, step: int) -> None:
        """``slow ← slow + α·(w − slow); w ← slow`` for one parameter at sync ``step``."""
        alpha = float(LOOKAHEAD_ALPHA.of(group))
        w, slow = ctx.param, state["lookahead.slow"]
        if self.slow_dtype is None:
            slow.lerp_(w, alpha)
        else:
            shape = ctx.global_shape
            first_row = ctx.placement.row_range(shape[0])[0] if len(shape) else 0
            seed = mix_seed(int(state["lookahead.seed"]), step, first_row)
            new = slow.float().lerp_(w.float(), alpha)
            slow.copy_(stochastic_round_bf16(new, generator_for(new.device, seed)))
        w.copy_(slow)
