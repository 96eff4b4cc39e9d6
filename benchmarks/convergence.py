"""Task (a), convergence: every contender trains the recipe's tiny Llama on the same token budget.

Each run is ``python -m recipes.pretrain --config tiny --optimizer NAME --optim.lr LR``
(run in this process): byte-level Llama with 0.9M parameters on the embedded
real-text corpus, 400 steps × 2,048 tokens, GaLore-style optimizers at r = 32,
T = 50, α = 0.25 (their package's own keys), the recipe's warmup + cosine
schedule (Ranger21s use their own). Every contender gets the same learning-rate
sweep, ``GRID``; when its best lr is at an end of the grid the sweep goes one
step further on that side (``EXTEND``), for every contender alike, so no
optimizer is judged at the edge of its range. ``--quick``: 60 steps at one lr
per family (1e-3 for full-rank Adam-likes, 1e-2 for the projected ones).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._common import cpu_model, tiny_run
from .contenders import Contender

GRID = (1e-3, 3e-3, 1e-2)
EXTEND = {1e-3: 3e-4, 1e-2: 3e-2}  # edge → the next lr outward
QUICK_LR = {"adam": 1e-3, "galore": 1e-2}
QUICK_STEPS = 60


def run_one(contender: Contender, lr: float, out: Path, steps: int | None,
            config: str = "tiny", evals: int = 2) -> dict[str, Any]:  # fmt: skip
    """One recipe run; its validation curve, best / final validation loss, speed and state
    (``config``, ``evals``: another recipe config, evaluated that many times when ``steps``
    is given; see :func:`tiny_run`)."""
    hist = tiny_run(contender.optimizer, f"{lr:g}", contender.flags, steps, out, config, evals)
    curve = [(r["tokens"], r["val_loss"]) for r in hist if "val_loss" in r]
    rates = [r["tokens_per_s"] for r in hist[1:]] or [hist[0]["tokens_per_s"]]
    return {
        "lr": lr,
        "curve": curve,
        "best": min(v for _, v in curve),
        "final": curve[-1][1],
        "tokens_per_s": sum(rates) / len(rates),
        "state_bytes": hist[-1]["opt_state_bytes"],
        "tokens": hist[-1]["tokens"],
        "cpu": cpu_model(),  # a resumed sweep may finish on another machine
    }


def sweep(contender: Contender, tmp: str, quick: bool) -> list[dict[str, Any]]:
    """All runs of one contender (the grid, extended at an edge that wins)."""
    counter = iter(range(10**6))

    def go(lr: float) -> dict[str, Any]:
        out = Path(tmp) / f"{contender.key}-{next(counter)}"
        return run_one(contender, lr, out, QUICK_STEPS if quick else None)

    if quick:
        return [go(QUICK_LR[contender.family])]
    runs = [go(lr) for lr in GRID]
    best = min(runs, key=lambda r: r["best"])["lr"]
    if best in EXTEND:
        runs.append(go(EXTEND[best]))
    return sorted(runs, key=lambda r: r["lr"])


def run(
    contenders: list[Contender],
    quick: bool,
    done: dict[str, list[dict[str, Any]]] | None = None,
    on_sweep: Callable[[dict[str, list[dict[str, Any]]]], None] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Every contender's sweep, in order. Sweeps already in ``done`` (a resumed run) are
    kept, not rerun; ``on_sweep`` receives the results so far after each new sweep (the
    suite saves them, so a cut-off run resumes where it stopped)."""
    done = done or {}
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for c in contenders:
            if c.key in done:
                results[c.key] = done[c.key]
                continue
            results[c.key] = sweep(c, tmp, quick)
            if on_sweep is not None:
                on_sweep(results)
    return results
