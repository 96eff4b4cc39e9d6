"""Adam's moment estimates as a transform (``ScaleByAdam``).

Acts on: whatever direction it is given — the full gradient in a plain group,
the projected r×n (or m×r) gradient inside GaLore.
State per element of the direction: 2 values in ``state_dtype`` (``exp_avg``,
``exp_avg_sq``) plus one int64 step counter on the CPU.

The arithmetic follows ``torch.optim.AdamW``'s single-tensor path (lerp for the
first moment, bias-corrected square root in the denominator, ``eps`` added
after the correction), so a plain group matches ``torch.optim.AdamW`` to
rounding. The returned direction is ``m̂ / (√v̂ + eps)``; the optimizer scales it
by ``-lr``.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor

from .config import STATE_DTYPES
from .transform import Context, Group, State, Transform


def counter(value: int = 0) -> Tensor:
    """A scalar int64 counter on the CPU (never moved to an accelerator)."""
    return torch.tensor(value, dtype=torch.int64)


class ScaleByAdam(Transform):
    name = "adam"
    kinds: ClassVar[dict[str, str]] = {
        "adam.exp_avg": "moments",
        "adam.exp_avg_sq": "moments",
        "adam.step": "other",
    }
    linear_keys = ("adam.exp_avg",)
    quadratic_keys = ("adam.exp_avg_sq",)

    def init(
        self, shape: torch.Size, ref: Tensor, group: Group, state: State, ctx: Context
    ) -> None:
        dtype = STATE_DTYPES[group["state_dtype"]]
        state["adam.exp_avg"] = torch.zeros(shape, dtype=dtype, device=ref.device)
        state["adam.exp_avg_sq"] = torch.zeros(shape, dtype=dtype, device=ref.device)
        state["adam.step"] = counter()

    def update(self, u: Tensor, state: State, group: Group, ctx: Context) -> Tensor:
        exp_avg, exp_avg_sq = state["adam.exp_avg"], state["adam.exp_avg_sq"]
        if u.dtype != exp_avg.dtype:
            u = u.to(exp_avg.dtype)
        beta1, beta2 = group["betas"]
        state["adam.step"] += 1
        t = int(state["adam.step"])
        exp_avg.lerp_(u, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(u, u, value=1 - beta2)
        bias_correction1 = 1 - beta1**t
        bias_correction2_sqrt = math.sqrt(1 - beta2**t)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(group["eps"])
        return torch.div(exp_avg, denom).div_(bias_correction1)

    def reset(self, state: State, group: Group) -> None:
        super().reset(state, group)
        state["adam.step"].zero_()
