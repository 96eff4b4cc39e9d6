"""Divergence made visible: skipped updates in the log, a loud warning, and a stop.

galore2 optimizers skip a parameter's update when its gradient holds a NaN or an Inf and
count the skip (``optimizer.nonfinite_skips``: CPU counters, reading them is no device
sync). A run whose updates are mostly skipped keeps a flat, finite-looking loss, so the
recipe, through :class:`SkipWatch`:

* writes ``nonfinite_skips`` (cumulative, restored on resume) and
  ``nonfinite_skips_window`` (since the previous row) into every ``metrics.jsonl`` row,
  and the total into the summary;
* warns (``RuntimeWarning``, rank 0) when a step skips updates after one that did not,
  and at every log step whose window skipped any;
* stops the run after ``train.max_skip_steps`` consecutive steps that each skipped at
  least one update (0: never), with a :class:`Diverged` error naming the step and the
  likely causes. The recipe logs that step and writes the summary before raising.

Optimizers without the counter (torch AdamW, the peers) let a NaN through instead; the
loss row then shows it (``NaN``/``Infinity``) and :class:`recipes.metrics.Metrics` warns.

Under torchrun the optimizer's skip decision is already the same on every rank (its
finiteness flags are all-reduced); the stop decision is made the same everywhere too,
by one scalar all-reduce (MAX) of the streak per step, only when world > 1 and
``max_skip_steps`` > 0.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist


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
    """Follows ``optimizer.nonfinite_skips`` step by step; see the module docstring.

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
    ) -> None:
        self.optimizer = optimizer
        self.enabled = hasattr(optimizer, "nonfinite_skips")
        self.max_skip_steps = max_skip_steps
        self.rank, self.world, self.device = rank, world, device
        self.causes = causes
        self.updates_per_step = sum(len(g["params"]) for g in optimizer.param_groups)
        self.total = self._read()  # a resumed run starts from the checkpoint's count
        self.window = 0
        self.window_start: int | None = None  # first step of the current log window
        self.streak = 0  # consecutive steps, up to the last one, that skipped any update

    def _read(self) -> int:
        return int(self.optimizer.nonfinite_skips) if self.enabled else 0

    def _warn(self, message: str) -> None:
        if self.rank == 0:
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def after_step(self, step: int) -> str | None:
        """Count this step's skips; the reason to stop (the same on every rank), or None."""
        if not self.enabled:
            return None
        if self.window_start is None:
            self.window_start = step
        total = self._read()
        new, self.total = total - self.total, total
        self.window += new
        self.streak = self.streak + 1 if new else 0
        if new and self.streak == 1:
            self._warn(
                f"step {step}: {new} of {self.updates_per_step} parameter updates skipped "
                "because their gradients are not finite (NaN/Inf); counted in "
                "metrics.jsonl as nonfinite_skips"
            )
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

    def fields(self, step: int) -> dict[str, int]:
        """The metrics row's fields for the window ending at ``step``; starts a new window."""
        if not self.enabled:
            return {}
        out = {"nonfinite_skips": self.total, "nonfinite_skips_window": self.window}
        if self.window:
            self._warn(
                f"steps {self.window_start}-{step}: {self.window} parameter updates skipped "
                f"for non-finite gradients ({self.total} in all, "
                f"{self.updates_per_step} updates per step)"
            )
        self.window, self.window_start = 0, None
        return out
