"""The one way the step benchmarks time a call: per device, per model shape, per contender.

Every step-timing task (``step_time``, ``adafactor_step``, ``compile_step``, ``overhead``,
``gpu_step``, ``kernels``, ``refresh``) times through here; ``step_counts`` counts instead
of timing, on the same models (:func:`llama`) and gradients (:func:`seeded_grads`).

* **A call** (:func:`time_calls`): ``warmup`` untimed calls, then ``repeats`` calls, each
  timed on its own. On the CPU: ``time.perf_counter`` around the call. On a CUDA device:
  CUDA events around the call on the current stream, no host synchronization between calls
  (one after the last), so a call's time is the device's, launch gaps included; with
  ``flush_bytes`` a buffer of that size is zeroed before each call, so no input is served
  from L2. Seconds per call.
* **Steps of several contenders** (:func:`time_steps`): every contender built and warmed up
  (``warmup`` untimed steps each: the first creates state and the bases), then ``rounds``
  rounds in which each contender takes ``per_round`` timed steps in turn, so background
  load hits all of them alike (``interleave``). Contenders too big to be alive together
  (Llama-7B shapes on one GPU) are timed ``interleave=False``: one at a time, built, warmed
  up, timed for ``rounds × per_round`` steps and freed; one that cannot run there gives
  the exception instead of times.
* **Models and gradients**: the recipe's Llama (:func:`llama`: ``recipes.model.build_model``
  of a :class:`~recipes.config.ModelConfig`, seeded, on ``device``) and fixed seeded
  gradients assigned to ``.grad`` once (:func:`seeded_grads`).

Report medians (:func:`median_ms`) and ratios against a baseline timed in the same call.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from recipes.config import ModelConfig
from recipes.model import build_model

Call = Callable[[], Any]

__all__ = ["Call", "llama", "median_ms", "seeded_grads", "time_calls", "time_steps"]


def llama(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int = 0) -> nn.Module:
    """The recipe's Llama of ``cfg``'s shapes, initialized from ``seed``, on ``device``."""
    torch.manual_seed(seed)
    return build_model(cfg, device=device)


def seeded_grads(model: nn.Module, seed: int = 1, scale: float = 1e-2) -> None:
    """Fixed gradients: ``scale`` × standard normal values from a generator seeded with
    ``seed`` on the parameters' device, drawn in parameter order."""
    gen = None
    for p in model.parameters():
        if gen is None:
            gen = torch.Generator(device=p.device).manual_seed(seed)
        p.grad = torch.randn(p.shape, generator=gen, device=p.device).mul_(scale)


def time_calls(
    fn: Call,
    repeats: int,
    warmup: int = 0,
    device: str | torch.device = "cpu",
    flush_bytes: int = 0,
) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones (the
    module's docstring: host clock on the CPU, CUDA events on a CUDA device)."""
    for _ in range(warmup):
        fn()
    if torch.device(device).type != "cuda":
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
        return out
    flush = torch.empty(flush_bytes // 4, dtype=torch.int32, device=device) if flush_bytes else None
    torch.cuda.synchronize(device)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(repeats)
    ]
    for start, end in events:
        if flush is not None:
            flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def time_steps(
    contenders: Mapping[str, Callable[[], Call]],
    rounds: int,
    per_round: int,
    warmup: int,
    device: str | torch.device = "cpu",
    interleave: bool = True,
    after: Callable[[str, Call], None] | None = None,
) -> dict[str, list[float] | Exception]:
    """Seconds of each timed step per contender (``contenders``: name → a builder returning
    the call that steps it), as the module's docstring says; ``after(name, step)`` runs
    once a contender's steps are timed (a check that no timed step refreshed, a sync count)."""
    if not interleave:
        out: dict[str, list[float] | Exception] = {}
        for name, build in contenders.items():
            try:
                step = build()
                out[name] = time_calls(step, rounds * per_round, warmup, device)
                if after is not None:
                    after(name, step)
                del step
            except Exception as err:  # a contender that cannot run here: say why
                out[name] = err
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
        return out
    steps = {name: build() for name, build in contenders.items()}
    for step in steps.values():
        time_calls(step, 0, warmup)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name] += time_calls(step, per_round, 0, device)
    if after is not None:
        for name, step in steps.items():
            after(name, step)
    return dict(times)


def median_ms(times: Sequence[float]) -> float:
    """The median of per-call seconds, in milliseconds."""
    return 1e3 * statistics.median(times)
