"""INT8 weights vs the training dtype on the tiny recipe: best validation loss over an lr sweep.

    python -m benchmarks.run --tasks int8_weights            # 400 steps, 3 lrs, 12 runs
    python -m benchmarks.run --tasks int8_weights --quick    # 40 steps, one lr: a smoke run

Each run is ``python -m recipes.pretrain --config tiny --optimizer NAME --optim.lr LR``,
with and without ``--model.weight_bits 8`` (issue 40 asks: best validation loss with INT8
weights ≤ 1.01× the run with weights in the training dtype, at the same lr sweep, for
GaLoreAdamW and Fira). Per-layer updates in both (``--optim.per_layer true``: what INT8
weights are for; the ordinary step would hold a dense working copy of every weight).
On a CPU the recipe's dtype is fp32, on a GPU bf16: the baseline is that dtype.
"""

from __future__ import annotations

from ._common import render, table, tiny_run, val_losses

OPTIMIZERS = {"galore_adamw": "GaLoreAdamW", "fira": "Fira"}
LRS, QUICK_LRS = ("3e-3", "1e-2", "3e-2"), ("1e-2",)
QUICK_STEPS = 40
BOUND = 1.01  # issue 40: best val loss with INT8 weights / without


def best(name: str, lrs: tuple[str, ...], flags: list[str], steps: int | None) -> tuple[float, str]:
    """(best final validation loss over ``lrs``, its lr); a diverged run's NaN never wins."""
    found = []
    for lr in lrs:
        v = val_losses(tiny_run(name, lr, ["--optim.per_layer", "true", *flags], steps))[-1]
        if v == v:  # not NaN
            found.append((v, lr))
    return min(found) if found else (float("nan"), "-")


def int8_weights(quick: bool) -> str:
    lrs, steps = (QUICK_LRS, QUICK_STEPS) if quick else (LRS, None)
    rows = []
    for name, label in OPTIMIZERS.items():
        dense, dense_lr = best(name, lrs, [], steps)
        q8, q8_lr = best(name, lrs, ["--model.weight_bits", "8"], steps)
        ratio = q8 / dense
        mark = "✓" if ratio <= BOUND else "✗"
        rows.append([label, f"{dense:.4f} ({dense_lr})", f"{q8:.4f} ({q8_lr})",
                     f"{ratio:.4f} {mark}"])  # fmt: skip
    head = ["optimizer", "training dtype: best val (lr)", "INT8 weights: best val (lr)",
            f"INT8 ÷ dtype (≤ {BOUND})"]  # fmt: skip
    return render("int8_weights", steps=steps or 400, lrs=", ".join(lrs),
                  table=table(head, rows))  # fmt: skip
