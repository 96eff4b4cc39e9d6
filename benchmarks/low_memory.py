"""Memory below every GaLore: Llama-7B optimizer state per variant, next to its training loss.

Usage (repository root, venv active)::

    python -m benchmarks.low_memory            # 7B table + tiny-recipe runs (~10 min, 2 cores)
    python -m benchmarks.low_memory --quick    # small table, 60-step runs

Part 1 — optimizer state for Llama-7B shapes on the meta device (nothing
allocated; dim 4096, 32 layers, ffn 11008, vocab 32000, untied head, GaLore on
q/k/v/o/gate/up/down at r = 1024, embeddings / head / norms full rank in the same
optimizer). galore2 rows are ``state_bytes()`` after ``init_state()``; the
torch AdamW, bitsandbytes AdamW8bit and galore-torch rows are counted by their
packages' rules (bitsandbytes 0.50.2: uint8 moments plus an fp32 absmax per
256-element block, fp32 below 4096 elements; galore-torch 1.0: fp32 moments at
the low-rank shape plus its fp32 basis, a Python-int step).

Part 2 — the same variants on the benchmark task: the README's tiny recipe
(``--config tiny``: byte-level 0.9M-parameter Llama, embedded corpus, 400 steps,
GaLore r = 32, T = 50, α = 0.25), each at its usual lr (AdamW family 1e-3, GaLore
family 1e-2, the best of benchmarks/recipe_tiny.py's sweep), final validation loss
and its ratio to fp32 GaLoreAdamW's; measured state bytes of the tiny model.

Part 3 — adaptive refresh on the same task: refreshes done and seconds spent in
them (``GaLore.refresh`` timed), loss, for fixed T = 50 vs ``adaptive_refresh``.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Any

import galore2
from galore2.optim.galore import GaLore
from recipes.pretrain import main as pretrain

from ._common import cli, table
from .memory_7b import FULL_SIZE, QUICK_SIZE, TARGETS, meta_llama, torch_adamw_bytes

BNB_BLOCK, BNB_MIN = 256, 4096
# (label, recipe optimizer, lr, extra recipe flags, 7B-table builder)
EIGHT = "galore_adamw8bit"
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


def _bnb_bytes(model) -> int:
    total = 0
    for p in model.parameters():
        n = p.numel()
        total += 2 * 4 * n if n < BNB_MIN else 2 * (n + 4 * math.ceil(n / BNB_BLOCK))
    return total + 2 * 256 * 4  # the two shared 256-entry code maps


def _galore_torch_bytes(model, rank: int) -> int:
    groups = galore2.param_groups(model, TARGETS, rank=rank)
    projected = {id(p) for p in groups[0]["params"]}
    total = 0
    for p in model.parameters():
        if id(p) in projected:
            m, n = p.shape
            total += 4 * (rank * min(m, n) + 2 * rank * max(m, n))
        else:
            total += 2 * 4 * p.numel()
    return total


def _galore2_bytes(model, rank: int, eight_bit: bool, basis: str, hadamard: bool) -> int | None:
    cls = galore2.GaLoreAdamW8bit if eight_bit else galore2.GaLoreAdamW
    groups = galore2.param_groups(model, TARGETS, rank=rank, basis_dtype=basis,
                                  basis_hadamard=hadamard)  # fmt: skip
    opt = cls(groups)
    opt.init_state()
    return opt.state_bytes()["total"]


def _table_7b(quick: bool) -> tuple[dict[str, int | None], str]:
    size = QUICK_SIZE if quick else FULL_SIZE
    model, r = meta_llama(size), size["rank"]
    out: dict[str, int | None] = {
        "torch AdamW fp32": torch_adamw_bytes(model)["total"],
        "bitsandbytes AdamW8bit": _bnb_bytes(model),
        "galore-torch GaLoreAdamW fp32": _galore_torch_bytes(model, r),
        "galore2 GaLoreAdamW fp32": _galore2_bytes(model, r, False, "fp32", False),
    }
    for label, name, _, flags in VARIANTS:
        if name == EIGHT:
            basis = flags[flags.index("--optim.basis_dtype") + 1]
            out[label] = _galore2_bytes(model, r, True, basis, "--optim.basis_hadamard" in flags)
    return out, f"r={r}, dim {size['hidden']}, {size['layers']} layers"


def _tiny(tmp: str, name: str, lr: str, flags: list[str], steps: list[str]) -> dict[str, Any]:
    out = Path(tmp) / f"run{len(list(Path(tmp).iterdir()))}"
    argv = ["--config", "tiny", "--optimizer", name, "--optim.lr", lr, "--out", str(out),
            "--train.progress", "false", *steps, *flags]  # fmt: skip
    hist = pretrain(argv)
    return {"val": [r["val_loss"] for r in hist if "val_loss" in r][-1],
            "bytes": hist[-1]["opt_state_bytes"]}  # fmt: skip


def _adaptive(tmp: str, steps: list[str]) -> list[list[str]]:
    rows = []
    original = GaLore.refresh
    for adaptive in ("false", "true"):
        spent = [0.0, 0]

        def timed(self, *args, spent=spent, **kwargs):
            start = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
                spent[1] += 1

        GaLore.refresh = timed
        try:
            flags = ["--optim.adaptive_refresh", adaptive]
            res = _tiny(tmp, "galore_adamw", "1e-2", flags, steps)
        finally:
            GaLore.refresh = original
        rows.append([f"adaptive_refresh={adaptive}", str(spent[1]), f"{spent[0]:.3f}",
                     f"{res['val']:.4f}"])  # fmt: skip
    return rows


def run(quick: bool = False) -> dict[str, Any]:
    bytes_7b, shape = _table_7b(quick)
    steps = ["--steps", "60", "--train.eval_every", "30"] if quick else []
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, name, lr, flags in VARIANTS:
            results[label] = _tiny(tmp, name, lr, flags, steps)
        adaptive_rows = _adaptive(tmp, steps)
    base7 = bytes_7b["torch AdamW fp32"] or 1
    ref = results["galore2 GaLoreAdamW fp32"]["val"]
    adamw = results["torch AdamW fp32"]["bytes"]
    rows = []
    for label, *_ in VARIANTS:
        b7, res = bytes_7b.get(label), results[label]
        rows.append([label, f"{b7 / 1e9:.2f}" if b7 else "n/a", f"{b7 / base7:.3f}" if b7 else "",
                     f"{res['val']:.4f}", f"{res['val'] / ref:.4f}", f"{res['bytes'] / 1e6:.2f}",
                     f"{res['bytes'] / adamw:.3f}"])  # fmt: skip
    headers = ["variant", "7B state GB", "÷ AdamW", "tiny val loss", "÷ galore2 fp32",
               "tiny state MB", "÷ AdamW"]  # fmt: skip
    n = "60" if quick else "400"
    md = (
        f"Llama-7B optimizer state on the meta device ({shape}; GB = 1e9 bytes) next to the "
        f"tiny recipe's final validation loss ({n} steps, nats/byte) and its measured state. "
        "AdamW family at lr 1e-3, GaLore family at 1e-2 (each family's best in the "
        "recipe_tiny sweep).\n\n" + table(headers, rows) + "\n\nAdaptive refresh "
        "(GaLoreAdamW fp32, tiny recipe, T = 50, threshold 0.4, patience 3, cap 8·T; "
        "seconds = wall time inside `GaLore.refresh`, all matrices):\n\n"
        + table(["setting", "refreshes", "refresh s", "val loss"], adaptive_rows)
    )
    return {"markdown": md, "bytes_7b": bytes_7b, "tiny": results}


def main(argv: list[str] | None = None) -> None:
    cli("benchmarks.low_memory", __doc__, run, argv)


if __name__ == "__main__":
    main()
