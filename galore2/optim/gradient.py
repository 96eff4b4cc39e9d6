"""Gradient modules: act on a parameter's full local gradient, in place, before the moments.

They run before GaLore projects the gradient (see :mod:`galore2.core.modules`), so even in
a GaLore group they see the full m×n gradient. None keeps state (0 values per element).

Units. A "unit" is one output row of a ≥2-D parameter (norms and means over every dim
but 0) and the whole tensor of a ≤1-D one (a bias or gain vector is one unit, not one
unit per element). Under FSDP2 parameters are split by rows (``Shard(0)``), so a row is
whole on its rank and row statistics are local; a sharded ≤1-D parameter's statistics
are summed over the shard group (one all-reduce of a few numbers per parameter).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.modules import GradientTransform
from ..core.options import Option, Real
from ..core.transform import Context, Group, State
from .units import acc_dtype, batchable, layout


def unit_norms(tensors: list[Tensor], ctx: Context) -> list[Tensor]:
    """L2 norm of every unit of each tensor (all shaped like ``ctx.param``).

    ≥2-D: one norm per row, shaped (rows, 1, …, 1) to broadcast; ≤1-D: a 0-D norm of the
    whole tensor, summed over the shard group when the parameter is sharded (every rank
    must call this, even with an empty shard: it is a collective).
    """
    if tensors[0].dim() >= 2:
        dims = tuple(range(1, tensors[0].dim()))
        return [
            torch.linalg.vector_norm(t, dim=dims, keepdim=True, dtype=acc_dtype(t)) for t in tensors
        ]
    squares = torch.stack(
        [torch.linalg.vector_norm(t, dtype=acc_dtype(t)).square() for t in tensors]
    )
    if ctx.placement.distributed:
        squares = ctx.placement.reduce(squares)
    return list(squares.sqrt().unbind())


AGC_CLIP = Option(
    "agc_clip",
    1e-2,
    Real(low=0.0),
    "AGC: largest ratio of a row's gradient norm to its weight norm",
)
AGC_EPS = Option("agc_eps", 1e-3, Real(low=0.0, low_open=True), "AGC: floor of the weight norm")
GN_EPS = Option(
    "gn_eps", 1e-8, Real(low=0.0, low_open=True), "gradient normalization: added to the std"
)


class AdaptiveGradientClipping(GradientTransform):
    """Adaptive gradient clipping (AGC, Brock et al. 2021), unit-wise.

    Acts on: the full gradient, per unit (row of a ≥2-D parameter; whole ≤1-D tensor).
    State per element: 0.

    For each unit i with weight wᵢ and gradient gᵢ::

        cᵢ = λ·max(‖wᵢ‖, ε);   if ‖gᵢ‖ > cᵢ:  gᵢ ← gᵢ·cᵢ/‖gᵢ‖   (else unchanged, bit for bit)

    A zero gradient is left unchanged. Group keys: ``agc_clip`` (λ, default 1e-2; 0
    disables AGC for the group — e.g. put the output head in its own group with
    ``agc_clip=0``) and ``agc_eps`` (ε, default 1e-3; keeps zero-initialized weights
    trainable).
    """

    name = "agc"
    options = (AGC_CLIP, AGC_EPS)

    def capture_problem(self, group: Group) -> str | None:
        """None: the clipping factors are computed by device ops only, so a step can replay from a CUDA graph
        (:mod:`galore2.core.capture`)."""
        return None

    def apply_(self, grad: Tensor, group: Group, state: State, ctx: Context) -> None:
        """Clip each unit of ``grad`` in place to ``agc_clip`` times its weight's norm."""
        clip = float(AGC_CLIP.of(group))
        if clip == 0.0:
            return
        g_norm, w_norm = unit_norms([grad, ctx.param], ctx)
        limit = w_norm.clamp_min(float(AGC_EPS.of(group))).mul_(clip)
        ratio = limit / g_norm.clamp_min(torch.finfo(g_norm.dtype).tiny)
        grad.mul_(torch.where(g_norm > limit, ratio, torch.ones_like(ratio)))

    def apply_many(
        self, grads: list[Tensor], group: Group, states: list[State], ctxs: list[Context]
    ) -> None:
        """:meth:`apply_` over a batch: every unit norm of the gradients and the weights by
        one segment reduction, the clip factors spread back by one foreach multiply."""
        clip = float(AGC_CLIP.of(group))
        if clip == 0.0:
            return
        together, alone = batchable(grads, ctxs)
        for i in alone:
            self.apply_(grads[i], group, states[i], ctxs[i])
        if not together:
            return
        gs = [grads[i] for i in together]
        lay = layout(gs)
        values = lay.gather([gs, [ctxs[i].param for i in together]], acc_dtype(gs[0]))
        g_norm, w_norm = lay.reduce(values, _row_norms, copies=2)
        limit = w_norm.clamp_min(float(AGC_EPS.of(group))).mul_(clip)
        # limit/‖g‖ where ‖g‖ > limit, else 1 (as apply_): ‖g‖ = 0 gives inf and a NaN
        # norm NaN, both mapped to 1
        factor = limit.div_(g_norm).nan_to_num_(nan=1.0).clamp_max_(1.0)
        lay.scale_(values, factor, copies=2)
        torch._foreach_copy_(lay.ordered(gs), lay.views(values, copies=2))


class CentralizeGradient(GradientTransform):
    """Gradient centralization (Yong et al. 2020).

    Acts on: the full gradient of parameters with more than one dimension, per row;
    ≤1-D gradients are left untouched. State per element: 0. No group keys.

    ``gᵢ ← gᵢ − mean(gᵢ)`` with the mean over all dims but 0 (each output row gets zero
    mean). Rows are whole on each FSDP2 rank, so this is local.
    """

    name = "gc"

    def capture_problem(self, group: Group) -> str | None:
        """None: the row means are subtracted by device ops only, so a step can replay from a CUDA graph
        (:mod:`galore2.core.capture`)."""
        return None

    def apply_(self, grad: Tensor, group: Group, state: State, ctx: Context) -> None:
        """Subtract each row's mean from ``grad`` in place (≤1-D gradients unchanged)."""
        if grad.dim() < 2:
            return
        dims = tuple(range(1, grad.dim()))
        grad.sub_(grad.mean(dim=dims, keepdim=True, dtype=acc_dtype(grad)))

    def apply_many(
        self, grads: list[Tensor], group: Group, states: list[State], ctxs: list[Context]
    ) -> None:
        """:meth:`apply_` over a batch: every row mean by one segment reduction, subtracted
        by one foreach kernel."""
        gs = _batched_rest(self, [i for i, g in enumerate(grads) if g.dim() >= 2],
                           grads, group, states, ctxs)  # fmt: skip
        if not gs:
            return
        lay = layout(gs)
        values = lay.gather([gs], acc_dtype(gs[0]))
        for region in lay.regions(values):
            region.sub_(region.mean(dim=-1, keepdim=True))
        torch._foreach_copy_(lay.ordered(gs), lay.views(values))


class NormalizeGradient(GradientTransform):
    """Gradient normalization over the whole tensor.

    Acts on: the full gradient of every parameter, as one unit. State per element: 0.

    ``g ← g / (σ + eps)`` with σ the *population* standard deviation (divide by N) of all
    N = ``ctx.global_shape.numel()`` elements. Unlike the unbiased ``torch.std`` (which
    Ranger21's reference uses) it never gives NaN: an all-zero gradient stays exactly 0,
    and a one-element gradient (no spread to normalize by: σ = 0, g/eps would be 1e8·g and
    overflow float16) is left unchanged. Under FSDP each rank reduces
    [Σg, Σg², n] of its shard (Σg² from a local Welford variance, so there is no local
    cancellation) in float64, in one all-reduce. Group key: ``gn_eps`` (default 1e-8).
    """

    name = "gn"
    options = (GN_EPS,)

    def capture_problem(self, group: Group) -> str | None:
        """None: the standard deviation is computed and applied by device ops only, so a step can replay from a CUDA graph
        (:mod:`galore2.core.capture`)."""
        return None

    def apply_(self, grad: Tensor, group: Group, state: State, ctx: Context) -> None:
        """Divide ``grad`` in place by its population std plus ``gn_eps`` (global under FSDP)."""
        if ctx.global_shape.numel() <= 1:  # the same decision on every rank (no collective)
            return
        eps = float(GN_EPS.of(group))
        acc = acc_dtype(grad)
        local = grad if grad.dtype == acc else grad.to(acc)
        if not ctx.placement.distributed:
            if grad.numel() == 0:
                return
            var = torch.var_mean(local, correction=0)[0]
        else:
            n = local.numel()
            sums = torch.zeros(3, dtype=torch.float64, device=grad.device)
            if n:
                var_l, mean_l = torch.var_mean(local, correction=0)
                mean_l, var_l = mean_l.double(), var_l.double()
                sums[0], sums[1], sums[2] = mean_l * n, (var_l + mean_l * mean_l) * n, n
            total, total_sq, _ = ctx.placement.reduce(sums).unbind()
            count = max(ctx.global_shape.numel(), 1)
            mean = total / count
            var = (total_sq / count - mean * mean).clamp_min(0.0).to(acc)
            if n == 0:
                return
        grad.div_(var.sqrt().add_(eps))

    def apply_many(
        self, grads: list[Tensor], group: Group, states: list[State], ctxs: list[Context]
    ) -> None:
        """:meth:`apply_` over a batch: the means by one segment reduction, the centred
        norms by one foreach norm (σ = ‖g − mean‖/√N), the division by one foreach kernel."""
        gs = _batched_rest(self, [i for i, c in enumerate(ctxs) if c.global_shape.numel() > 1],
                           grads, group, states, ctxs)  # fmt: skip
        if not gs:
            return
        lay = layout(gs)
        values = lay.gather([gs], acc_dtype(gs[0]))
        # a tensor's rows have one width: its mean is the mean of its row means
        means = lay.tensor_reduce(lay.reduce(values, _row_means)[0], "mean")
        inverse_sqrt = lay.per_tensor(values.device, values.dtype)[1]
        centred = lay.views(values)
        torch._foreach_sub_(centred, list(means.unbind()))
        std = torch.stack(torch._foreach_norm(centred)).mul_(inverse_sqrt)
        torch._foreach_div_(lay.ordered(gs), list(std.add_(float(GN_EPS.of(group))).unbind()))


def _row_norms(region: Tensor) -> Tensor:
    return torch.linalg.vector_norm(region, dim=-1)


def _row_means(region: Tensor) -> Tensor:
    return region.mean(dim=-1)


def _batched_rest(
    module: GradientTransform, picked: list[int], grads: list[Tensor], group: Group,
    states: list[State], ctxs: list[Context],
) -> list[Tensor]:  # fmt: skip
    """Of ``grads[picked]``, those a batch can hold (see :func:`.units.batchable`); the
    others get ``module.apply_`` now, one at a time."""
    together, alone = batchable([grads[i] for i in picked], [ctxs[i] for i in picked])
    for j in alone:
        i = picked[j]
        module.apply_(grads[i], group, states[i], ctxs[i])
    return [grads[picked[j]] for j in together]
