"""Ranger21-style learning-rate schedules for any ``torch.optim`` optimizer.

:func:`ranger21_lr` is the pure function; :class:`Ranger21Schedule` wraps it as a
``torch.optim.lr_scheduler.LRScheduler`` (so it checkpoints with torch's
``state_dict``/``load_state_dict`` and works with SGD, AdamW, galore2 optimizers…).
:class:`LinearWarmup` and :class:`WarmdownToMin` are its two halves alone.

``step`` is the number of optimizer steps already taken (0 before the first one), and
the value returned is the lr of the next step. For a group with base lr ``base``:

* **Warmup** (linear): ``lr = base · min(1, (step + 1) / W)``, so the first step uses
  ``base / W`` and step ``W − 1`` (the W-th update) the full ``base``. By default
  ``W = ⌈2 / (1 − β₂)⌉`` (2000 for β₂ = 0.999: the adaptive-lr variance rule of thumb);
  when that exceeds 45% of ``num_iterations`` it becomes ``⌈0.22 · num_iterations⌉``.
  An explicit ``warmup_iterations`` is used as given (0 = no warmup).
* **Warmdown** (explore–exploit): ``base`` until ``S = ⌊warmdown_start · num_iterations⌋``
  (72% by default), then linear to ``min_lr`` at ``step = num_iterations``, and ``min_lr``
  after. ``min_lr`` is absolute; a group with ``base ≤ min_lr`` keeps ``base``.
* Both: ``lr = min(warmup value, warmdown value)`` (they only meet when an explicit
  warmup runs into the warmdown).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from ..core.modules import LRSchedule
from ..core.options import Bool, CrossCheck, Int, Option, Optional, Real

_TOL = 1e-9  # float slack for ⌈·⌉/⌊·⌋ of values like 2/(1 − 0.999) = 1999.9999999999982


def _check(
    num_iterations: int,
    beta2: float,
    warmup_iterations: int | None,
    warmdown_start: float,
    min_lr: float,
) -> None:
    if isinstance(num_iterations, bool) or not isinstance(num_iterations, int):
        raise ValueError(f"num_iterations must be an int >= 1, got {num_iterations!r}")
    if num_iterations < 1:
        raise ValueError(f"num_iterations must be an int >= 1, got {num_iterations!r}")
    if not (isinstance(beta2, (int, float)) and 0.0 <= beta2 < 1.0):
        raise ValueError(f"beta2 must be in [0, 1), got {beta2!r}")
    if warmup_iterations is not None and (
        isinstance(warmup_iterations, bool)
        or not isinstance(warmup_iterations, int)
        or warmup_iterations < 0
    ):
        raise ValueError(
            f"warmup_iterations must be None or an int >= 0, got {warmup_iterations!r}"
        )
    if not (isinstance(warmdown_start, (int, float)) and 0.0 < warmdown_start < 1.0):
        raise ValueError(f"warmdown_start must be in (0, 1), got {warmdown_start!r}")
    if not (isinstance(min_lr, (int, float)) and math.isfinite(min_lr) and min_lr >= 0):
        raise ValueError(f"min_lr must be a finite float >= 0, got {min_lr!r}")


def warmup_length(
    num_iterations: int, *, beta2: float = 0.999, warmup_iterations: int | None = None
) -> int:
    """W: ``warmup_iterations`` if given, else ⌈2/(1 − β₂)⌉, or ⌈0.22·N⌉ if that is > 0.45·N."""
    _check(num_iterations, beta2, warmup_iterations, 0.5, 0.0)
    if warmup_iterations is not None:
        return warmup_iterations
    length = math.ceil(2.0 / (1.0 - beta2) - _TOL)
    if 100 * length > 45 * num_iterations:
        length = (22 * num_iterations + 99) // 100  # ⌈0.22·N⌉ in exact integer arithmetic
    return max(1, length)


def warmdown_start_step(num_iterations: int, warmdown_start: float = 0.72) -> int:
    """S = ⌊warmdown_start · num_iterations⌋: the last step at the full lr."""
    return math.floor(warmdown_start * num_iterations + _TOL)


def ranger21_lr(
    base_lr: float,
    step: int,
    num_iterations: int,
    *,
    beta2: float = 0.999,
    warmup: bool = True,
    warmdown: bool = True,
    warmup_iterations: int | None = None,
    warmdown_start: float = 0.72,
    min_lr: float = 3e-5,
) -> float:
    """The lr of a group with base lr ``base_lr`` after ``step`` optimizer steps."""
    _check(num_iterations, beta2, warmup_iterations, warmdown_start, min_lr)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    base = float(base_lr)
    lr = base
    if warmup:
        length = warmup_length(num_iterations, beta2=beta2, warmup_iterations=warmup_iterations)
        if length > 0:
            lr = base * min(1.0, (step + 1) / length)
    if warmdown and base > min_lr:
        start = warmdown_start_step(num_iterations, warmdown_start)
        if step > start:
            frac = min(1.0, (step - start) / (num_iterations - start))
            lr = min(lr, base - (base - min_lr) * frac)
    return lr


NUM_ITERATIONS = Option(
    "num_iterations",
    None,
    Optional(Int(low=1), "no schedule length: needs use_warmup=use_warmdown=False"),
    "the run's optimizer steps (the warmup / warmdown schedule's length)",
)
USE_WARMUP = Option("use_warmup", True, Bool(), "linear warmup of the lr")
USE_WARMDOWN = Option("use_warmdown", True, Bool(), "linear warmdown of the lr to min_lr")
WARMUP_ITERATIONS = Option(
    "warmup_iterations",
    None,
    Optional(Int(low=0), "⌈2/(1 − β₂)⌉, or ⌈0.22·num_iterations⌉ when that is > 45%"),
    "warmup length W",
)
WARMDOWN_START = Option(
    "warmdown_start",
    0.72,
    Real(low=0.0, high=1.0, low_open=True, high_open=True),
    "fraction of num_iterations at full lr before the warmdown",
)
MIN_LR = Option("min_lr", 3e-5, Real(low=0.0), "the lr the warmdown ends at (absolute)")
#: the schedule's constructor settings (switches, not group keys)
SCHEDULE_SWITCHES = (USE_WARMUP, USE_WARMDOWN, WARMUP_ITERATIONS, WARMDOWN_START, MIN_LR)


class WarmupWarmdown(LRSchedule):
    """:func:`ranger21_lr` as an optimizer's built-in schedule (Ranger21's): the group's
    ``lr`` is the peak, ``num_iterations`` a group key, β₂ the group's ``betas[1]``.

    The same schedule runs as a standalone ``LRScheduler`` (:class:`Ranger21Schedule`)."""

    name = "schedule"
    options = (NUM_ITERATIONS,)

    def __init__(
        self,
        *,
        warmup: bool = True,
        warmdown: bool = True,
        warmup_iterations: int | None = None,
        warmdown_start: float = 0.72,
        min_lr: float = 3e-5,
    ) -> None:
        _check(1, 0.0, warmup_iterations, warmdown_start, min_lr)
        self.warmup, self.warmdown = bool(warmup), bool(warmdown)
        self.settings = {
            "warmup_iterations": warmup_iterations,
            "warmdown_start": warmdown_start,
            "min_lr": min_lr,
        }
        self.checks = (CrossCheck(("num_iterations",), self._needs_iterations),)

    def _needs_iterations(self, group: Mapping[str, Any]) -> None:
        if (self.warmup or self.warmdown) and group["num_iterations"] is None:
            raise ValueError(
                "num_iterations (the run's optimizer steps) is required for the warmup / "
                "warmdown schedule; pass it, or use_warmup=False and use_warmdown=False"
            )

    def lr(self, group: dict[str, Any], step: int) -> float:
        if not (self.warmup or self.warmdown):
            return float(group["lr"])
        betas = group.get("betas")
        return ranger21_lr(
            float(group["lr"]),
            step,
            group["num_iterations"],
            beta2=betas[1] if betas is not None else 0.999,
            warmup=self.warmup,
            warmdown=self.warmdown,
            **self.settings,
        )


class Ranger21Schedule(LRScheduler):
    """:func:`ranger21_lr` as an ``LRScheduler``; each group follows its own base lr.

    Call ``scheduler.step()`` after every ``optimizer.step()``. ``beta2`` defaults to
    ``optimizer.param_groups[0]["betas"][1]`` when the optimizer has betas, else 0.999.
    Every setting and the step counter are in :meth:`state_dict` (torch's), so a resumed
    run continues with the same lrs.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        num_iterations: int,
        *,
        beta2: float | None = None,
        warmup: bool = True,
        warmdown: bool = True,
        warmup_iterations: int | None = None,
        warmdown_start: float = 0.72,
        min_lr: float = 3e-5,
        last_epoch: int = -1,
    ) -> None:
        if beta2 is None:
            betas = optimizer.param_groups[0].get("betas") if optimizer.param_groups else None
            beta2 = float(betas[1]) if betas is not None else 0.999
        _check(num_iterations, beta2, warmup_iterations, warmdown_start, min_lr)
        self.settings: dict[str, Any] = {
            "num_iterations": num_iterations,
            "beta2": beta2,
            "warmup": bool(warmup),
            "warmdown": bool(warmdown),
            "warmup_iterations": warmup_iterations,
            "warmdown_start": warmdown_start,
            "min_lr": min_lr,
        }
        super().__init__(optimizer, last_epoch)

    def lr_at(self, base_lr: float, step: int) -> float:
        """The lr of a group with base lr ``base_lr`` after ``step`` steps, with these settings."""
        s = dict(self.settings)
        group = {
            "lr": base_lr,
            "num_iterations": s.pop("num_iterations"),
            "betas": (0.0, s.pop("beta2")),
        }
        return WarmupWarmdown(**s).lr(group, step)

    def get_lr(self) -> list[float]:
        """Every group's lr for the current step (``last_epoch``), from its base lr."""
        return [self.lr_at(float(base), self.last_epoch) for base in self.base_lrs]

    _get_closed_form_lr = get_lr


class LinearWarmup(Ranger21Schedule):
    """Only the warmup of :class:`Ranger21Schedule` (constant base lr afterwards)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        num_iterations: int,
        *,
        beta2: float | None = None,
        warmup_iterations: int | None = None,
        last_epoch: int = -1,
    ) -> None:
        super().__init__(
            optimizer,
            num_iterations,
            beta2=beta2,
            warmdown=False,
            warmup_iterations=warmup_iterations,
            last_epoch=last_epoch,
        )


class WarmdownToMin(Ranger21Schedule):
    """Only the warmdown of :class:`Ranger21Schedule`: base lr, then linear to ``min_lr``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        num_iterations: int,
        *,
        warmdown_start: float = 0.72,
        min_lr: float = 3e-5,
        last_epoch: int = -1,
    ) -> None:
        super().__init__(
            optimizer,
            num_iterations,
            warmup=False,
            warmdown_start=warmdown_start,
            min_lr=min_lr,
            last_epoch=last_epoch,
        )


__all__ = [
    "LinearWarmup",
    "Ranger21Schedule",
    "WarmdownToMin",
    "WarmupWarmdown",
    "ranger21_lr",
    "warmdown_start_step",
    "warmup_length",
]
