"""GaLore's refresh schedule and projection precision on the tiny recipe.

Every run is ``python -m recipes.pretrain --config tiny --optimizer NAME --optim.lr 1e-2``
in this process (byte-level Llama with 0.9M parameters, 28 projected matrices, embedded
corpus, 400 steps × 2,048 tokens, r = 32, T = 50, α = 0.25; lr 1e-2 is the best of the
convergence sweep for each of the three optimizers).

* ``refresh_schedule`` — GaLoreAdamW, Fira and APOLLO with ``refresh_schedule`` =
  ``together`` and ``staggered``: final validation loss, refreshes in all, the most
  refreshes on one step after the first (counted: the optimizer's ``step`` argument of
  every ``GaLore.refresh`` call) and, on CUDA, the optimizer step's time — median, and
  the worst step after the first against it (timed around ``ChainOptimizer.step``).
* ``proj_precision`` — the same three optimizers with ``proj_precision`` = fp32 / bf16
  (and tf32 where CUDA runs it; on a CPU TF32 does not exist and equals fp32), with
  fp32 parameters (``--model.dtype fp32``: with bf16 parameters the gradient, so the
  projection, is bf16 whatever the option): final validation loss and, on CUDA, the
  median optimizer step time. Runs on a GPU as it is (the recipe picks CUDA when there
  is one).

Both tasks need the same runs; the first of them to run does all of them, on a CPU in
parallel worker processes (one torch thread each: only losses and counts are reported
there), on CUDA one after the other (the step times are reported). ``--quick``: 60 steps
with T = 20, so that both schedules refresh a few times.
"""

from __future__ import annotations

import math
import multiprocessing
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from galore2.core.optimizer import ChainOptimizer
from galore2.optim import GaLore

from ._common import render, table, tiny_run, val_losses

QUICK_STEPS = 60
LR = "1e-2"
OPTIMIZERS = {"galore_adamw": "GaLoreAdamW", "fira": "Fira", "apollo": "APOLLO"}
MATRICES = 28  # the tiny model's projected matrices (4 layers × 7)
GAP, QUICK_GAP = 50, 20
SCHEDULES = ("together", "staggered")


@contextmanager
def _probe() -> Iterator[dict[str, Any]]:
    """Count ``GaLore.refresh`` calls per optimizer step and time every ``step`` call."""
    seen: dict[str, Any] = {"refreshes": Counter(), "step_s": []}
    refresh, step = GaLore.refresh, ChainOptimizer.step

    def counted(self: Any, G: Any, state: Any, group: Any, plan: Any, at: int, *a: Any, **k: Any):
        seen["refreshes"][at] += 1
        return refresh(self, G, state, group, plan, at, *a, **k)

    def timed(self: Any, *a: Any, **k: Any) -> Any:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            return step(self, *a, **k)
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            seen["step_s"].append(time.perf_counter() - start)

    GaLore.refresh, ChainOptimizer.step = counted, timed  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        GaLore.refresh, ChainOptimizer.step = refresh, step  # type: ignore[method-assign]


#: runs of this process, by (optimizer, settings that differ from the defaults, quick): the
#: fp32 rows of ``proj_precision`` on a CPU are the ``together`` rows of ``refresh_schedule``
_DONE: dict[tuple[str, tuple[str, ...], bool], dict[str, Any]] = {}


def _precisions() -> tuple[str, ...]:
    return ("fp32", "tf32", "bf16") if torch.cuda.is_available() else ("fp32", "bf16")


def _runs() -> list[tuple[str, list[str]]]:
    """Every (optimizer, flags) the two tasks report."""
    out = [(n, ["--optim.refresh_schedule", s]) for n in OPTIMIZERS for s in SCHEDULES]
    out += [(n, ["--optim.proj_precision", p, "--model.dtype", "fp32"])
            for n in OPTIMIZERS for p in _precisions()]  # fmt: skip
    return out


def _key(name: str, flags: list[str], quick: bool) -> tuple[str, tuple[str, ...], bool]:
    defaults = {("--optim.refresh_schedule", "together"), ("--optim.proj_precision", "fp32")}
    if not torch.cuda.is_available():  # the recipe's dtype "auto" is fp32 on a CPU
        defaults.add(("--model.dtype", "fp32"))
    pairs = [(flags[i], flags[i + 1]) for i in range(0, len(flags), 2)]
    return name, tuple(f"{k}={v}" for k, v in pairs if (k, v) not in defaults), quick


def _run(name: str, flags: list[str], quick: bool) -> dict[str, Any]:
    """One run's figures; the first call does every run of :func:`_runs` (CPU: in
    parallel worker processes)."""
    todo = {}
    for n, f in [(name, flags), *_runs()]:
        todo.setdefault(_key(n, f, quick), (n, f, quick))
    todo = {k: v for k, v in todo.items() if k not in _DONE}
    if len(todo) > 1 and not torch.cuda.is_available():
        _DONE.update(zip(todo, _parallel(list(todo.values())), strict=True))
    for k, args in todo.items():
        if k not in _DONE:
            _DONE[k] = _measure(*args)
    return _DONE[_key(name, flags, quick)]


def _parallel(runs: list[tuple[str, list[str], bool]]) -> list[dict[str, Any]]:
    """:func:`_measure` of every run, each in its own worker process."""
    with multiprocessing.get_context("spawn").Pool(len(runs)) as pool:
        return pool.starmap(_worker, runs)


def _worker(name: str, flags: list[str], quick: bool) -> dict[str, Any]:
    torch.set_num_threads(1)  # several runs share the CPU
    return _measure(name, flags, quick)


def _measure(name: str, flags: list[str], quick: bool) -> dict[str, Any]:
    if quick:
        flags = [*flags, "--optim.update_proj_gap", str(QUICK_GAP)]
    with _probe() as seen:
        hist = tiny_run(name, LR, flags, QUICK_STEPS if quick else None)
    per_step: Counter = seen["refreshes"]
    times = seen["step_s"]
    later = times[1:] or times
    return {
        "val": val_losses(hist)[-1],
        "refreshes": sum(per_step.values()),
        "first": per_step.get(0, 0),
        "most": max((c for s, c in per_step.items() if s > 0), default=0),
        "median_ms": 1e3 * statistics.median(later),
        "worst": max(later) / statistics.median(later),
    }


def refresh_schedule(quick: bool) -> str:
    cuda = torch.cuda.is_available()
    rows = []
    for name, label in OPTIMIZERS.items():
        results = {s: _run(name, ["--optim.refresh_schedule", s], quick) for s in SCHEDULES}
        for schedule, r in results.items():
            row = [label, schedule, f"{r['val']:.4f}",
                   f"{r['val'] / results['together']['val']:.4f}", str(r["refreshes"]),
                   str(r["first"]), str(r["most"])]  # fmt: skip
            if cuda:
                row += [f"{r['median_ms']:.1f}", f"{r['worst']:.2f}"]
            rows.append(row)
    headers = ["optimizer", "refresh_schedule", "final val loss", "÷ together", "refreshes",
               "on step 1", "most on a later step"]  # fmt: skip
    if cuda:
        headers += ["median step ms", "worst later step ÷ median"]
    gap = QUICK_GAP if quick else GAP
    return render("schedule", "refresh_schedule", steps=QUICK_STEPS if quick else 400,
                  gap=gap, bound=math.ceil(MATRICES / gap), device=_device(),
                  table=table(headers, rows))  # fmt: skip


def proj_precision(quick: bool) -> str:
    cuda = torch.cuda.is_available()
    rows = []
    for name, label in OPTIMIZERS.items():
        results = {p: _run(name, ["--optim.proj_precision", p, "--model.dtype", "fp32"], quick)
                   for p in _precisions()}  # fmt: skip
        base = results["fp32"]
        for precision, r in results.items():
            row = [label, precision, f"{r['val']:.4f}", f"{r['val'] / base['val']:.4f}"]
            if cuda:
                row += [f"{r['median_ms']:.2f}", f"{r['median_ms'] / base['median_ms']:.3f}"]
            rows.append(row)
    headers = ["optimizer", "proj_precision", "final val loss", "÷ fp32"]
    if cuda:
        headers += ["median step ms", "÷ fp32"]
    return render("schedule", "proj_precision", steps=QUICK_STEPS if quick else 400,
                  gap=QUICK_GAP if quick else GAP, device=_device(),
                  table=table(headers, rows))  # fmt: skip


def _device() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return (
        "CPU, the runs in parallel processes with one torch thread each (losses and counts "
        "only; no TF32 on a CPU, so no tf32 rows)"
    )
