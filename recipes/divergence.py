"""Divergence made visible: skipped updates in the log, a loud warning, and a stop.

galore2 optimizers skip a parameter's update when its gradient holds a NaN or an Inf and
count the skip (``optimizer.nonfinite_skips``; each parameter's count is in its state,
``nonfinite.skips``). With ``capturable=True`` the skips are counted on the device and
reading them is a host sync, so :class:`SkipWatch` reads them at log steps only (issue
38), never per step. A run whose updates are mostly skipped keeps a flat, finite-looking
loss, so the recipe, through :class:`SkipWatch`:

* writes ``nonfinite_skips`` (cumulative, restored on resume) and
  ``nonfinite_skips_window`` (since the previous row) into every ``metrics.jsonl`` row,
  and the total into the summary;
* warns (``RuntimeWarning``, rank 0) at every log step whose window skipped any update
  (the first such window after one that skipped none says why, in full);
* stops the run after ``train.max_skip_steps`` consecutive steps that each skipped at
  least one update (0: never), with a :class:`Diverged` error naming the step and the
  likely causes. The recipe logs that step and writes the summary before raising.

The streak is counted in whole log windows, from the counters read at log steps: a window
of n steps extends it by n when some parameter's update was skipped at every one of its n
steps (its count rose by n: then every step of the window skipped an update, so a run is
never stopped for a streak it did not have); any other window ends it (one without skips,
or one whose skips came at some of its steps only). The stop is decided at log steps.
With ``train.log_every 1`` this is exactly "N consecutive skipping steps"; with longer
windows the stop comes at the first log step where the streak has reached N, at most one
window later than a per-step count would stop (and a streak broken inside a window, or
whose skipping steps took turns between parameters, starts again at the next window).

Optimizers without the counter (torch AdamW, the peers) let a NaN through instead; the
loss row then shows it (``NaN``/``Infinity``) and :class:`recipes.metrics.Metrics` warns.

Under torchrun the optimizer's skip decision is already the same on every rank (its
finiteness flags are all-reduced); the stop decision is made the same everywhere too,
by one scalar all-reduce (MAX) of the streak per log step, only when world > 1 and
``max_skip_steps`` > 0.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from galore2.core.nonfinite import SKIPS


class Diverged(RuntimeError):
    """Training stopped: parameter updates kept being skipped (``train.max_skip_steps``)."""


def likely_causes(lr: float, scale: float) -> str:
    return (
        f"likely causes: the learning rate is too high (optim.lr={lr:g}), the GaLore scale "
        f"is too large (optim.scale={scale:g}), or the data holds something that makes the "
        "loss non-finite"
    )


def _max_over_ranks(value: int, device: torch.device) -> int:
    on = torch.device("cpu") if dist.get_backend() == "gloo" else device
    t = torch.tensor([value], dtype=torch.int64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


class SkipWatch:
    """Follows ``optimizer.nonfinite_skips`` from one log step to the next; see the module
    docstring.

    ``start_step``: the step the run starts after (a resumed run's checkpoint step).
    ``causes`` ends the stop message (:func:`likely_causes`). With an optimizer that has
    no ``nonfinite_skips`` the watch does nothing and adds no fields.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        max_skip_steps: int,
        *,
        rank: int,
        world: int,
        device: torch.device,
        causes: str = "",
        start_step: int = 0,
    ) -> None:
        self.optimizer = optimizer
        # asked of the class: hasattr on the instance would read the property (a sync)
        self.enabled = hasattr(type(optimizer), "nonfinite_skips") or (
            "nonfinite_skips" in getattr(optimizer, "__dict__", {})
        )
        self.max_skip_steps = max_skip_steps
        self.rank, self.world, self.device = rank, world, device
        self.causes = causes
        self.updates_per_step = sum(len(g["params"]) for g in optimizer.param_groups)
        self.total = self._read()  # a resumed run starts from the checkpoint's count
        self._each = self._per_param() if self.enabled else []
        self.logged = start_step  # the last step of the previous window
        self.streak = 0  # consecutive steps, up to the last log step, that skipped an update
        self._skipping = False  # the previous window skipped any update

    def _read(self) -> int:
        """The cumulative count: one host read with ``capturable=True`` (log steps only)."""
        return int(self.optimizer.nonfinite_skips) if self.enabled else 0

    def _per_param(self) -> list[int]:
        """Each parameter's cumulative count (host integers, after :meth:`_read`)."""
        state = getattr(self.optimizer, "state", {})
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return [int(s[SKIPS]) if SKIPS in s else 0 for s in (state.get(p, {}) for p in params)]

    def _warn(self, message: str) -> None:
        if self.rank == 0:
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def at_log(self, step: int) -> tuple[dict[str, int], str | None]:
        """The metrics row's fields for the window ending at ``step`` (``{}`` without a
        counter) and the reason to stop (the same on every rank), or None; starts a new
        window. The only place the counters are read."""
        if not self.enabled:
            return {}, None
        steps, first = step - self.logged, self.logged + 1
        self.logged = step
        total = self._read()
        window, self.total = total - self.total, total
        every_step = False
        if window:
            each = self._per_param()
            every_step = max((b - a for a, b in zip(self._each, each, strict=False)),
                             default=0) >= steps  # fmt: skip
            self._each = each
            if not self._skipping:
                self._warn(
                    f"steps {first}-{step}: {window} of {self.updates_per_step * steps} "
                    "parameter updates skipped because their gradients are not finite "
                    "(NaN/Inf); counted in metrics.jsonl as nonfinite_skips"
                )
            else:
                self._warn(
                    f"steps {first}-{step}: {window} parameter updates skipped "
                    f"for non-finite gradients ({self.total} in all, "
                    f"{self.updates_per_step} updates per step)"
                )
        self._skipping = bool(window)
        self.streak = self.streak + steps if every_step else 0
        fields = {"nonfinite_skips": self.total, "nonfinite_skips_window": window}
        return fields, self._stop(step)

    def _stop(self, step: int) -> str | None:
        if not self.max_skip_steps:
            return None
        streak = self.streak
        if self.world > 1:
            streak = _max_over_ranks(streak, self.device)
        if streak < self.max_skip_steps:
            return None
        return (
            f"training diverged at step {step}: the last {streak} steps "
            f"(train.max_skip_steps={self.max_skip_steps}) each skipped parameter updates for "
            f"non-finite (NaN/Inf) gradients, {self.total} skipped so far; {self.causes} "
            "(train.max_skip_steps 0 never stops)"
        )
