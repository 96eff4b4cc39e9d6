"""Training throughput of every optimizer on the recipe at Llama-350M shapes (issues 27, 38).

``python -m benchmarks.run --tasks gpu_throughput`` (on a GPU: a few minutes), or
``python -m benchmarks.gpu_throughput [--quick] [--rows LABEL,...]`` (prints each row as it
is measured: what ``benchmarks/gpu_session.sh`` runs under a time box): the recipe
(``recipes.pretrain``, in this process) at ``llama_350m`` shapes — 24 layers, dim 1024, the
168 attention/MLP matrices projected at r = 256, bf16 parameters on a GPU — on the embedded
corpus with byte tokens, batch 64 × 256, for ``STEPS`` steps without evaluation::

    --config llama_350m --data.dataset embedded --data.tokenizer byte \\
    --train.eval_batches 0 --train.log_every 5 --steps 30

Rows (:data:`ROWS`): torch AdamW with its fused kernel (the baseline: what users run on a
GPU) and with foreach, galore-torch's GaLoreAdamW (when installed), every galore2 preset,
and GaLoreAdamW with ``--optim.capture true`` (CUDA-graph replays; a constant lr, which the
capture needs). Each row is **wall-clock** throughput over whole log windows: the tokens
of every window after the first (warm-up: state creation, the first bases, the capture)
over the sum of those windows' times. The recipe's windows end after the device is done
(recipes/metrics.py: the read, then the clock) and follow one another without a gap, so
this is tokens over the wall time of steps 6–30, queued device work included. Ratios are
to the first row in the same run. The runner skips the task without CUDA;
:func:`throughput_section` with ``quick`` (or without CUDA) runs the tiny recipe config
for a few steps instead (a smoke test, numbers not meaningful), which the test suite does.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import NamedTuple

import torch

from recipes import optimizers

from ._common import render, table, tiny_run, variant
from .peers import PEERS


class Row(NamedTuple):
    label: str
    optimizer: str  # recipe optimizer name
    flags: tuple[str, ...] = ()
    variant: str = ""  # a part of the default path off (_common.variant)


CONSTANT_LR = ("--optim.warmup_ratio", "0", "--optim.min_lr_ratio", "1")
#: the baseline first
ROWS = (  # in the order a time-boxed GPU session most needs them (a cut keeps the first)
    Row("adamw (fused)", "adamw", ("--optim.adamw_kernel", "fused")),
    Row("galore_adamw", "galore_adamw"),
    Row("galore_adamw synced", "galore_adamw", variant="synced"),
    Row("galore_adamw stacked", "galore_adamw", variant="stacked"),
    Row("galore_adamw + capture", "galore_adamw", ("--optim.capture", "true", *CONSTANT_LR)),
    *(Row(n, n) for n in ("galore_adamw8bit", "fira", "apollo", "apollo_mini", "galore_muon",
                          "gt_galore_adamw", "galore_adafactor", "ranger21", "galore_ranger21")),
    Row("adamw (foreach)", "adamw", ("--optim.adamw_kernel", "foreach")),
)  # fmt: skip
LRS = {"adamw": "1e-3"}  # the others: GaLore's 1e-2 (the rate does not depend on lr)
LOG_EVERY, STEPS = 5, 30  # windows of 5 steps; the first is warm-up
QUICK_LOG_EVERY, QUICK_STEPS = 2, 4
FLAGS = ("--data.dataset", "embedded", "--data.tokenizer", "byte", "--train.eval_batches", "0")


def window_rate(history: list[dict]) -> float:
    """Tokens over wall time of every log window after the first: each window's tokens
    (the rise of the cumulative ``tokens``) over its seconds (tokens ÷ ``tokens_per_s``)."""
    tokens = [r["tokens"] for r in history]
    windows = [(b - a, r["tokens_per_s"]) for a, b, r in zip(tokens, tokens[1:], history[1:])]
    if not windows:
        raise ValueError("window_rate needs at least two log windows")
    return sum(n for n, _ in windows) / sum(n / rate for n, rate in windows)


def rate(row: Row, config: str, steps: int, log_every: int) -> float:
    """Wall-clock tokens/s of one recipe run after its first log window."""
    flags = (*FLAGS, "--train.log_every", str(log_every), *row.flags)
    with warnings.catch_warnings(), variant(row.variant):
        warnings.simplefilter("ignore")
        history = tiny_run(row.optimizer, LRS.get(row.optimizer, "1e-2"), flags, steps,
                           config=config, evals=1)  # fmt: skip
    return window_rate(history)


def gpu_throughput(quick: bool = False) -> str:
    """The task (``needs_cuda``: the runner skips it without a GPU)."""
    return throughput_section(quick)


def _shape(quick: bool) -> tuple[bool, str, int, int]:
    small = quick or not torch.cuda.is_available()
    config = "tiny" if small else "llama_350m"
    return (small, config, *((QUICK_STEPS, QUICK_LOG_EVERY) if small else (STEPS, LOG_EVERY)))


def measure(quick: bool = False, rows: tuple[Row, ...] = ROWS, echo=None) -> dict[str, float]:
    """Label → tokens/s for the available ``rows`` (``echo(label, rate)`` after each)."""
    _, config, steps, log_every = _shape(quick)
    rates = {}
    for row in rows:
        if not optimizers.available(row.optimizer, PEERS):
            continue
        rates[row.label] = rate(row, config, steps, log_every)
        if echo is not None:
            echo(row.label, rates[row.label])
    return rates


def throughput_section(quick: bool = False, rows: tuple[Row, ...] = ROWS) -> str:
    """The section's body for ``rows`` (the first is the baseline); the tiny config for a
    few steps with ``quick`` or without CUDA (what the test suite runs)."""
    small, config, steps, log_every = _shape(quick)
    rates = measure(quick, rows)
    base_label = next(iter(rates))
    base = rates[base_label]
    out = [[label, f"{r:,.0f}", f"{r / base:.2f}"] for label, r in rates.items()]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no CUDA)"
    note = (
        "**Smoke run (tiny config, CPU or `--quick`): not the GPU measurement.**\n\n"
        if small
        else ""
    )
    flags = " ".join((*FLAGS, "--train.log_every", str(log_every)))
    body = table(["optimizer", "tokens/s", f"÷ {base_label}"], out)
    return note + render("gpu_throughput", config=config, steps=steps, first=log_every + 1,
                         device=device, flags=flags, baseline=base_label, table=body)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="tiny config, a few steps (smoke)")
    p.add_argument(
        "--rows", default="", help="comma-separated row labels, the baseline first (default: all)"
    )
    args = p.parse_args(argv)
    wanted = [s.strip() for s in args.rows.split(",") if s.strip()]
    labels = [r.label for r in ROWS]
    unknown = [w for w in wanted if w not in labels]
    if unknown:
        p.error(f"--rows: unknown {unknown}; rows: {', '.join(labels)}")
    rows = tuple(r for w in wanted for r in ROWS if r.label == w) or ROWS  # in the order named
    _, config, steps, log_every = _shape(args.quick)
    print(f"gpu_throughput: {config}, {steps} steps, windows of {log_every}, wall clock after "
          f"the first window; ratios to {rows[0].label}", flush=True)  # fmt: skip
    base: list[float] = []

    def echo(label: str, r: float) -> None:
        base.append(base[0] if base else r)
        print(f"| {label} | {r:,.0f} | {r / base[0]:.3f} |", flush=True)

    measure(args.quick, rows, echo)


if __name__ == "__main__":
    main(sys.argv[1:])
