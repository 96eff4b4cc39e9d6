"""The side-by-side suite: galore2 against every peer, in one run on one machine.

Tasks (each writes its own BENCHMARKS.md section, ``suite_TASK``):

* ``peers`` — every contender (``benchmarks/contenders.py``), its package version, and
  the exact reason when it cannot run here (the exception its first steps raise);
* ``state_7b`` — Llama-7B state on the meta device (``benchmarks/llama_7b.py``);
* ``footprint`` — ``benchmarks/footprint.py``: state bytes, peak RSS, median step time,
  refresh time, each contender alone in a fresh process;
* ``convergence`` — ``benchmarks/convergence.py``: the tiny recipe, same token budget and
  lr sweep for everyone; best validation loss ÷ AdamW's best;
* ``scale_check`` (opt-in: by name only, hours on a CPU) — ``benchmarks/scale_check.py``:
  a few contenders at their best tiny-sweep lr and one neighbour on a ~20M-parameter Llama
  (``recipes/configs/llama_20m.toml``, 1,500 steps); does the ranking hold?
* ``targets`` — the project's targets (``benchmarks/suite_targets.py``) checked against
  the latest figures of convergence, footprint and state_7b (run after any of them, when
  all three exist).

Raw results go to ``results/suite_TASK.json`` and plots to ``figures/`` next to the
output file (``benchmarks/`` for BENCHMARKS.md, ``runs/`` with ``--quick``). Ratios are
against torch AdamW (foreach) measured in the same run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn

from . import convergence, footprint, llama_7b, suite_plots
from ._common import Section, render, table
from .contenders import CONTENDERS, Contender, version, why_not
from .suite_targets import targets_md

MEASURED = ("state_7b", "footprint", "convergence")


def _ratio(x: float | None, base: float | None, fmt: str = "{:.3f}") -> str:
    return "" if x is None or not base else fmt.format(x / base)


class Suite:
    """What the suite's tasks share in one run: the contenders (``--optimizers``), the
    ``--merge`` / ``--resume`` / ``--partial`` settings, where raw results and figures go,
    and the results so far."""

    def __init__(self, args: Any, root: Path, raw: Path, figures: Path,
                 error: Callable[[str], NoReturn]) -> None:  # fmt: skip
        self.quick, self.merge = args.quick, args.merge
        self.resume, self.partial = args.resume, args.partial
        self.root, self.raw, self.figures, self.error = root, raw, figures, error
        self.keys = [k.strip() for k in args.optimizers.split(",") if k.strip()]
        known = {c.key for c in CONTENDERS}
        if self.merge and not self.keys:
            error("--merge needs --optimizers (the contenders to rerun)")
        if set(self.keys) - known:
            error(f"--optimizers: unknown {sorted(set(self.keys) - known)}; "
                  f"choose from {sorted(known)}")  # fmt: skip
        self.chosen = [c for c in CONTENDERS if not self.keys or c.key in self.keys]
        self.labels = {c.key: c.label for c in CONTENDERS}
        self.results: dict[str, Any] = {}
        self.measured: set[str] = set()
        self.start = time.perf_counter()

    @cached_property
    def runnable(self) -> list[Contender]:
        return [c for c in self.chosen if why_not(c.key) is None]

    def save(self, task: str, data: dict[str, Any]) -> dict[str, Any]:
        """Write ``data`` (merged into the saved rows with ``--merge``); return what was written."""
        path = self.raw / f"suite_{task}.json"
        if self.merge and path.exists():
            old = json.loads(path.read_text())
            data = {c.key: data.get(c.key, old.get(c.key)) for c in CONTENDERS}
            data = {k: v for k, v in data.items() if v is not None or k in old or k in self.keys}
        self.raw.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")
        self.results[task] = data
        self.measured.add(task)
        return data

    def section(self, body: str, took: float | None = None, merged: bool = True) -> Section:
        """``body`` with the notes above the command: time taken, rows kept by ``--merge``."""
        note = "" if took is None else "\n" + render("suite", "took", minutes=took / 60) + "\n"
        if self.merge and merged:
            raw = (
                self.raw.relative_to(self.root) if self.raw.is_relative_to(self.root) else self.raw
            )
            keys = ", ".join(f"`{k}`" for k in self.keys)
            note += "\n" + render("suite", "merged", keys=keys, raw=raw) + "\n"
        return Section(body, note)


def peers(suite: Suite) -> Section:
    rows = []
    for c in CONTENDERS if suite.merge else suite.chosen:
        reason = why_not(c.key)
        status = "runs" if reason is None else f"cannot run here: `{reason}`"
        rows.append([c.label, f"`{c.key}`", f"{c.package} {version(c.package)}", status])
    body = table(["optimizer", "key", "package", "status"], rows)
    return suite.section(body + "\n\n" + render("suite", "peers"))


def state_7b(suite: Suite) -> Section:
    sizes = suite.save("state_7b", llama_7b.state_by_contender(suite.chosen, suite.quick))
    _, shape = llama_7b.shapes(suite.quick)
    bars = {suite.labels[k]: v / 1e9 for k, v in sizes.items() if v is not None}
    suite_plots.memory(bars, suite.figures / "memory_7b.png", f"Optimizer state (GB), {shape}")
    base = sizes.get("adamw")
    rows = [
        [suite.labels[k], "not counted (cannot run here)" if b is None else f"{b / 1e9:.2f}",
         _ratio(b, base)]
        for k, b in sizes.items()
    ]  # fmt: skip
    body = table(["optimizer", "state GB", "÷ AdamW"], rows)
    return suite.section(render("suite", "state_7b", shape=shape, table=body))


def footprint_md(results: dict[str, dict[str, Any]], labels: dict[str, str], quick: bool) -> str:
    base = results.get("adamw", {})
    gt = results.get("gt_galore_adamw", {})
    rows = []
    for k, r in results.items():
        peak = r["peak_rss_delta"]
        refresh = r["refresh_ms"]
        rows.append([
            labels[k], f"{r['state_bytes'] / 1e6:.1f}", _ratio(r["state_bytes"], base.get("state_bytes")),
            "" if peak is None else f"{peak / 1e6:.1f}", _ratio(peak, base.get("peak_rss_delta")),
            f"{r['step_ms']:.1f}", _ratio(r["step_ms"], base.get("step_ms"), "{:.2f}"),
            _ratio(r["step_ms"], gt.get("step_ms"), "{:.2f}"),
            "" if refresh is None else f"{refresh:.0f}",
            _ratio(gt.get("refresh_ms"), refresh, "{:.1f}") if refresh and refresh > 0 else "",
        ])  # fmt: skip
    head = ["optimizer", "state MB", "÷ AdamW", "peak RSS Δ MB", "÷ AdamW", "step ms",
            "÷ AdamW", "÷ galore-torch", "refresh ms", "galore-torch ÷ this"]  # fmt: skip
    first = next(iter(results.values()))
    return render("suite", "footprint", model=footprint.describe(quick), params=first["params"],
                  steps=footprint.STEPS, threads=first["threads"], table=table(head, rows))  # fmt: skip


def footprint_task(suite: Suite) -> Section:
    t0 = time.perf_counter()
    measured = {c.key: footprint.in_subprocess(c.key, suite.quick) for c in suite.runnable}
    results = suite.save("footprint", measured)
    body = footprint_md(results, suite.labels, suite.quick)
    return suite.section(body, time.perf_counter() - t0)


def convergence_md(runs: dict[str, list[dict[str, Any]]], labels: dict[str, str], quick: bool,
                   cut_off: str = "") -> str:  # fmt: skip
    best = {k: min(rs, key=lambda r: r["best"]) for k, rs in runs.items()}
    base = best.get("adamw")
    rows = [
        [labels[k], f"{b['lr']:g}", f"{b['best']:.4f}", _ratio(b["best"], base and base["best"]),
         f"{b['tokens_per_s']:,.0f}", _ratio(b["tokens_per_s"], base and base["tokens_per_s"], "{:.2f}"),
         f"{b['state_bytes'] / 1e6:.2f}", _ratio(b["state_bytes"], base and base["state_bytes"])]
        for k, b in best.items()
    ]  # fmt: skip
    head = ["optimizer", "best lr", "best val loss", "÷ AdamW", "tokens/s", "÷ AdamW",
            "state MB", "÷ AdamW"]  # fmt: skip
    lrs = sorted({r["lr"] for rs in runs.values() for r in rs})
    sweep_rows = []
    for k, rs in runs.items():
        by_lr = {r["lr"]: r["best"] for r in rs}
        sweep_rows.append([labels[k], *(f"{by_lr[lr]:.4f}" if lr in by_lr else "" for lr in lrs)])
    cpus: dict[str, list[str]] = {}
    for k, rs in runs.items():
        for cpu in dict.fromkeys(r.get("cpu", "unrecorded") for r in rs):
            cpus.setdefault(cpu, []).append(labels[k])
    machines = "" if len(cpus) < 2 else render("suite", "convergence_machines", cpus="; ".join(
        f"`{cpu}`: {', '.join(names)}" for cpu, names in cpus.items()))  # fmt: skip
    if quick:
        how = render("suite", "convergence_how_quick", steps=convergence.QUICK_STEPS)
    else:
        grid = ", ".join(f"{x:g}" for x in convergence.GRID)
        how = render("suite", "convergence_how", grid=grid)
    sweep = table(["optimizer", *(f"lr {lr:g}" for lr in lrs)], sweep_rows)
    return render("suite", "convergence", cut_off=cut_off, how=how, machines=machines,
                  tokens=next(iter(runs.values()))[0]["tokens"], table=table(head, rows),
                  sweep=sweep)  # fmt: skip


def convergence_task(suite: Suite) -> Section:
    t0 = time.perf_counter()
    partial = suite.raw / "suite_convergence.partial.json"
    cut_off = ""
    if suite.partial:  # report a cut-off run's saved sweeps; run nothing
        if not partial.exists():
            suite.error(f"--partial: no saved sweeps at {partial}")
        runs = json.loads(partial.read_text())
        t0 -= runs.pop("_seconds", 0.0)
        suite.results["convergence"] = runs
        suite.measured.add("convergence")
        missing = [suite.labels[c.key] for c in suite.runnable if c.key not in runs]
        cut_off = render("suite", "convergence_partial", done=len(runs),
                         total=len(suite.runnable), missing=", ".join(missing))  # fmt: skip
    else:
        done = json.loads(partial.read_text()) if suite.resume and partial.exists() else {}
        took = done.pop("_seconds", 0.0)

        def checkpoint(so_far: dict[str, Any]) -> None:
            suite.raw.mkdir(parents=True, exist_ok=True)
            elapsed = took + time.perf_counter() - t0
            partial.write_text(json.dumps({**so_far, "_seconds": elapsed}, indent=1) + "\n")

        runs = suite.save("convergence", convergence.run(suite.runnable, suite.quick, done,
                                                         checkpoint))  # fmt: skip
        partial.unlink(missing_ok=True)
        t0 -= took  # the section states the time of every session of a resumed run
    curves = {k: (suite.labels[k], min(rs, key=lambda r: r["best"])["curve"])
              for k, rs in runs.items()}  # fmt: skip
    suite_plots.convergence(curves, suite.figures / "convergence.png",
                            "Tiny recipe, each optimizer at its best lr")  # fmt: skip
    body = convergence_md(runs, suite.labels, suite.quick, cut_off)
    return suite.section(body, time.perf_counter() - t0)


def targets(suite: Suite) -> Section | None:
    """The targets on the latest figures of every measured task (``None``: one is missing)."""
    results = dict(suite.results)
    for task in MEASURED:  # the latest saved figures of the tasks this run did not do
        path = suite.raw / f"suite_{task}.json"
        if task not in results and path.exists():
            results[task] = json.loads(path.read_text())
    if not all(task in results for task in MEASURED):
        print("targets: needs saved figures of " + ", ".join(MEASURED) + "; not written")
        return None
    minutes = (time.perf_counter() - suite.start) / 60
    every = {c.key: c.label for c in CONTENDERS}
    whole = minutes if set(MEASURED) <= suite.measured else None
    body = targets_md(results, every, whole)
    return suite.section(body, merged=False)
