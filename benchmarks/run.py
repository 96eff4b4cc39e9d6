"""galore2 against every peer, side by side: convergence, memory, speed, Llama-7B state.

Usage (repository root, venv with the ``bench`` extra, a quiet machine)::

    python -m benchmarks.run                  # full suite → BENCHMARKS.md + benchmarks/figures/
    python -m benchmarks.run --quick          # ≤ 10 min smoke run → runs/BENCHMARKS-quick.md
    python -m benchmarks.run --tasks footprint --optimizers adamw,galore_adamw
    python -m benchmarks.run --tasks convergence --resume   # finish a cut-off sweep
    python -m benchmarks.run --tasks convergence --partial  # report it so far

Tasks (each writes its own BENCHMARKS.md section, ``suite_TASK``):

* ``peers`` — every contender, its package version, and the exact reason when it
  cannot run here (the exception its first steps raise);
* ``convergence`` — ``benchmarks/convergence.py``: the tiny recipe, same token
  budget and lr sweep for everyone; best validation loss ÷ AdamW's best;
* ``footprint`` — ``benchmarks/footprint.py``: state bytes, peak RSS, median step
  time, refresh time, each contender alone in a fresh process;
* ``state_7b`` — ``benchmarks/state_7b.py``: Llama-7B state on the meta device;
* ``targets`` — the project's targets checked against the latest figures of
  convergence, footprint and state_7b (written by a run that measured one of them
  when all three exist).

Raw results go to ``benchmarks/results/suite_TASK.json`` (``runs/results`` with
``--quick``), plots to ``benchmarks/figures/`` (``runs/figures``).

Ratios are against torch AdamW (foreach) measured in the same run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from . import convergence, footprint, state_7b, suite_plots
from ._common import arg_parser, command, machine_md, setup, table
from .contenders import CONTENDERS, Contender, version, why_not
from .run_core import ROOT, update
from .suite_targets import targets_md

TASKS = ("peers", "state_7b", "footprint", "convergence")
MEASURED = ("state_7b", "footprint", "convergence")
TITLES = {
    "peers": "Side-by-side suite: contenders",
    "convergence": "Side-by-side suite: convergence (tiny recipe, lr sweep)",
    "footprint": "Side-by-side suite: memory and speed (CPU)",
    "state_7b": "Side-by-side suite: Llama-7B optimizer state",
    "targets": "Side-by-side suite: targets",
}


def _ratio(x: float | None, base: float | None, fmt: str = "{:.3f}") -> str:
    return "" if x is None or not base else fmt.format(x / base)


def peers_md(contenders: list[Contender]) -> str:
    rows = []
    for c in contenders:
        reason = why_not(c.key)
        status = "runs" if reason is None else f"cannot run here: `{reason}`"
        rows.append([c.label, f"`{c.key}`", f"{c.package} {version(c.package)}", status])
    return table(["optimizer", "key", "package", "status"], rows) + PEER_NOTES


# What the probe's first exception does not say (read from the peers' installed sources).
PEER_NOTES = """

Past their first error the CUDA-only peers would still not run on a CPU: galore-torch's
`GaLoreAdamW8bit.step` and q-galore-torch's `QGaLoreAdamW8bit.step` both call
`torch.cuda.synchronize()` unconditionally after every parameter's update. q-galore-torch
1.0 also predates bitsandbytes 0.45+, whose 8-bit optimizers no longer carry the
`percentile_clipping` setting its `update_step` reads (hence the `KeyError` above, which
comes first); it would need an older bitsandbytes and a GPU."""


def convergence_md(runs: dict[str, list[dict[str, Any]]], labels: dict[str, str], quick: bool):
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
    tokens = next(iter(runs.values()))[0]["tokens"]
    cpus: dict[str, list[str]] = {}
    for k, rs in runs.items():
        for cpu in dict.fromkeys(r.get("cpu", "unrecorded") for r in rs):
            cpus.setdefault(cpu, []).append(labels[k])
    machines = (
        ""
        if len(cpus) < 2
        else "\n\n**This sweep ran on more than one machine** (a resumed run), so its "
        "tokens/s ratios compare different CPUs; the footprint section is the speed "
        "reference. "
        + "; ".join(f"`{cpu}`: {', '.join(names)}" for cpu, names in cpus.items())
        + "."
    )
    how = (
        f"one lr per family ({convergence.QUICK_STEPS} steps)"
        if quick
        else f"grid {', '.join(f'{x:g}' for x in convergence.GRID)}, extended one step at a "
        "winning edge"
    )
    return (
        f"`python -m recipes.pretrain --config tiny --optimizer NAME --optim.lr LR` for every "
        f"contender: {tokens:,} training tokens of the embedded corpus, byte-level Llama "
        f"(0.9M parameters), projected optimizers at r = 32, T = 50, α = 0.25; lr sweep: {how}. "
        "Loss in nats per byte (best validation loss of the run); ratios against AdamW's best "
        "lr. Plot: `benchmarks/figures/convergence.png`. Tokens/s is end to end (forward, "
        "backward, step, the periodic evaluations) and drifts with the machine between runs "
        "made minutes apart; the optimizers' own cost is the memory-and-speed section's step "
        "time (and `python -m benchmarks.step_time`, interleaved non-refresh steps)."
        + machines
        + "\n\n"
        + table(head, rows)
        + "\n\nThe sweep (best validation loss per lr):\n\n"
        + table(["optimizer", *(f"lr {lr:g}" for lr in lrs)], sweep_rows)
    )


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
    params = next(iter(results.values()))["params"]
    threads = next(iter(results.values()))["threads"]
    return (
        f"{footprint.describe(quick)} ({params:,} parameters); fixed random gradients; each "
        f"contender alone in a fresh process, {footprint.STEPS} steps, {threads} threads. "
        "State: measured after the run. Peak RSS Δ: the process's peak resident memory during "
        "the steps minus its resident memory before them (state + temporaries). Step: median "
        "of steps 1–30. Refresh: mean of the 3 refresh steps minus that median (all projected "
        "matrices). See `benchmarks/footprint.py`.\n\n" + table(head, rows)
    )


def state_7b_md(sizes: dict[str, int | None], labels: dict[str, str], quick: bool) -> str:
    _, shape = state_7b.shapes(quick)
    base = sizes.get("adamw")
    rows = [
        [labels[k], "not counted (cannot run here)" if b is None else f"{b / 1e9:.2f}",
         _ratio(b, base)]
        for k, b in sizes.items()
    ]  # fmt: skip
    return (
        f"Model {shape}, fp32 weights, meta device (GB = 1e9 bytes). galore2: `state_bytes()` "
        "after `init_state()`; peers: their storage rules, verified against real state by "
        "`tests/test_bench_suite.py`. galore-torch 1.0 keeps its fp32 basis as a view of the "
        "whole SVD factor, so each projected matrix holds small side × small side of basis "
        "(by shapes alone its state would equal pytorch-optimizer GaLore's). "
        "Plot: `benchmarks/figures/memory_7b.png`.\n\n"
        + table(["optimizer", "state GB", "÷ AdamW"], rows)
    )


def main(argv: list[str] | None = None) -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated of {TASKS}")
    parser.add_argument("--optimizers", default="", help="comma-separated contender keys")
    parser.add_argument("--out", type=Path, default=None, help="Markdown file to update")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="with --optimizers: keep the other contenders' saved rows (rerun a few)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="convergence: keep the sweeps a cut-off run saved (results/suite_convergence."
        "partial.json) and run only the missing contenders",
    )
    parser.add_argument(
        "--partial",
        action="store_true",
        help="convergence: write the section (marked partial) and targets from a cut-off "
        "run's saved sweeps, running nothing",
    )
    args = parser.parse_args(argv)
    setup(args)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if set(tasks) - set(TASKS):
        parser.error(f"--tasks: unknown {sorted(set(tasks) - set(TASKS))}; choose from {TASKS}")
    keys = [k.strip() for k in args.optimizers.split(",") if k.strip()]
    known = {c.key for c in CONTENDERS}
    if args.merge and not keys:
        parser.error("--merge needs --optimizers (the contenders to rerun)")
    if set(keys) - known:
        parser.error(
            f"--optimizers: unknown {sorted(set(keys) - known)}; choose from {sorted(known)}"
        )
    chosen = [c for c in CONTENDERS if not keys or c.key in keys]
    runnable = [c for c in chosen if why_not(c.key) is None]
    labels = {c.key: c.label for c in CONTENDERS}
    if args.out:
        out, figures, raw = args.out, args.out.parent / "figures", args.out.parent / "results"
    elif args.quick:
        out, figures, raw = (
            ROOT / "runs/BENCHMARKS-quick.md",
            ROOT / "runs/figures",
            ROOT / "runs/results",
        )
    else:
        out, figures, raw = (
            ROOT / "BENCHMARKS.md",
            ROOT / "benchmarks/figures",
            ROOT / "benchmarks/results",
        )
    start = time.perf_counter()
    results: dict[str, Any] = {}

    def save(task: str, data: dict[str, Any]) -> dict[str, Any]:
        """Write ``data`` (merged into the saved rows with ``--merge``); return what was written."""
        path = raw / f"suite_{task}.json"
        if args.merge and path.exists():
            old = json.loads(path.read_text())
            data = {c.key: data.get(c.key, old.get(c.key)) for c in CONTENDERS}
            data = {k: v for k, v in data.items() if v is not None or k in old or k in keys}
        raw.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")
        return data

    def write(task: str, body: str, took: float | None = None) -> None:
        note = "\n**Quick mode (smoke run): not representative.**\n" if args.quick else ""
        if took is not None:
            note += f"\nThis task took {took / 60:.1f} minutes of the run.\n"
        if args.merge and task != "targets":
            note += (
                f"\nRows for {', '.join(f'`{k}`' for k in keys)} are from this command; the "
                f"others from the previous full run (saved in `{raw.relative_to(ROOT) if raw.is_relative_to(ROOT) else raw}`).\n"
            )
        text = (
            f"<!-- BEGIN galore2-bench:suite_{task} -->\n## {TITLES[task]}\n{note}\n"
            f"Command: `{command('benchmarks.run')}`\n\n{machine_md()}\n\n{body}\n"
            f"<!-- END galore2-bench:suite_{task} -->\n"
        )
        update(out, f"suite_{task}", text)
        print(f"== {task}\n{body}\n", flush=True)

    if "peers" in tasks:
        write("peers", peers_md(list(CONTENDERS) if args.merge else chosen))
    if "state_7b" in tasks:
        results["state_7b"] = save("state_7b", state_7b.run(chosen, args.quick))
        sizes = {labels[k]: v / 1e9 for k, v in results["state_7b"].items() if v is not None}
        _, shape = state_7b.shapes(args.quick)
        suite_plots.memory(sizes, figures / "memory_7b.png", f"Optimizer state (GB), {shape}")
        write("state_7b", state_7b_md(results["state_7b"], labels, args.quick))
    if "footprint" in tasks:
        t0 = time.perf_counter()
        measured = {c.key: footprint.in_subprocess(c.key, args.quick) for c in runnable}
        results["footprint"] = save("footprint", measured)
        write(
            "footprint",
            footprint_md(results["footprint"], labels, args.quick),
            time.perf_counter() - t0,
        )
    if "convergence" in tasks:
        t0 = time.perf_counter()
        partial = raw / "suite_convergence.partial.json"
        cut_off = ""
        if args.partial:  # report a cut-off run's saved sweeps; run nothing
            if not partial.exists():
                parser.error(f"--partial: no saved sweeps at {partial}")
            results["convergence"] = json.loads(partial.read_text())
            t0 -= results["convergence"].pop("_seconds", 0.0)
            missing = [labels[c.key] for c in runnable if c.key not in results["convergence"]]
            cut_off = (
                f"**Partial: {len(results['convergence'])} of {len(runnable)} contenders.** The "
                f"run was cut off before {', '.join(missing)}; `python -m benchmarks.run --tasks "
                "convergence --resume` finishes it and replaces this section.\n\n"
            )
        else:
            done = json.loads(partial.read_text()) if args.resume and partial.exists() else {}
            took = done.pop("_seconds", 0.0)

            def checkpoint(so_far: dict[str, Any]) -> None:
                raw.mkdir(parents=True, exist_ok=True)
                elapsed = took + time.perf_counter() - t0
                partial.write_text(json.dumps({**so_far, "_seconds": elapsed}, indent=1) + "\n")

            swept = convergence.run(runnable, args.quick, done, checkpoint)
            results["convergence"] = save("convergence", swept)
            partial.unlink(missing_ok=True)
            t0 -= took  # the section states the time of every session of a resumed run
        curves = {
            k: (labels[k], min(rs, key=lambda r: r["best"])["curve"])
            for k, rs in results["convergence"].items()
        }
        suite_plots.convergence(
            curves, figures / "convergence.png", "Tiny recipe, each optimizer at its best lr"
        )
        write(
            "convergence",
            cut_off + convergence_md(results["convergence"], labels, args.quick),
            time.perf_counter() - t0,
        )
    minutes = (time.perf_counter() - start) / 60
    for task in MEASURED:  # the latest saved figures of the tasks this run did not do
        path = raw / f"suite_{task}.json"
        if task not in results and path.exists():
            results[task] = json.loads(path.read_text())
    if set(tasks) & set(MEASURED) and all(task in results for task in MEASURED):
        every = {c.key: c.label for c in CONTENDERS}
        write(
            "targets", targets_md(results, every, minutes if set(MEASURED) <= set(tasks) else None)
        )
    print(f"suite finished in {minutes:.1f} min; wrote {out} and {figures}/")


if __name__ == "__main__":
    main()
