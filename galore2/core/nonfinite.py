"""The non-finite gradient policy, in one place: the step is check → chain → apply.

A group's ``nonfinite`` option says what happens to a parameter whose gradient holds a
NaN or an Inf:

* ``"skip"`` (default): the parameter and its state are left untouched this step and the
  skip is counted in the state (``nonfinite.skips``; :attr:`ChainOptimizer.nonfinite_skips`).
  A built-in LR schedule's counter (``schedule.step``, Ranger21's) still ticks: it is the
  group's clock, not a statistic of the parameter;
* ``"raise"``: ``FloatingPointError`` naming the parameters' shapes, raised by
  :meth:`NonFinitePolicy.raise_if_any` before *any* parameter changes (``step()`` looks at
  every gradient first; a per-layer update looks at its one parameter);
* ``"ignore"``: no look at all (NaN propagates, as in ``torch.optim.AdamW``).

The decision is made on the gradient as the moment chain will see it (after the
gradient modules: AGC, centralization, normalization), before the chain runs, so no
transform ever sees a non-finite input and none needs to check. For a sharded
parameter the decision is the whole gradient's: each rank's flags are combined in one
all-reduce, so every rank skips — or raises — together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from torch import Tensor

from .._numerics import finite_flags
from ..placement import Placement
from .options import Choice, Option

NONFINITE = Option(
    "nonfinite",
    "skip",
    Choice(("skip", "raise", "ignore")),
    "a NaN/Inf gradient: skip that parameter's update (counted), raise before any "
    "change, or ignore (no check)",
)

SKIPS = "nonfinite.skips"  # the state key counting a parameter's skipped updates


def finite_everywhere(grads: Sequence[Tensor], placements: Sequence[Placement]) -> list[bool]:
    """Per local gradient: is the whole (global) gradient finite? Sharded parameters agree
    through one all-reduce of their flags; call it on every rank together."""
    ok = finite_flags(list(grads))
    sharded = [i for i, p in enumerate(placements) if p.distributed]
    if sharded:
        bad = placements[sharded[0]].any_global([not ok[i] for i in sharded])
        for i, b in zip(sharded, bad, strict=True):
            ok[i] = not b
    return ok


class NonFinitePolicy:
    """Decides which parameters of a step are updated; see the module docstring."""

    options: ClassVar[tuple[Option, ...]] = (NONFINITE,)
    kinds: ClassVar[dict[str, str]] = {SKIPS: "other"}

    @staticmethod
    def raise_if_any(
        groups: Sequence[dict[str, Any]],
        items: Callable[[dict[str, Any]], Sequence[tuple[Tensor, Tensor, Placement]]],
    ) -> None:
        """``nonfinite="raise"``: look at every gradient of those groups before any change.

        ``items(group)`` gives (parameter, gradient, placement) of each parameter to step."""
        for group in groups:
            if group["nonfinite"] != "raise":
                continue
            found = items(group)
            ok = finite_everywhere([pl.local(g) for _, g, pl in found], [pl for *_, pl in found])
            bad = [tuple(p.shape) for (p, _, _), f in zip(found, ok, strict=True) if not f]
            if bad:
                raise FloatingPointError(
                    f"non-finite gradient in parameters of shape {bad} (nonfinite='raise'); "
                    "use nonfinite='skip' to skip such updates instead"
                )

    @staticmethod
    def keep(
        group: dict[str, Any],
        grads: Sequence[Tensor],
        placements: Sequence[Placement],
        states: Sequence[dict[str, Tensor]],
    ) -> list[bool]:
        """Which of a group's parameters to update: False for a non-finite gradient, whose
        skip is counted in its state. ``"raise"`` groups were checked before the step
        (a gradient module producing NaN is then skipped, like ``"skip"``)."""
        if group["nonfinite"] == "ignore":
            return [True] * len(grads)
        ok = finite_everywhere(grads, placements)
        for state, f in zip(states, ok, strict=True):
            if not f:
                state[SKIPS] += 1
        return ok
