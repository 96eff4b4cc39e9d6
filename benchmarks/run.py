"""The benchmark runner: every benchmark is a task, selected by name; each writes a BENCHMARKS.md section.

Usage (repository root, venv with the ``bench`` extra, a quiet machine)::

    python -m benchmarks.run                  # the side-by-side suite (peers, state_7b,
                                              #   footprint, convergence, then targets)
    python -m benchmarks.run --tasks core     # the benchmarks of the numbered sections
    python -m benchmarks.run --tasks all      # every task but the opt-in ones (kernels
                                              #   only where CUDA is)
    python -m benchmarks.run --tasks scale_check [--resume]  # opt-in: ~20M Llama, hours on CPU
    python -m benchmarks.run --list           # the tasks: name, module, section title
    python -m benchmarks.run --tasks refresh,step_time --out /tmp/bench.md
    python -m benchmarks.run --quick          # smoke run → runs/BENCHMARKS-quick.md
    python -m benchmarks.run --tasks footprint --optimizers adamw,galore_adamw [--merge]
    python -m benchmarks.run --tasks convergence --resume    # finish a cut-off sweep
    python -m benchmarks.run --tasks convergence --partial   # report it so far
    python -m benchmarks.run --tasks kernels [--repeats 50 --warmup 10 --json k.json]  # CUDA
    python -m benchmarks.run --tasks adafactor_step --no-write   # print, write nothing
    python -m benchmarks.run --tasks compile_step --out /tmp/compile.md  # torch.compile, CPU
    python -m benchmarks.run --tasks roofline   # kernels, bytes, FLOPs of a step (CPU-counted)
    python -m benchmarks.run --tasks fit_24gb [--card-gib 23.5]  # opt-in: llama_7b, GPU
    python -m benchmarks.run --tasks fit_24gb --config tiny --steps 2 --no-write  # CPU smoke
    python -m benchmarks.run --tasks fit_16gb [--card-gib 15]  # the same with INT8 weights

Output goes to ``BENCHMARKS.md`` at the repository root; ``--quick`` (a smoke test: small
sizes, numbers not meaningful) writes ``runs/BENCHMARKS-quick.md`` instead (``/runs/`` is
git-ignored), so a smoke test never overwrites real numbers; ``--out`` overrides either.
Each task owns one section delimited by ``<!-- BEGIN galore2-bench:NAME -->`` /
``<!-- END galore2-bench:NAME -->`` markers: it is replaced in place when present and
appended otherwise; the rest of the file is left untouched. Every section records the
exact command, the machine and the date. Raw results of the suite go to ``results/`` and
plots to ``figures/`` beside the output (``benchmarks/`` for BENCHMARKS.md, ``runs/``
with ``--quick``). Section prose lives in ``benchmarks/templates/``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._common import Section, command, machine_md, render

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Task:
    module: str  # benchmarks.MODULE holds it
    function: str  # called with the runner values its parameters name (see ``main``)
    title: str  # the section's heading
    section: str = ""  # BENCHMARKS.md marker name (default: the task's name)
    needs_cuda: bool = False


# The registry: every task, in the order a run does them.
TASKS: dict[str, Task] = {
    "peers": Task("suite", "peers", "Side-by-side suite: contenders", "suite_peers"),
    "state_7b": Task("suite", "state_7b", "Side-by-side suite: Llama-7B optimizer state",
                     "suite_state_7b"),
    "footprint": Task("suite", "footprint_task", "Side-by-side suite: memory and speed (CPU)",
                      "suite_footprint"),
    "convergence": Task("suite", "convergence_task",
                        "Side-by-side suite: convergence (tiny recipe, lr sweep)",
                        "suite_convergence"),
    "targets": Task("suite", "targets", "Side-by-side suite: targets", "suite_targets"),
    "per_byte": Task("per_byte", "per_byte", "Side-by-side suite: loss per byte of state",
                     "suite_per_byte"),
    "refresh": Task("refresh", "refresh", "Subspace refresh: exact SVD vs randomized vs warm power"),
    "step_time": Task("step_time", "step_time", "Optimizer step time (non-refresh steps)"),
    "step_counts": Task("step_counts", "step_counts",
                        "Accelerator cost of a step, counted on the CPU: launches, syncs, graph breaks"),
    "roofline": Task("roofline", "roofline",
                     "Roofline (CPU-counted): kernels, bytes and FLOPs of a step at Llama-350M / 7B widths"),
    "overhead": Task("overhead", "overhead",
                     "Host overhead of a step: CPU proxies (24-layer hidden-64 Llama, kernels)"),
    "gpu_host": Task("gpu_host", "gpu_host",
                     "Host time of the CUDA step, measured on the CPU (kernels stubbed)"),
    "gpu_throughput": Task("gpu_throughput", "gpu_throughput",
                           "Training throughput at Llama-350M shapes, every optimizer (GPU)",
                           needs_cuda=True),
    "memory_7b": Task("llama_7b", "memory_7b", "Optimizer-state memory, Llama-7B shapes"),
    "traffic_7b": Task("traffic_7b", "traffic_7b",
                       "Collective traffic under FSDP2, Llama-7B shapes (on paper)"),
    "recipe_tiny": Task("tiny", "recipe_tiny", "Main job: tiny recipe, AdamW vs GaLoreAdamW"),
    "recipe_memory_7b": Task("llama_7b", "recipe_memory_7b",
                             "Llama-7B recipe: expected per-GPU memory"),
    "throughput": Task("tiny", "throughput",
                       "Main job: tokens/s of GaLoreAdamW vs AdamW, interleaved runs"),
    "ranger21": Task("tiny", "ranger21", "Ranger21 / GaLoreRanger21 vs AdamW and pytorch-optimizer"),
    "basis_quant": Task("basis_quant", "basis_quant",
                        "Quantized bases: bytes and reconstruction error"),
    "low_memory": Task("tiny", "low_memory",
                       "Memory below every GaLore: 8-bit moments, quantized bases"),
    "refresh_schedule": Task("schedule", "refresh_schedule",
                             "Refresh schedule: together vs staggered (tiny recipe)"),
    "proj_precision": Task("schedule", "proj_precision",
                           "Projection precision: fp32 / TF32 / bf16 (tiny recipe)"),
    "int8_weights": Task("int8_weights", "int8_weights",
                         "INT8 weights vs the training dtype (tiny recipe, lr sweep)"),
    "kernels": Task("kernels", "kernels", "Triton kernels (GPU)", needs_cuda=True),
    "gpu_step": Task("gpu_step", "gpu_step", "Optimizer step on a GPU, Llama-7B layer shapes",
                     needs_cuda=True),
    "adafactor_step": Task("step_time", "adafactor_step",
                           "GaLoreAdafactor step vs galore-torch's, per weight shape"),
    "compile_step": Task("compile_step", "compile_step",
                         "torch.compile: compiled vs eager optimizer step (CPU)"),
    "build_memory": Task("build_memory", "build_memory",
                         "Building the recipe's model: peak memory over the weights (CPU)"),
    "fit_24gb": Task("fit_24gb", "fit_24gb",
                     "Llama-7B on one 24 GB GPU: build peak, training peak, planner, tokens/s"),
    "fit_16gb": Task("fit_24gb", "fit_16gb",
                     "Llama-7B on one 16 GB GPU, INT8 weights: build peak, training peak, "
                     "planner, tokens/s"),
    "scale_check": Task("scale_check", "scale_check",
                        "Side-by-side suite: scale check (~20M-parameter Llama, best tiny lrs)",
                        "suite_scale_check"),
}  # fmt: skip
DEFAULT = ("peers", "state_7b", "footprint", "convergence")
# by name only, in no group: hours on a CPU (scale_check); a GPU session's job (fit_24gb:
# llama_7b under a capped allocator; --config tiny runs it on a CPU)
OPT_IN = ("scale_check", "fit_24gb", "fit_16gb")
GROUPS = {  # --tasks names that stand for several tasks
    "suite": DEFAULT,
    "core": ("refresh", "step_time", "step_counts", "memory_7b", "traffic_7b", "recipe_tiny",
             "recipe_memory_7b", "throughput", "ranger21", "basis_quant", "low_memory",
             "refresh_schedule", "proj_precision"),
    "all": tuple(n for n in TASKS if n not in OPT_IN),
}  # fmt: skip
MEASURED = ("state_7b", "footprint", "convergence")  # targets follows any of them


def parse_tasks(spec: str) -> list[str]:
    """Task names of a ``--tasks`` value (names and :data:`GROUPS`), in registry order."""
    names = [t.strip() for t in spec.split(",") if t.strip()]
    if not names:
        raise ValueError(f"no task named; choose from: {', '.join(TASKS)}")
    unknown = [n for n in names if n not in TASKS and n not in GROUPS]
    if unknown:
        raise ValueError(
            f"unknown task{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"choose from: {', '.join(TASKS)} (or a group: {', '.join(GROUPS)}; --list "
            "describes them)"
        )
    chosen = {t for n in names for t in GROUPS.get(n, (n,))}
    return [n for n in TASKS if n in chosen]


def listing() -> str:
    lines = []
    for name, t in TASKS.items():
        notes = [x for x in ("default" if name in DEFAULT else "",
                             "opt-in: by name only" if name in OPT_IN else "",
                             "needs CUDA" if t.needs_cuda else "") if x]  # fmt: skip
        extra = f" [{', '.join(notes)}]" if notes else ""
        lines.append(f"{name:17} benchmarks/{t.module}.py: {t.title}{extra}")
    lines += ["", "groups:"] + [f"{name:17} {','.join(tasks)}" for name, tasks in GROUPS.items()]
    return "\n".join(lines)


def update(path: Path, name: str, text: str) -> None:
    """Replace the section ``name`` of ``path`` by ``text`` (append it when missing)."""
    old = path.read_text() if path.exists() else render("run") + "\n"
    pattern = re.compile(
        rf"<!-- BEGIN galore2-bench:{name} -->\n.*?<!-- END galore2-bench:{name} -->\n?",
        re.DOTALL,
    )
    if pattern.search(old):
        new = pattern.sub(lambda _: text, old, count=1)
    else:
        new = old.rstrip("\n") + "\n\n" + text
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def section_md(name: str, section: Section, quick: bool, argv: list[str] | None) -> str:
    task = TASKS[name]
    marker = task.section or name
    note = "\n**Quick mode (smoke run, small sizes): not representative.**\n" if quick else ""
    return (
        f"<!-- BEGIN galore2-bench:{marker} -->\n## {task.title}\n{note}{section.note}\n"
        f"Command: `{command(argv)}` (section from `benchmarks/{task.module}.py`)\n\n"
        f"{machine_md()}\n\n{section.body}\n<!-- END galore2-bench:{marker} -->\n"
    )


def arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=__doc__.splitlines()[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tasks", default=",".join(DEFAULT),
                   help="comma-separated task names or groups (suite, core, all); default: the "
                   f"suite ({','.join(DEFAULT)}); opt-in tasks ({','.join(OPT_IN)}) only by "
                   "name; --list describes them")  # fmt: skip
    p.add_argument("--only", dest="tasks", help=argparse.SUPPRESS)  # the old run_core flag
    p.add_argument("--list", action="store_true", help="list the tasks and exit")
    p.add_argument("--quick", action="store_true", help="small sizes, for smoke tests only")
    p.add_argument("--out", type=Path, default=None, help="Markdown file to update")
    p.add_argument("--no-write", action="store_true", help="print the sections, write nothing")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: torch's own)")  # fmt: skip
    suite = p.add_argument_group("side-by-side suite (peers, state_7b, footprint, convergence, "
                                 "scale_check)")  # fmt: skip
    suite.add_argument("--optimizers", default="", help="comma-separated contender keys")
    suite.add_argument("--merge", action="store_true",
                       help="with --optimizers: keep the other contenders' saved rows "
                       "(rerun a few)")  # fmt: skip
    suite.add_argument("--resume", action="store_true",
                       help="convergence: keep the sweeps a cut-off run saved (results/"
                       "suite_convergence.partial.json) and run only the missing contenders; "
                       "scale_check: likewise its finished runs")  # fmt: skip
    suite.add_argument("--partial", action="store_true",
                       help="convergence, scale_check: write the section (marked partial; "
                       "convergence: and targets) from a cut-off run's saved results, "
                       "running nothing")  # fmt: skip
    suite.add_argument("--steps", type=int, default=None,
                       help="scale_check: training steps per run (1500; --quick: 6); "
                       "fit_24gb: steps per setting (4; --quick: 2)")  # fmt: skip
    fit = p.add_argument_group("fit_24gb (a GPU session's task)")
    fit.add_argument("--config", default=None,
                     help="fit_24gb: recipe config (llama_7b; --quick: tiny, which runs on "
                     "a CPU)")  # fmt: skip
    fit.add_argument("--card-gib", type=float, default=None,
                     help="fit_24gb / fit_16gb: the CUDA allocator's cap in GiB (default 23.5 "
                     "/ 15: a 24 GB / 16 GB card)")  # fmt: skip
    timing = p.add_argument_group("timing tasks")
    timing.add_argument("--repeats", type=int, default=None,
                        help="timed repeats (refresh: 5, 2 with --quick; kernels: 50)")  # fmt: skip
    timing.add_argument("--rounds", type=int, default=None,
                        help="step_time, compile_step, overhead: interleaved timing rounds "
                        "(10; overhead: 15)")  # fmt: skip
    timing.add_argument("--processes", type=int, default=None,
                        help="overhead: fresh processes timed one after another, their "
                        "median and range reported (3; --quick: 1)")  # fmt: skip
    timing.add_argument("--jobs", type=int, default=None,
                        help="int8_weights: recipe runs at once, each on one thread (1: one "
                        "at a time at --threads)")  # fmt: skip
    timing.add_argument("--warmup", type=int, default=None,
                        help="kernels: untimed calls first (10)")  # fmt: skip
    timing.add_argument("--json", dest="json_path", metavar="PATH", default=None,
                        help="kernels: also write the rows as JSON here")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser()
    args = parser.parse_args(argv)
    if args.list:
        print(listing())
        return 0
    try:
        names = parse_tasks(args.tasks)
    except ValueError as e:
        parser.error(f"--tasks: {e}")
    if set(names) & set(MEASURED):  # targets and loss per byte on the latest figures
        names += [t for t in ("targets", "per_byte") if t not in names]
    if args.out:
        out, base = args.out, args.out.parent
    elif args.quick:
        out, base = ROOT / "runs/BENCHMARKS-quick.md", ROOT / "runs"
    else:
        out, base = ROOT / "BENCHMARKS.md", ROOT / "benchmarks"
    import torch

    from .suite import Suite

    if args.threads:
        torch.set_num_threads(args.threads)
    values: dict[str, Any] = {
        **vars(args),
        "suite": Suite(args, ROOT, base / "results", base / "figures", parser.error),
    }
    start, written = time.perf_counter(), []
    for name in names:
        task = TASKS[name]
        if task.needs_cuda and not torch.cuda.is_available():
            print(f"== {name}: skipped: this task measures GPU kernels and needs a CUDA device "
                  "(torch.cuda.is_available() is False here); nothing written.", flush=True)  # fmt: skip
            continue
        print(f"== {name} ...", flush=True)
        fn = getattr(importlib.import_module(f"benchmarks.{task.module}"), task.function)
        result = fn(**{k: values[k] for k in inspect.signature(fn).parameters})
        if result is None:
            continue
        section = result if isinstance(result, Section) else Section(result)
        print(section.body + "\n", flush=True)
        if not args.no_write:
            update(out, task.section or name, section_md(name, section, args.quick, argv))
            written.append(name)
    minutes = (time.perf_counter() - start) / 60
    where = f"wrote {', '.join(written)} to {out}" if written else "wrote nothing"
    print(f"finished in {minutes:.1f} min; {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
