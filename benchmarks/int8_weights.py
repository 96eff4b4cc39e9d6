"""INT8 weights vs the training dtype on the tiny recipe: best validation loss over an lr sweep.

    python -m benchmarks.run --tasks int8_weights            # 400 steps, 3 lrs, 12 runs
    python -m benchmarks.run --tasks int8_weights --quick    # 40 steps, one lr: a smoke run
    python -m benchmarks.run --tasks int8_weights --jobs 2   # two runs at once, 1 thread each

Each run is ``python -m recipes.pretrain --config tiny --optimizer NAME --optim.lr LR``,
with and without ``--model.weight_bits 8`` (issue 40 asks: best validation loss with INT8
weights ≤ 1.01× the run with weights in the training dtype, at the same lr sweep, for
GaLoreAdamW and Fira). Per-layer updates in both (``--optim.per_layer true``: what INT8
weights are for; the ordinary step would hold a dense working copy of every weight).
On a CPU the recipe's dtype is fp32, on a GPU bf16: the baseline is that dtype.
"""

from __future__ import annotations

import multiprocessing

import torch

from ._common import render, table, tiny_run, val_losses

OPTIMIZERS = {"galore_adamw": "GaLoreAdamW", "fira": "Fira"}
LRS, QUICK_LRS = ("3e-3", "1e-2", "3e-2"), ("1e-2",)
QUICK_STEPS = 40
BOUND = 1.01  # issue 40: best val loss with INT8 weights / without


def final_val(run: tuple[str, str, list[str], int | None]) -> float:
    """The final validation loss of one run ``(optimizer, lr, flags, steps)``."""
    name, lr, flags, steps = run
    return val_losses(tiny_run(name, lr, flags, steps))[-1]


def best(found: list[tuple[float, str]]) -> tuple[float, str]:
    """(best final validation loss, its lr) of ``(loss, lr)`` pairs; a diverged run's NaN
    never wins."""
    finite = [(v, lr) for v, lr in found if v == v]
    return min(finite) if finite else (float("nan"), "-")


def int8_weights(quick: bool, jobs: int | None) -> str:
    lrs, steps = (QUICK_LRS, QUICK_STEPS) if quick else (LRS, None)
    if jobs is not None and jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    jobs = jobs or 1
    # runs side by side get one thread each; one at a time keeps this process's count
    threads = 1 if jobs > 1 else torch.get_num_threads()
    formats = {"dense": [], "int8": ["--model.weight_bits", "8"]}
    runs = {
        (name, fmt, lr): (name, lr, ["--optim.per_layer", "true", "--train.threads",
                                     str(threads), *flags], steps)
        for name in OPTIMIZERS for fmt, flags in formats.items() for lr in lrs
    }  # fmt: skip
    if jobs > 1:
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            finals = dict(zip(runs, pool.map(final_val, runs.values(), chunksize=1), strict=True))
    else:
        finals = {key: final_val(run) for key, run in runs.items()}
    rows = []
    for name, label in OPTIMIZERS.items():
        dense, dense_lr = best([(finals[name, "dense", lr], lr) for lr in lrs])
        q8, q8_lr = best([(finals[name, "int8", lr], lr) for lr in lrs])
        ratio = q8 / dense
        mark = "✓" if ratio <= BOUND else "✗"
        rows.append([label, f"{dense:.4f} ({dense_lr})", f"{q8:.4f} ({q8_lr})",
                     f"{ratio:.4f} {mark}"])  # fmt: skip
    head = ["optimizer", "training dtype: best val (lr)", "INT8 weights: best val (lr)",
            f"INT8 ÷ dtype (≤ {BOUND})"]  # fmt: skip
    return render("int8_weights", steps=steps or 400, lrs=", ".join(lrs), threads=threads,
                  jobs=jobs, table=table(head, rows))  # fmt: skip
