"""The README's main job (the tiny recipe) with AdamW, GaLore, Ranger21 and the low-memory variants.

Every run is ``python -m recipes.pretrain --config tiny --optimizer NAME --optim.lr LR``
in this process: byte-level Llama with 0.9M parameters on the embedded corpus, 400
steps × 2,048 tokens, GaLore r = 32, T = 50, α = 0.25. ``--quick``: 60 steps, one lr.

* ``recipe_tiny`` — AdamW and GaLoreAdamW, two lrs each: final validation loss, mean
  tokens/s and state bytes, ratios against the best AdamW run.
* ``throughput`` — tokens/s of GaLoreAdamW against AdamW, the runs alternating
  (``--repeats`` each, 3): every run's rate, the medians, their spread and ratio.
* ``ranger21`` — AdamW, Ranger21, GaLoreRanger21 and pytorch-optimizer's Ranger21 at the
  same lr sweep (best loss and state against AdamW's best), then GaLoreRanger21 at its best
  lr with one component switched off at a time.
* ``low_memory`` — the 8-bit / quantized-basis variants: Llama-7B state (meta device,
  ``benchmarks/llama_7b.py``'s model, counted by ``benchmarks/state.py``) next to each one's
  tiny-recipe loss (AdamW family at lr 1e-3, GaLore family at 1e-2, the best of
  ``recipe_tiny``'s sweep); then adaptive refresh vs fixed T = 50: refreshes done and
  seconds spent in them (``GaLore.refresh`` timed).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import galore2
from recipes import optimizers
from recipes.config import OptimConfig
from recipes.resolve import optim_config

from ._common import render, table, tiny_run, val_losses
from .contenders import optim_flags
from .llama_7b import meta_model, shapes
from .peers import PEERS
from .state import optimizer_state

QUICK_STEPS = 60
SWEEP = {"adamw": ("1e-3", "3e-3"), "galore_adamw": ("3e-3", "1e-2")}  # recipe_tiny
RANGER21_OPTIMIZERS = ("adamw", "ranger21", "galore_ranger21", "pto_ranger21")
RANGER21_LRS = ("1e-3", "3e-3", "1e-2")
ABLATION = ("use_agc", "use_gc", "use_gn", "use_pnm", "use_norm_loss",
            "use_stable_weight_decay", "use_lookahead", "use_warmup", "use_warmdown")  # fmt: skip
EIGHT = "galore_adamw8bit"
# low_memory: (label, recipe optimizer, lr, extra recipe flags)
VARIANTS: list[tuple[str, str, str, list[str]]] = [
    ("torch AdamW fp32", "adamw", "1e-3", []),
    ("bitsandbytes AdamW8bit", "adamw8bit", "1e-3", []),
    ("galore-torch GaLoreAdamW fp32", "gt_galore_adamw", "1e-2", ["--train.checkpoint_every", "-1"]),
    ("galore2 GaLoreAdamW fp32", "galore_adamw", "1e-2", []),
    ("galore2 8-bit + fp32 basis", EIGHT, "1e-2", ["--optim.basis_dtype", "fp32"]),
    ("galore2 8-bit + bf16 basis", EIGHT, "1e-2", ["--optim.basis_dtype", "bf16"]),
    ("galore2 8-bit + INT8 basis", EIGHT, "1e-2", ["--optim.basis_dtype", "int8"]),
    ("galore2 8-bit + INT4 basis", EIGHT, "1e-2", ["--optim.basis_dtype", "int4"]),
    ("galore2 8-bit + INT4 basis + Hadamard", EIGHT, "1e-2",
     ["--optim.basis_dtype", "int4", "--optim.basis_hadamard", "true"]),
]  # fmt: skip
# The low_memory table's 7B column counts galore-torch by shapes alone (fp32 moments at the
# low-rank shape + an r × small basis: pytorch-optimizer GaLore's rule), as first published;
# the suite's state_7b counts galore-torch 1.0's real small × small basis view instead.
STATE_7B_RULE = {"gt_galore_adamw": "pto_galore"}


def _steps(quick: bool) -> int | None:
    return QUICK_STEPS if quick else None


def _run(name: str, lr: str, quick: bool, flags: list[str] | tuple[str, ...] = ()) -> dict:
    """Final validation loss, mean tokens/s (steps after the first) and state bytes of one run."""
    hist = tiny_run(name, lr, flags, _steps(quick))
    rate = [r["tokens_per_s"] for r in hist[1:]]
    return {"val": val_losses(hist)[-1], "rate": sum(rate) / max(len(rate), 1),
            "bytes": hist[-1]["opt_state_bytes"]}  # fmt: skip


def recipe_tiny(quick: bool) -> str:
    results = [(name, lr, _run(name, lr, quick)) for name, lrs in SWEEP.items() for lr in lrs]
    best = min((r for n, _, r in results if n == "adamw"), key=lambda r: r["val"])
    rows = [[name, lr, f"{r['val']:.4f}", f"{r['val'] / best['val']:.3f}", f"{r['rate']:,.0f}",
             f"{r['rate'] / best['rate']:.2f}", f"{r['bytes'] / 1e6:.2f}",
             f"{r['bytes'] / best['bytes']:.3f}"]
            for name, lr, r in results]  # fmt: skip
    headers = ["optimizer", "lr", "final val loss", "÷ best AdamW", "tokens/s", "÷ AdamW",
               "state MB", "÷ AdamW"]  # fmt: skip
    return render("tiny", "recipe_tiny", steps=QUICK_STEPS if quick else 400,
                  table=table(headers, rows))  # fmt: skip


def throughput(quick: bool, repeats: int | None = None) -> str:
    """tokens/s of ``galore_adamw`` against ``adamw`` on the tiny recipe: the two alternate
    (adamw, galore_adamw, adamw, …), ``repeats`` runs each (3), so drift hits both alike."""
    repeats = repeats or 3
    names = {"adamw": "1e-3", "galore_adamw": "1e-2"}
    rates: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(repeats):
        for name, lr in names.items():
            rates[name].append(_run(name, lr, quick)["rate"])
    med = {n: statistics.median(r) for n, r in rates.items()}
    rows = [[n, ", ".join(f"{x:,.0f}" for x in r), f"{med[n]:,.0f}",
             f"{(max(r) - min(r)) / med[n]:.1%}", f"{med[n] / med['adamw']:.3f}"]
            for n, r in rates.items()]  # fmt: skip
    headers = ["optimizer", "tokens/s of each run (in run order)", "median", "spread (max−min)/median",
               "÷ AdamW"]  # fmt: skip
    return render("tiny", "throughput", steps=QUICK_STEPS if quick else 400, repeats=repeats,
                  table=table(headers, rows))  # fmt: skip


def ranger21(quick: bool) -> str:
    lrs = RANGER21_LRS[1:2] if quick else RANGER21_LRS
    names = [n for n in RANGER21_OPTIMIZERS if optimizers.available(n, PEERS)]
    missing = [n for n in RANGER21_OPTIMIZERS if n not in names]
    best: dict[str, tuple[str, dict[str, Any]]] = {}
    rows = []
    for name in names:
        for lr in lrs:
            r = _run(name, lr, quick)
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
            r = _run("galore_ranger21", lr, quick)
        finally:
            galore2.GaLoreRanger21 = original
        abl.append([f"{switch}=False", f"{r['val']:.4f}", f"{r['val'] - ref['val']:+.4f}",
                    f"{r['bytes'] / 1e6:.2f}"])  # fmt: skip
    return render(
        "tiny", "ranger21", steps=QUICK_STEPS if quick else 400, lr=lr,
        missing=render("tiny", "ranger21_missing", names=", ".join(missing)) if missing else "",
        summary=table(["optimizer", "best lr", "val loss", "÷ AdamW", "state MB", "÷ AdamW"],
                      summary),
        sweep=table(["optimizer", "lr", "val loss", "state MB"], sweep),
        ablation=table(["GaLoreRanger21", "val loss", "Δ vs all on", "state MB"], abl),
    )  # fmt: skip


def _optim_config(name: str, rank: int, flags: list[str]) -> OptimConfig:
    settings = {"name": STATE_7B_RULE.get(name, name), "rank": rank, **optim_flags(flags)}
    return optim_config(settings)


def state_7b_variants(quick: bool) -> tuple[dict[str, int], str]:
    """label → Llama-7B state bytes of every low_memory variant, and the model's description."""
    job, _ = shapes(quick)
    model, rank, m = meta_model(job), optimizers.setting(job.optim, "rank"), job.model
    out = {}
    for label, name, _, flags in VARIANTS:
        state = optimizer_state(model, _optim_config(name, rank, flags))
        assert state is not None, label
        out[label] = state["total"]
    return out, f"r={rank}, dim {m.dim}, {m.n_layers} layers"


def _adaptive(quick: bool) -> list[list[str]]:
    rows = []
    original = galore2.optim.GaLore.refresh
    for adaptive in ("false", "true"):
        spent = [0.0, 0]

        def timed(self, *args, spent=spent, **kwargs):
            start = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
                spent[1] += 1

        galore2.optim.GaLore.refresh = timed
        try:
            res = _run("galore_adamw", "1e-2", quick, ["--optim.adaptive_refresh", adaptive])
        finally:
            galore2.optim.GaLore.refresh = original
        rows.append([f"adaptive_refresh={adaptive}", str(spent[1]), f"{spent[0]:.3f}",
                     f"{res['val']:.4f}"])  # fmt: skip
    return rows


def low_memory(quick: bool) -> str:
    bytes_7b, shape = state_7b_variants(quick)
    results = {label: _run(name, lr, quick, flags) for label, name, lr, flags in VARIANTS}
    adaptive_rows = _adaptive(quick)
    base7 = bytes_7b["torch AdamW fp32"]
    ref = results["galore2 GaLoreAdamW fp32"]["val"]
    adamw = results["torch AdamW fp32"]["bytes"]
    rows = []
    for label, *_ in VARIANTS:
        b7, res = bytes_7b[label], results[label]
        rows.append([label, f"{b7 / 1e9:.2f}", f"{b7 / base7:.3f}", f"{res['val']:.4f}",
                     f"{res['val'] / ref:.4f}", f"{res['bytes'] / 1e6:.2f}",
                     f"{res['bytes'] / adamw:.3f}"])  # fmt: skip
    headers = ["variant", "7B state GB", "÷ AdamW", "tiny val loss", "÷ galore2 fp32",
               "tiny state MB", "÷ AdamW"]  # fmt: skip
    return render("tiny", "low_memory", shape=shape, steps=QUICK_STEPS if quick else 400,
                  table=table(headers, rows),
                  adaptive=table(["setting", "refreshes", "refresh s", "val loss"],
                                 adaptive_rows))  # fmt: skip
