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
On CUDA with triton installed (see :mod:`galore2.kernels.dispatch`, ``GALORE2_KERNELS``)
that step is one fused Triton kernel (:mod:`galore2.kernels.adam8bit`) with the same
arithmetic and block layout; its quantizer picks the exact nearest code (bitsandbytes' CPU
quantizer is off by a code or more on a few percent of elements). Quantized moments are
always updated in fp32 (``state_dtype`` does not apply to them); small directions keep
``state_dtype`` moments and match the default exactly.

The arithmetic follows ``torch.optim.AdamW``'s single-tensor path (lerp for the
first moment, bias-corrected square root in the denominator, ``eps`` added
after the correction), so a plain group matches ``torch.optim.AdamW`` to
rounding. The returned direction is ``m̂ / (√v̂ + eps)``; the optimizer scales it
by ``-lr``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..core.options import Option, Pair, Real
from ..core.state import counter
from ..core.transform import Context, Group, State, Transform
from ..kernels.dispatch import run_kernel
from ..storage import dynamic8
from ..storage.dtype import STATE_DTYPE, warn_float16
from ..storage.dynamic8 import Dynamic8Format
from ..storage.moments import (
    check_moments,
    is_quantized,
    moment_format,
    moment_kinds,
    reset_moments,
    rotate_moments,
    stored_format,
)

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


AXIS = "adam.block_dim"  # the blocked axis of both 8-bit moments (same shape and layout)


class ScaleByAdam(Transform):
    """Adam's moments; ``moments`` picks their storage (``"state_dtype"`` or ``"dynamic8"``,
    see the module docstring)."""

    name = "adam"
    options = (BETAS, EPS, STATE_DTYPE)
    # ScaleByAdam8bit kept its moments under ``adam8.*`` before storage formats were shared
    renamed_keys: ClassVar[dict[str, str]] = {
        f"adam8.{k}": f"adam.{k}"
        for k in ("exp_avg", "exp_avg.absmax", "exp_avg_sq", "exp_avg_sq.absmax", "block_dim")
    }
    kinds: ClassVar[dict[str, str]] = {
        **moment_kinds("adam.exp_avg", "adam.exp_avg_sq", axis=AXIS),
        "adam.step": "other",
    }
    linear_keys = ("adam.exp_avg",)
    quadratic_keys = ("adam.exp_avg_sq",)

    def __init__(self, *, moments: str = "state_dtype") -> None:
        self.moments = check_moments(moments)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(moments={self.moments!r})"

    def complex_problem(self, group: Group) -> str | None:
        """Adam is elementwise: on a complex parameter's real view it is
        ``torch.optim.AdamW``'s complex Adam (which uses that view too)."""
        if self.moments != "state_dtype":
            return "8-bit moments are not defined for complex parameters"
        return None

    def init(
        self, shape: torch.Size, ref: Tensor, group: Group, state: State, ctx: Context
    ) -> None:
        def zeros(s: tuple[int, ...], dtype: torch.dtype, layout: str) -> Tensor:
            return ctx.placement.zeros(s, dtype, ctx.param.device, layout)

        warn_float16(group, ctx.warn_once)
        for key, signed in (("adam.exp_avg", True), ("adam.exp_avg_sq", False)):
            fmt = moment_format(
                self.moments, tuple(shape), ctx.layout, group["state_dtype"], signed
            )
            fmt.allocate(state, key, tuple(shape), ctx.layout, zeros, AXIS)
        state["adam.step"] = counter()

    def update(self, u: Tensor, state: State, group: Group, ctx: Context) -> Tensor:
        if not is_quantized(state, "adam.exp_avg"):
            return self._step(u, state["adam.exp_avg"], state["adam.exp_avg_sq"], state, group)
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
            supported=lambda k: k.supported(u),
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
        if out is not None:  # the kernel updated codes and absmax in place
            state["adam.step"] += 1
            return out
        if dynamic8.use_torch(m_codes):  # the CPU: chunk by chunk, see _update_chunks
            return self._update_chunks(u, m_fmt, v_fmt, state, group)
        m = m_fmt.view(state, "adam.exp_avg", AXIS)
        v = v_fmt.view(state, "adam.exp_avg_sq", AXIS)
        out = self._step(u, m, v, state, group)  # the direction uses the fp32 moments
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
        arithmetic, codes and absmax updated in place, the fp32 direction returned (the
        caller counts the step once it ran; see ``dispatch.run_kernel``)."""
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
        u: Tensor, m_fmt: Dynamic8Format, v_fmt: Dynamic8Format, state: State, group: Group
    ) -> Tensor:
        """The 8-bit torch path on the CPU (where the storage layer quantizes in torch), in
        chunks of ~2^20 elements of whole blocks (:func:`~galore2.storage.dynamic8.row_chunks`):
        each chunk's moments are dequantized, stepped and requantized while in cache and its
        direction written into the fp32 result — the same elementwise arithmetic as
        :meth:`_step` on whole fp32 moments, with no full-size fp32 copy of either moment."""
        m_codes, m_absmax, dim = m_fmt.local(state, "adam.exp_avg", AXIS)
        v_codes, v_absmax, _ = v_fmt.local(state, "adam.exp_avg_sq", AXIS)
        rows = m_codes.shape[0]
        qm, qv, u2 = m_codes.view(rows, -1), v_codes.view(rows, -1), u.reshape(rows, -1)
        out = torch.empty(u2.shape, dtype=torch.float32, device=u.device)
        state["adam.step"] += 1
        t = int(state["adam.step"])
        for r, b in dynamic8.row_chunks(rows, qm.shape[1], dim):
            m = dynamic8.dequantize(qm[r], m_absmax[b], dim, m_fmt.signed)
            v = dynamic8.dequantize(qv[r], v_absmax[b], dim, v_fmt.signed)
            ScaleByAdam._arith(u2[r], m, v, t, group, out=out[r])
            dynamic8.quantize_(m, qm[r], m_absmax[b], dim, m_fmt.signed)
            dynamic8.quantize_(v, qv[r], v_absmax[b], dim, v_fmt.signed)
        return out.view(u.shape)

    @staticmethod
    def _step(u: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, state: State, group: Group) -> Tensor:
        """One Adam step on the moments ``exp_avg``, ``exp_avg_sq`` (updated in place)."""
        state["adam.step"] += 1
        return ScaleByAdam._arith(u, exp_avg, exp_avg_sq, int(state["adam.step"]), group)

    @staticmethod
    def _arith(
        u: Tensor,
        exp_avg: Tensor,
        exp_avg_sq: Tensor,
        t: int,
        group: Group,
        out: Tensor | None = None,
    ) -> Tensor:
        """Step ``t`` of Adam's arithmetic on the moments (updated in place); the direction
        goes to ``out`` when given."""
        if u.dtype != exp_avg.dtype:
            u = u.to(exp_avg.dtype)
        beta1, beta2 = group["betas"]
        exp_avg.lerp_(u, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(u, u, value=1 - beta2)
        bias_correction1 = 1 - beta1**t
        bias_correction2_sqrt = math.sqrt(1 - beta2**t)
        # m̂/(√v̂ + eps) = m / (bc1·√v/√bc2 + bc1·eps): both corrections folded into one
        # denominator, computed in a single buffer that then receives the result.
        denom = torch.sqrt(exp_avg_sq, out=out).mul_(bias_correction1 / bias_correction2_sqrt)
        denom.add_(bias_correction1 * group["eps"])
        return torch.div(exp_avg, denom, out=denom)

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
            results = self._foreach([us[i] for i in plain], [states[i] for i in plain], group)
            for i, r in zip(plain, results, strict=True):
                out[i] = r
        for i, (u, state, ctx) in enumerate(zip(us, states, ctxs, strict=True)):
            if out[i] is None:
                out[i] = self.update(u, state, group, ctx)
        return out  # type: ignore[return-value]

    @staticmethod
    def _foreach(us: list[Tensor], states: list[State], group: Group) -> list[Tensor]:
        beta1, beta2 = group["betas"]
        exp_avgs = [s["adam.exp_avg"] for s in states]
        exp_avg_sqs = [s["adam.exp_avg_sq"] for s in states]
        us = [u if u.dtype == m.dtype else u.to(m.dtype) for u, m in zip(us, exp_avgs, strict=True)]
        scale, shift = [], []
        for s in states:  # steps may differ per tensor (reset, parameters added later)
            s["adam.step"] += 1
            t = int(s["adam.step"])
            bias_correction1 = 1 - beta1**t
            scale.append(bias_correction1 / math.sqrt(1 - beta2**t))
            shift.append(bias_correction1 * group["eps"])
        torch._foreach_lerp_(exp_avgs, us, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, us, us, value=1 - beta2)
        denoms = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_mul_(denoms, scale)
        torch._foreach_add_(denoms, shift)
        return list(torch._foreach_div(exp_avgs, denoms))

    def bias_correction(self, state: State, group: Group) -> float:
        beta1, beta2 = group["betas"]
        t = int(state["adam.step"])
        return math.sqrt(1 - beta2**t) / (1 - beta1**t) if t > 0 else 1.0

    def second_moment_sum(self, state: State, group: Group) -> Tensor | None:
        t = int(state["adam.step"])
        if t == 0:
            return torch.zeros((), dtype=torch.float64)
        v = stored_format(state, "adam.exp_avg_sq", False).view(state, "adam.exp_avg_sq", AXIS)
        return v.sum(dtype=torch.float64) / (1 - group["betas"][1] ** t)

    def reset(self, state: State, group: Group) -> None:
        reset_moments(state, (*self.linear_keys, *self.quadratic_keys))
        state["adam.step"].zero_()

    def rotate(self, state: State, rotate_fn: Callable[[Tensor, bool], Tensor]) -> None:
        rotate_moments(state, self.linear_keys, self.quadratic_keys, rotate_fn, AXIS)
