"""What the rules with first and second moments share (Adam, PNM): :class:`MomentRule`.

Such a rule keeps first moments (its ``linear_keys``: rotated like the direction, stored
with the signed map when 8-bit) and second moments (its ``quadratic_keys``: rotated with
squared coefficients and clamped at 0, the unsigned map), all of the direction's shape, in
the storage its ``moments`` picks (:mod:`galore2.storage.moments`), and one int64 step
counter (``<name>.step``: on the CPU; with ``capturable=True`` on the direction's device).
The mixin creates that state, counts the step (:meth:`MomentRule.count_step` for one
direction, :meth:`MomentRule.count_steps` for a batch: the only places the counter
advances), resets and rotates the moments at a GaLore refresh and sums the bias-corrected
second moment for stable weight decay's σ. Each rule keeps its own arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor

from ..core.counters import Counters
from ..core.module import Context, Group, State
from ..core.state import counter, counter_on
from ..storage.dtype import warn_float16
from ..storage.moments import (
    check_moments,
    moment_format,
    moment_kinds,
    moments_capture_problem,
    reset_moments,
    rotate_moments,
    stored_format,
)

_CPU = torch.device("cpu")


def bias_correction(beta: float | Tensor, t: int | Tensor) -> float | Tensor:
    """1 − βᵗ, the bias correction of an exponential moving average with decay ``beta``
    after ``t`` updates from zero: a Python float for a host count; for counts held in a
    tensor (device counters, ``capturable=True``) a tensor by ``torch.pow`` and ``rsub`` on
    their device (float64 when ``t`` or ``beta`` is). The one spelling of the correction for
    every moment rule (Adam, PNM, this mixin)."""
    if isinstance(t, Tensor):
        return torch.rsub(torch.pow(beta, t), 1)
    return 1 - beta**t


def moment_rule_kinds(name: str, *moments: str) -> dict[str, str]:
    """The accounting kinds of a moment rule ``name``'s state: its ``moments`` (suffixes of
    ``name.``) in any storage, their shared blocked axis and the step counter."""
    return {
        **moment_kinds(*(f"{name}.{m}" for m in moments), axis=f"{name}.block_dim"),
        f"{name}.step": "other",
    }


class MomentRule:
    """Mixin of a :class:`~galore2.core.transform.Transform` with first and second moments
    (listed first in the bases; see the module docstring).

    A rule declares ``linear_keys`` and ``quadratic_keys`` (the moments), and sets
    :attr:`label`, :attr:`step_key`, :attr:`second_key` and :attr:`axis`.
    """

    #: the rule's name in messages ("Adam")
    label: ClassVar[str] = "moment rule"
    #: its step counter
    step_key: ClassVar[str] = ""
    #: the second moment whose bias-corrected sum :meth:`second_moment_sum` returns
    second_key: ClassVar[str] = ""
    #: the blocked axis of its 8-bit moments (one for all: same shape and layout)
    axis: ClassVar[str] = ""
    linear_keys: ClassVar[tuple[str, ...]] = ()
    quadratic_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *, moments: str = "state_dtype") -> None:
        self.moments = check_moments(moments)
        self._counters = Counters()  # host step counters packed per batch

    def capture_problem(self, group: Group) -> str | None:
        """Why a step of this rule cannot replay from a CUDA graph (None: it can; see
        :mod:`galore2.core.capture`): 8-bit moments quantize through host-side paths."""
        return moments_capture_problem(self.moments, self.label)

    def moment_keys(self) -> tuple[tuple[str, bool], ...]:
        """(moment key, signed) of every moment this rule keeps: the first moments (signed)
        then the second ones."""
        return (
            *((key, True) for key in self.linear_keys),
            *((key, False) for key in self.quadratic_keys),
        )

    def init(
        self, shape: torch.Size, ref: Tensor, group: Group, state: State, ctx: Context
    ) -> None:
        """Create every moment (in the storage ``moments`` picks) and the step counter."""

        def zeros(s: tuple[int, ...], dtype: torch.dtype, layout: str) -> Tensor:
            return ctx.placement.zeros(s, dtype, ctx.param.device, layout)

        warn_float16(group, ctx.warn_once)
        for key, signed in self.moment_keys():
            fmt = moment_format(
                self.moments, tuple(shape), ctx.layout, group["state_dtype"], signed
            )
            fmt.allocate(state, key, tuple(shape), ctx.layout, zeros, self.axis)
        # capturable: counted on the parameters' device (see count_step)
        state[self.step_key] = (
            counter_on(counter(), ctx.param.device) if group.get("capturable") else counter()
        )

    def count_step(self, state: State, group: Group, device: torch.device) -> int | Tensor:
        """Count a step of one direction and return the new count ``t``: a Python int read
        from the CPU counter, or with ``capturable=True`` the counter itself, kept on
        ``device`` (what depends on ``t`` is then computed there: a capturable step reads
        nothing on the host). A counter on the wrong side (a checkpoint loads 0-d integers
        onto the CPU; a group's ``capturable`` changed) is moved once."""
        key = self.step_key
        if group.get("capturable"):
            t = state[key] = counter_on(state[key], device)
            return t.add_(1)
        t = state[key] = counter_on(state[key], _CPU)
        t += 1
        return int(t)

    def count_steps(
        self, states: list[State], group: Group, device: torch.device
    ) -> list[int] | Tensor:
        """Count a step of each of a batch's directions (``states``: plain states, not
        stacked entries) and return the new counts: Python ints read from the CPU counters
        (one add and one read when packed), or with ``capturable=True`` a 1-D int64 tensor
        on ``device`` (the packed counters themselves, else a stack of them)."""
        if group.get("capturable"):
            packed = self._packed_steps(states, device)
            if packed is not None:  # one add for the batch's counters
                return packed.add_(1)
            steps = [s[self.step_key] for s in states]
            torch._foreach_add_(steps, 1)
            return torch.stack(steps)
        packed = self._packed_steps(states, _CPU)
        if packed is not None:  # host counters: one add, one read
            return packed.add_(1).tolist()
        # shared counters (the same tensor in two states): one by one
        return self._counters.advance(states, self.step_key)

    def _packed_steps(self, states: list[State], device: torch.device) -> Tensor | None:
        """The step counters of ``states`` packed on ``device`` (the CPU: host counters;
        capturable: the parameters' device), counters on the other side moved there first
        (a group's ``capturable`` changed, a checkpoint loaded them onto the CPU); None
        when two states share a counter."""
        key = self.step_key
        packed = self._counters.packed(states, key, device)
        if packed is None:
            for s in states:
                s[key] = counter_on(s[key], device)
            packed = self._counters.packed(states, key, device)
        return packed

    def second_moment_sum(self, state: State, group: Group) -> Tensor | None:
        """Σ v / (1 − β₂ᵗ) of the second moment :attr:`second_key` in float64 (0 before the
        first step)."""
        key = self.second_key
        if group.get("capturable"):  # a device counter: no host read
            v = stored_format(state, key, False).view(state, key, self.axis)
            td = state[self.step_key].to(torch.float64)
            total = v.sum(dtype=torch.float64) / bias_correction(group["betas"][1], td)
            return total.masked_fill_(td.eq(0), 0.0)
        t = int(state[self.step_key])
        if t == 0:
            return torch.zeros((), dtype=torch.float64)
        v = stored_format(state, key, False).view(state, key, self.axis)
        return v.sum(dtype=torch.float64) / bias_correction(group["betas"][1], t)

    def reset(self, state: State, group: Group) -> None:
        """Zero every moment and the step counter."""
        reset_moments(state, (*self.linear_keys, *self.quadratic_keys))
        state[self.step_key].zero_()

    def rotate(self, state: State, rotate_fn: Callable[[Tensor, bool], Tensor]) -> None:
        """Rotate the first moments linearly, the second ones with squared coefficients
        (clamped at 0), whatever their storage."""
        rotate_moments(state, self.linear_keys, self.quadratic_keys, rotate_fn, self.axis)


__all__ = ["MomentRule", "bias_correction", "moment_rule_kinds"]
