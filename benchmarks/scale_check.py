"""Opt-in task ``scale_check``: does the tiny sweep's ranking hold on a ~20M-parameter Llama?

Each run is ``python -m recipes.pretrain --config llama_20m --optimizer NAME --optim.lr LR
--steps STEPS`` (in this process, through :func:`benchmarks.convergence.run_one`): the tiny
recipe's data (embedded corpus, byte tokens) on a 19.2M-parameter Llama, 1,024 tokens per
step, projected optimizers at r = 128 (dim / 4, as tiny's 32 of 128), T = 50, α = 0.25.
Each contender (default :data:`DEFAULT`, or ``--optimizers``) runs at two lrs taken from
its tiny sweep (``results/suite_convergence.json``): the best, and the next lr of the sweep
on the side of its second best (:func:`lrs`). A contender without a tiny sweep is not run.

Hours on a CPU (12 runs × 1,500 steps × seconds per step), so the task is in no group:
``--tasks scale_check`` only. Every finished run is saved at once
(``results/suite_scale_check.partial.json``); ``--resume`` keeps those and runs the rest,
``--partial`` reports them, running nothing. ``--quick``: the tiny config, 6 steps.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Callable
from itertools import combinations
from pathlib import Path
from typing import Any

from . import convergence, suite_plots
from ._common import Section, render, table
from .contenders import BY_KEY, CONTENDERS, Contender, why_not
from .suite import Suite, _ratio

DEFAULT = ("adamw", "apollo", "galore_adamw", "galore2_fira", "galore2_apollo", "galore2_muon")
CONFIG, STEPS = "llama_20m", 1500
QUICK_CONFIG, QUICK_STEPS = "tiny", 6
EVALS, QUICK_EVALS = 15, 2  # validations per run: every 100 steps at 1,500
LADDER = tuple(sorted({*convergence.GRID, *convergence.EXTEND.values()}))
Run = dict[str, Any]


def _loss(run: Run) -> float:
    """A run's best validation loss, a diverged (non-finite) one last."""
    return run["best"] if math.isfinite(run["best"]) else math.inf


def lrs(sweep: list[Run]) -> tuple[float, float]:
    """The tiny sweep's best lr and its neighbour: the next lr of the sweep (of
    :data:`LADDER` for a one-run sweep, below it) on the side of the second-best lr."""
    ranked = sorted(sweep, key=_loss)
    best = ranked[0]["lr"]
    ladder = sorted({r["lr"] for r in sweep} | (set(LADDER) if len(sweep) < 2 else set()))
    i = ladder.index(best)
    side = 1 if len(ranked) > 1 and ranked[1]["lr"] > best else -1
    j = i + side if 0 <= i + side < len(ladder) else i - side
    return best, ladder[j]


def plan(contenders: list[Contender], tiny: dict[str, list[Run]],
         quick: bool) -> dict[str, tuple[float, float]]:  # fmt: skip
    """key → (best lr, neighbour) of every contender with a tiny sweep (``--quick``: else
    its family's quick lr)."""
    out = {}
    for c in contenders:
        sweep = tiny.get(c.key) or (
            [{"lr": convergence.QUICK_LR[c.family], "best": 0.0}] if quick else None
        )
        if sweep:
            out[c.key] = lrs(sweep)
    return out


def run(
    lrs_by_key: dict[str, tuple[float, float]],
    config: str,
    steps: int,
    evals: int = EVALS,
    done: dict[str, list[Run]] | None = None,
    on_run: Callable[[dict[str, list[Run]]], None] | None = None,
) -> dict[str, list[Run]]:
    """Both runs of every contender, each in a temporary folder; a run already in ``done``
    (same lr, config and steps) is kept, not rerun; ``on_run`` gets the results so far after
    each new run (saved, so a cut-off task resumes there)."""
    done = done or {}
    results: dict[str, list[Run]] = {}
    for key, pair in lrs_by_key.items():
        runs = results.setdefault(key, [])
        for lr in pair:
            same = (lr, config, steps)
            kept = [
                r for r in done.get(key, []) if (r["lr"], r.get("config"), r.get("steps")) == same
            ]
            if kept:
                runs.append(kept[0])
                continue
            print(f"scale_check: {key} at lr {lr:g}, {steps} steps ...", flush=True)
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                r = convergence.run_one(BY_KEY[key], lr, Path(tmp), steps, config, evals)
            wall = time.perf_counter() - t0
            every = max(1, steps // evals)
            runs.append({**r, "config": config, "steps": steps, "eval_every": every,
                         "wall_s": wall})  # fmt: skip
            if on_run is not None:
                on_run(results)
    return results


def _ranks(best: dict[str, float]) -> dict[str, int]:
    return {k: i + 1 for i, k in enumerate(sorted(best, key=best.__getitem__))}


def verdict(here: dict[str, float], tiny: dict[str, float], labels: dict[str, str]) -> str:
    """Whether the order by best loss here is the tiny sweep's; else Kendall τ and the pairs."""
    keys = [k for k in here if k in tiny]
    if len(keys) < 2:
        return ""
    swapped = [(a, b) for a, b in combinations(keys, 2)
               if (here[a] - here[b]) * (tiny[a] - tiny[b]) < 0]  # fmt: skip
    if not swapped:
        return render("scale_check", "holds", n=len(keys))
    pairs = len(keys) * (len(keys) - 1) // 2
    tau = 1 - 2 * len(swapped) / pairs
    names = "; ".join(f"{labels[a]} and {labels[b]}" for a, b in swapped)
    return render("scale_check", "changed", tau=tau, n=len(keys), pairs=names)


def _model(config: str) -> tuple[str, dict[str, Any]]:
    from recipes.model import build_model
    from recipes.optimizers import setting
    from recipes.resolve import parse_args

    job = parse_args(["--config", config])
    m = job.model
    params = sum(p.numel() for p in build_model(m, "meta").parameters())
    text = (f"Llama with {params:,} parameters (dim {m.dim}, {m.n_layers} layers, "
            f"{m.n_heads} heads, ffn {m.ffn_dim}), {job.train.batch_size} × "
            f"{job.data.seq_len} tokens per step")  # fmt: skip
    o = job.optim
    return text, {"tokens_per_step": job.train.batch_size * job.data.seq_len,
                  "rank": setting(o, "rank"), "gap": setting(o, "update_proj_gap"),
                  "scale": setting(o, "scale")}  # fmt: skip


def _saved(raw: Path, task: str) -> dict[str, Any]:
    path = raw / f"suite_{task}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def scale_md(results: dict[str, list[Run]], raw: Path, labels: dict[str, str], quick: bool,
             minutes: float, cut_off: str = "", skipped: str = "") -> str:  # fmt: skip
    """The section's body: the table, the ranking verdict, the wall time."""
    tiny = {k: min(map(_loss, rs)) for k, rs in _saved(raw, "convergence").items() if rs}
    state, foot = _saved(raw, "state_7b"), _saved(raw, "footprint")
    done = {k: rs for k, rs in results.items() if rs}
    best = {k: min(rs, key=_loss) for k, rs in done.items()}
    loss = {k: _loss(b) for k, b in best.items()}
    here, small = _ranks(loss), _ranks({k: tiny[k] for k in loss if k in tiny})
    adamw, apollo = loss.get("adamw"), loss.get("apollo")
    step = {k: (f or {}).get("step_ms") for k, f in foot.items()}
    rows = []
    for k, rs in done.items():
        b = best[k]
        tried = ", ".join(f"**{r['lr']:g}**: {r['best']:.4f}" if r is b else
                          f"{r['lr']:g}: {r['best']:.4f}"
                          for r in sorted(rs, key=lambda r: r["lr"]))  # fmt: skip
        rank = f"{here[k]} ({small[k]})" if k in small else f"{here[k]} (—)"
        rows.append([labels[k], tried, f"{b['lr']:g}", f"{b['best']:.4f}",
                     _ratio(loss[k], adamw), _ratio(loss[k], apollo), rank,
                     _ratio(state.get(k), state.get("adamw")),
                     _ratio(step.get(k), step.get("adamw"), "{:.2f}"),
                     f"{b['wall_s'] / b['steps']:.2f}",
                     f"{sum(r['wall_s'] for r in rs) / 60:.1f}"])  # fmt: skip
    head = ["optimizer", "lr: best val loss", "best lr", "best val loss", "÷ AdamW",
            "÷ APOLLO", "rank (tiny)", "7B state ÷ AdamW", "step ÷ AdamW", "s/step",
            "wall min"]  # fmt: skip
    every = [r for rs in done.values() for r in rs]
    first = every[0]
    model, opt = _model(first["config"])
    return render(
        "scale_check", cut_off=cut_off, config=first["config"], steps=first["steps"],
        model=model, tokens=first["steps"] * opt["tokens_per_step"], rank=opt["rank"],
        gap=opt["gap"], scale=opt["scale"], eval_every=first["eval_every"],
        how=render("scale_check", "how_quick" if quick else "how"), skipped=skipped,
        table=table(head, rows), verdict=verdict(loss, tiny, labels),
        hours=sum(r["wall_s"] for r in every) / 3600, runs=len(every), minutes=minutes,
    )  # fmt: skip


def scale_check(suite: Suite, steps: int | None) -> Section:
    """The task: plan, run (or resume / report a cut-off run), save, plot, write."""
    t0 = time.perf_counter()
    config = QUICK_CONFIG if suite.quick else CONFIG
    steps = steps or (QUICK_STEPS if suite.quick else STEPS)
    chosen = [c for c in CONTENDERS if c.key in (suite.keys or DEFAULT)]
    runnable = [c for c in chosen if why_not(c.key) is None]
    planned = plan(runnable, _saved(suite.raw, "convergence"), suite.quick)
    labels = suite.labels
    notes = []
    if len(runnable) < len(chosen):
        cannot = ", ".join(labels[c.key] for c in chosen if c not in runnable)
        notes.append(render("scale_check", "cannot", names=cannot))
    if missing := [labels[c.key] for c in runnable if c.key not in planned]:
        path = suite.raw / "suite_convergence.json"
        path = path.relative_to(suite.root) if path.is_relative_to(suite.root) else path
        notes.append(render("scale_check", "no_sweep", names=", ".join(missing), path=path))
    if not planned:
        suite.error(f"scale_check: nothing to run: {'; '.join(notes)}")
    partial = suite.raw / "suite_scale_check.partial.json"
    cut_off = ""
    if suite.partial:
        if not partial.exists():
            suite.error(f"--partial: no saved runs at {partial}")
        results = json.loads(partial.read_text())
        if not any(results.values()):
            suite.error(f"--partial: no finished run in {partial}")
        left = [f"{labels[k]} at {lr:g}" for k, pair in planned.items() for lr in pair
                if lr not in {r["lr"] for r in results.get(k, [])}]  # fmt: skip
        cut_off = render("scale_check", "partial", done=sum(map(len, results.values())),
                         total=2 * len(planned), missing=", ".join(left))  # fmt: skip
    else:
        done = json.loads(partial.read_text()) if suite.resume and partial.exists() else {}

        def checkpoint(so_far: dict[str, list[Run]]) -> None:
            suite.raw.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps({**done, **so_far}, indent=1) + "\n")

        evals = QUICK_EVALS if suite.quick else EVALS
        results = suite.save("scale_check", run(planned, config, steps, evals, done, checkpoint))
        partial.unlink(missing_ok=True)
    curves = {k: (labels[k], min(rs, key=_loss)["curve"])
              for k, rs in results.items() if rs}  # fmt: skip
    suite_plots.convergence(curves, suite.figures / "scale_check.png",
                            f"{config} ({steps} steps), each optimizer at its best lr")  # fmt: skip
    skipped = render("scale_check", "skipped", names="; ".join(notes)) if notes else ""
    body = scale_md(results, suite.raw, labels, suite.quick,
                    (time.perf_counter() - t0) / 60, cut_off, skipped)  # fmt: skip
    return suite.section(body, merged=not suite.partial)
