"""The README's main job (tiny recipe, embedded corpus) for AdamW and GaLoreAdamW, small lr sweep.

Each optimizer runs ``python -m recipes.pretrain --config tiny`` at two learning
rates in this process, one after the other; the table gives the final validation
loss, mean tokens/s and optimizer-state bytes, with ratios against the best AdamW
run of the same benchmark. ``--quick`` runs 60 steps instead of the config's 400.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from recipes.pretrain import main as pretrain

from ._common import table

SWEEP = {"adamw": ("1e-3", "3e-3"), "galore_adamw": ("3e-3", "1e-2")}


def run(quick: bool = False) -> dict[str, Any]:
    steps = ["--steps", "60", "--train.eval_every", "30"] if quick else []
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, lrs in SWEEP.items():
            for lr in lrs:
                out = Path(tmp) / f"{name}-{lr}"
                argv = ["--config", "tiny", "--optimizer", name, "--optim.lr", lr,
                        "--out", str(out), "--train.progress", "false", *steps]  # fmt: skip
                hist = pretrain(argv)
                vals = [r["val_loss"] for r in hist if "val_loss" in r]
                rate = [r["tokens_per_s"] for r in hist[1:]]
                results.append((name, lr, vals[-1], sum(rate) / len(rate), hist[-1]))
    best = min((r for r in results if r[0] == "adamw"), key=lambda r: r[2])
    rows = [
        [name, lr, f"{val:.4f}", f"{val / best[2]:.3f}", f"{rate:,.0f}", f"{rate / best[3]:.2f}",
         f"{last['opt_state_bytes'] / 1e6:.2f}",
         f"{last['opt_state_bytes'] / best[4]['opt_state_bytes']:.3f}"]
        for name, lr, val, rate, last in results
    ]  # fmt: skip
    headers = ["optimizer", "lr", "final val loss", "÷ best AdamW", "tokens/s", "÷ AdamW",
               "state MB", "÷ AdamW"]  # fmt: skip
    cmd = "python -m recipes.pretrain --config tiny --optimizer NAME --optim.lr LR"
    md = (
        f"Each row: `{cmd}` ({'60' if quick else '400'} steps × 2,048 tokens, byte-level "
        "Llama with 0.9M parameters, embedded corpus, GaLore r = 32, T = 50, α = 0.25). "
        "Loss in nats per byte; ratios against the best AdamW row of this run.\n\n"
        + table(headers, rows)
    )
    return {"markdown": md}
