"""Ranger21 and GaLoreRanger21 vs AdamW and pytorch-optimizer's Ranger21, plus an ablation.

All runs are the tiny recipe (embedded corpus, byte-level 0.9M-parameter Llama,
``--config tiny``) in this process. Part 1: every optimizer at the same small lr
sweep; best final validation loss and optimizer-state bytes, ratios against AdamW's
best. Part 2: GaLoreRanger21 at its best lr with one component switched off at a
time (what each component does to loss and memory). ``--quick``: 60 steps, one lr.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import galore2
from recipes import optimizers
from recipes.pretrain import main as pretrain

from ._common import table

OPTIMIZERS = ("adamw", "ranger21", "galore_ranger21", "pto_ranger21")
LRS = ("1e-3", "3e-3", "1e-2")
ABLATION = ("use_agc", "use_gc", "use_gn", "use_pnm", "use_norm_loss",
            "use_stable_weight_decay", "use_lookahead", "use_warmup", "use_warmdown")  # fmt: skip


def _run(tmp: str, name: str, lr: str, steps: list[str]) -> dict[str, Any]:
    out = Path(tmp) / f"{name}-{lr}-{len(list(Path(tmp).iterdir()))}"
    argv = ["--config", "tiny", "--optimizer", name, "--optim.lr", lr, "--out", str(out),
            "--train.progress", "false", *steps]  # fmt: skip
    hist = pretrain(argv)
    val = [r["val_loss"] for r in hist if "val_loss" in r][-1]
    return {"val": val, "bytes": hist[-1]["opt_state_bytes"]}


def run(quick: bool = False) -> dict[str, Any]:
    steps = ["--steps", "60", "--train.eval_every", "30"] if quick else []
    lrs = LRS[1:2] if quick else LRS
    names = [n for n in OPTIMIZERS if optimizers.available(n)]
    missing = [n for n in OPTIMIZERS if n not in names]
    best: dict[str, tuple[str, dict[str, Any]]] = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            for lr in lrs:
                r = _run(tmp, name, lr, steps)
                rows.append((name, lr, r))
                if name not in best or r["val"] < best[name][1]["val"]:
                    best[name] = (lr, r)
        base = best["adamw"][1]
        sweep = [[n, lr, f"{r['val']:.4f}", f"{r['bytes'] / 1e6:.2f}"] for n, lr, r in rows]
        summary = [[n, lr, f"{r['val']:.4f}", f"{r['val'] / base['val']:.3f}",
                    f"{r['bytes'] / 1e6:.2f}", f"{r['bytes'] / base['bytes']:.3f}"]
                   for n, (lr, r) in best.items()]  # fmt: skip
        # ablation: GaLoreRanger21 at its best lr, one component off at a time
        lr, ref = best["galore_ranger21"]
        abl = [["(all on)", f"{ref['val']:.4f}", "—", f"{ref['bytes'] / 1e6:.2f}"]]
        original = galore2.GaLoreRanger21
        for switch in ABLATION:
            extra = {switch: False, **({"softplus": False} if switch == "use_pnm" else {})}

            def patched(*a: Any, _extra: dict = extra, **kw: Any) -> Any:
                return original(*a, **{**kw, **_extra})

            galore2.GaLoreRanger21 = patched
            try:
                r = _run(tmp, "galore_ranger21", lr, steps)
            finally:
                galore2.GaLoreRanger21 = original
            abl.append([f"{switch}=False", f"{r['val']:.4f}", f"{r['val'] - ref['val']:+.4f}",
                        f"{r['bytes'] / 1e6:.2f}"])  # fmt: skip
    md = (
        f"Each run: `python -m recipes.pretrain --config tiny --optimizer NAME --optim.lr LR` "
        f"({'60' if quick else '400'} steps × 2,048 tokens; GaLore r = 32, T = 50, α = 0.25; "
        "Ranger21 variants use their own warmup/warmdown over the run, AdamW the recipe's "
        "warmup + cosine). Validation loss in nats per byte.\n\n"
        + (f"Not run (not installed): {', '.join(missing)}\n\n" if missing else "")
        + "**Best of the lr sweep** (ratios against AdamW's best)\n\n"
        + table(["optimizer", "best lr", "val loss", "÷ AdamW", "state MB", "÷ AdamW"], summary)
        + "\n\n**Sweep**\n\n"
        + table(["optimizer", "lr", "val loss", "state MB"], sweep)
        + f"\n\n**Ablation**: GaLoreRanger21 at lr {lr}, one component off (`use_pnm=False` "
        "also turns softplus off; it is part of the PNM module)\n\n"
        + table(["GaLoreRanger21", "val loss", "Δ vs all on", "state MB"], abl)
    )
    return {"markdown": md}
