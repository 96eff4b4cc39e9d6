"""The optimizer step alone, and the worst step under each refresh schedule (issue 38 item 9).

``python -m benchmarks.step_alone [--part step|profile|schedule|both] [--quick]`` (what
``benchmarks/gpu_session.sh`` runs; prints each row as it is measured):

* **step** — the recipe's model at ``llama_350m`` shapes (bf16 on CUDA), random gradients
  (``randn × 1e-3`` in the parameters' dtype, assigned once), and each optimizer built as
  the recipe builds it (:func:`recipes.optimizers.build_optimizer`: the same groups, r = 256,
  the refresh gap so large that no timed step refreshes), and the GaLore rows again with
  one part of the default path off (:func:`~._common.variant`: ``stacked``, the path
  without the grouped kernels, a ``bmm`` each way per shape batch; ``synced``, each step
  reading its own non-finite flags): 3 untimed steps (the first
  creates state and the bases), then 10 steps between two CUDA events, synchronized after
  the last; milliseconds per step. Rows: torch AdamW fused (the baseline, named in the
  ratio) and foreach, every galore2 preset, GaLoreAdamW with ``capturable=True`` and with
  it under :class:`galore2.CapturedStep` (CUDA only). On a CPU the host clock around the 10
  steps (the CPU runs them synchronously).
* **profile** — where one non-refresh step's time goes: for each of ``PROFILED`` (built as
  in *step*, after the same warm-up), a ``torch.profiler`` table of one step, ops sorted by
  their own device time (host time on a CPU), and the host's Python functions of three
  steps by their own time (cProfile): what to fuse next, and what the host spends.
* **schedule** — GaLoreAdamW with ``refresh_schedule`` ``together`` and ``staggered`` at
  the same shapes, refresh gap ``GAP``: ``STEPS`` steps each timed on its own with CUDA
  events (:func:`benchmarks.timing.time_calls`, synchronized after the last) after the
  first (which creates every basis); the median step, the worst, and worst ÷ median.

``--quick``: the tiny recipe config, fewer steps (a smoke test on the CPU; numbers not
meaningful).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

import galore2
from galore2.presets import PRESETS
from recipes import model as modeling
from recipes import optimizers
from recipes.resolve import parse_args

from ._common import variant
from .timing import time_calls

WARMUP, TIMED = 3, 10
GAP, STEPS = 10, 30  # schedule part: every matrix refreshes once per GAP steps
QUICK_GAP, QUICK_STEPS = 3, 8
NO_REFRESH = 10**9


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _config(quick: bool) -> str:
    return "tiny" if quick or not torch.cuda.is_available() else "llama_350m"


def build(quick: bool) -> torch.nn.Module:
    """The recipe's model with fixed random gradients (bf16 on CUDA, fp32 on a CPU)."""
    device = _device()
    job = parse_args(["--config", _config(quick)])
    torch.manual_seed(0)
    model = modeling.build_model(job.model, device, dtype=modeling.param_dtype(job.model, device))
    gen = torch.Generator(device=device).manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype) * 1e-3
    return model


def make(model: torch.nn.Module, quick: bool, name: str, *flags: str) -> torch.optim.Optimizer:
    """Optimizer ``name`` as the recipe builds it for this config, with ``flags``."""
    argv = ["--config", _config(quick), "--optimizer", name, *flags]
    if name in PRESETS:
        argv += ["--optim.update_proj_gap", str(NO_REFRESH)]
    job = parse_args(argv)
    return optimizers.build_optimizer(model, job.optim, job.train.steps)


def ms_per_step(step: Callable[[], object]) -> float:
    """``WARMUP`` untimed calls, then ``TIMED`` calls between two CUDA events (synchronized
    after the last; the host clock on a CPU); milliseconds per call."""
    for _ in range(WARMUP):
        step()
    if _device().type != "cuda":
        start = time.perf_counter()
        for _ in range(TIMED):
            step()
        return (time.perf_counter() - start) / TIMED * 1e3
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(TIMED):
        step()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / TIMED


class StepRow(NamedTuple):
    label: str
    optimizer: str  # recipe optimizer name
    flags: tuple[str, ...] = ()
    captured: bool = False  # wrapped in galore2.CapturedStep (CUDA only)
    variant: str = ""  # a part of the default path off (_common.variant)


#: the baseline first, then in the order a time-boxed GPU session most needs them
STEP_ROWS: tuple[StepRow, ...] = (
    StepRow("torch AdamW (fused)", "adamw", ("--optim.adamw_kernel", "fused")),
    StepRow("galore_adamw", "galore_adamw"),
    StepRow("galore_adamw stacked", "galore_adamw", variant="stacked"),
    StepRow("galore_adamw synced", "galore_adamw", variant="synced"),
    StepRow("galore_adamw8bit", "galore_adamw8bit"),
    StepRow("galore_adamw8bit stacked", "galore_adamw8bit", variant="stacked"),
    *(StepRow(n, n) for n in PRESETS if n not in ("galore_adamw", "galore_adamw8bit")),
    StepRow("galore_adamw capturable", "galore_adamw", ("--optim.capturable", "true")),
    StepRow(
        "galore_adamw + CapturedStep", "galore_adamw", ("--optim.capturable", "true"), captured=True
    ),  # fmt: skip
    StepRow("torch AdamW (foreach)", "adamw", ("--optim.adamw_kernel", "foreach")),
)


def step_part(
    quick: bool, echo: Callable[[str], None] = print, rows: tuple = STEP_ROWS
) -> dict[str, float | str]:
    """Milliseconds per step (or why not) of each row of ``rows`` (the first: the baseline)."""
    model = build(quick)
    echo(f"step alone: {_config(quick)} on {_device()}, {WARMUP} warm-up steps, {TIMED} "
         f"timed; ratios to {rows[0][0]}")  # fmt: skip
    echo("| optimizer | ms/step | ÷ baseline |")
    out: dict[str, float | str] = {}
    for label, name, flags, captured, off in rows:
        try:
            opt = make(model, quick, name, *flags)
            if captured and _device().type != "cuda":
                out[label] = "n/a (CUDA graphs need a GPU)"
            else:
                with variant(off):
                    step = galore2.CapturedStep(opt) if captured else opt.step
                    out[label] = ms_per_step(step)
            del opt
        except Exception as err:  # one that cannot run here: its row says why
            out[label] = f"error {type(err).__name__}: {str(err)[:160]}"
        base = next(iter(out.values()))
        r = out[label]
        ratio = f"{r / base:.2f}" if isinstance(r, float) and isinstance(base, float) else ""
        shown = f"{r:.2f}" if isinstance(r, float) else r
        echo(f"| {label} | {shown} | {ratio} |")
        if _device().type == "cuda":
            torch.cuda.empty_cache()
    return out


PROFILED = ("galore_adamw", "galore_adamw8bit", "fira")
PROFILE_ROWS = 15


def profile_part(
    quick: bool, echo: Callable[[str], None] = print, names: tuple[str, ...] = PROFILED
) -> dict[str, str]:
    """A profiler table of one step of each of ``names`` (or why not), keyed by name."""
    from torch.profiler import ProfilerActivity, profile

    model = build(quick)
    cuda = _device().type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    out = {}
    for name in names:
        try:
            opt = make(model, quick, name)
            for _ in range(WARMUP):
                opt.step()
            if cuda:
                torch.cuda.synchronize()
            with profile(activities=activities) as prof:
                opt.step()
                if cuda:
                    torch.cuda.synchronize()
            out[name] = prof.key_averages().table(sort_by=key, row_limit=PROFILE_ROWS,
                                                  max_name_column_width=50)  # fmt: skip
            out[name] += "\n" + host_profile(opt.step)
            del opt
        except Exception as err:  # one that cannot run here: its entry says why
            out[name] = f"error {type(err).__name__}: {str(err)[:160]}"
        echo(f"profile: {name}, one step at {_config(quick)} on {_device()}, by {key}")
        echo(out[name])
        if cuda:
            torch.cuda.empty_cache()
    return out


def host_profile(step: Callable[[], object], calls: int = 3) -> str:
    """Where the host's time of ``calls`` steps goes: cProfile's functions by their own time
    (the Python of the step and each op's dispatch, which a launch-bound GPU waits for)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(PROFILE_ROWS)
    text = buf.getvalue()
    return f"host, {calls} steps, functions by own time:\n" + text[text.find("   ncalls") :]


def schedule_part(quick: bool, echo: Callable[[str], None] = print) -> dict[str, dict]:
    """Median and worst step of GaLoreAdamW under each ``refresh_schedule``."""
    model = build(quick)
    gap, steps = (QUICK_GAP, QUICK_STEPS) if quick else (GAP, STEPS)
    echo(f"refresh_schedule: galore_adamw, {_config(quick)} on {_device()}, gap {gap}, "
         f"{steps} steps timed each after the first")  # fmt: skip
    echo("| refresh_schedule | median ms | worst ms | worst ÷ median |")
    out = {}
    for schedule in ("together", "staggered"):
        job = parse_args(["--config", _config(quick), "--optimizer", "galore_adamw",
                          "--optim.update_proj_gap", str(gap),
                          "--optim.refresh_schedule", schedule])  # fmt: skip
        opt = optimizers.build_optimizer(model, job.optim, job.train.steps)
        times = time_calls(opt.step, steps, warmup=1, device=_device())
        med, worst = statistics.median(times) * 1e3, max(times) * 1e3
        out[schedule] = {"median_ms": med, "worst_ms": worst, "worst_over_median": worst / med}
        echo(f"| {schedule} | {med:.2f} | {worst:.2f} | {worst / med:.2f} |")
        del opt
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--part", choices=("step", "profile", "schedule", "both"), default="both")
    p.add_argument("--quick", action="store_true", help="tiny config (CPU smoke test)")
    p.add_argument(
        "--rows",
        default="",
        help="step part: comma-separated labels, the baseline first (default: all)",
    )
    args = p.parse_args(argv)
    wanted = [s.strip() for s in args.rows.split(",") if s.strip()]
    labels = [r.label for r in STEP_ROWS]
    unknown = [w for w in wanted if w not in labels]
    if unknown:
        p.error(f"--rows: unknown {unknown}; rows: {', '.join(labels)}")
    rows = tuple(r for w in wanted for r in STEP_ROWS if r.label == w) or STEP_ROWS  # as named

    def echo(line: str) -> None:
        print(line, flush=True)

    if args.part in ("step", "both"):
        step_part(args.quick, echo, rows)
    if args.part == "profile":
        profile_part(args.quick, echo)
    if args.part in ("schedule", "both"):
        schedule_part(args.quick, echo)


if __name__ == "__main__":
    main(sys.argv[1:])
