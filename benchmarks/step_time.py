"""Optimizer step-time benchmark: non-refresh steps on a small Llama-shaped model.

Usage (repository root, venv active)::

    python -m benchmarks.step_time            # ~3.3M params (d=256, 4 layers), rank 64
    python -m benchmarks.step_time --quick    # d=64, 2 layers, rank 16, few steps (smoke test)

Model: ``transformers.LlamaForCausalLM`` built from a ``LlamaConfig`` (no hub
access): hidden 256, ffn 688, 4 layers, 4 heads, vocab 256, untied head —
3,295,488 fp32 parameters on the CPU. GaLore targets every linear layer except
``lm_head`` (q/k/v/o 256×256, gate/up 688×256, down 256×688) at rank 64 (a
quarter of hidden), scale 0.25, proj_type "std"; embeddings, norms and the head
get plain AdamW in every optimizer. All optimizers share the one model (each keeps
its own state).

Only non-refresh steps are timed: ``update_proj_gap`` is 10**9, every
optimizer takes ``WARMUP`` untimed steps first (the first one creates state
and computes the basis), and the gradients are fixed seeded random tensors
assigned to ``.grad`` once. Timed steps are interleaved across optimizers
(rounds of ``steps`` steps each) so background load hits all of them alike;
each step is timed on its own and the median is reported. galore2 uses its
default projector (randomized); non-refresh steps do not depend on it.
On a machine with other load, OpenMP threads contend and single steps can
take 100× longer; measure on a quiet machine (or pass ``--threads 1``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import galore2

from ._common import (
    cli,
    import_galore_torch,
    llama,
    median,
    table,
    time_call,
)

FULL_SIZE = {
    "hidden": 256,
    "ffn": 688,
    "layers": 4,
    "heads": 4,
    "vocab": 256,
    "rank": 64,
    "rounds": 10,
    "steps": 10,
}
QUICK_SIZE = {
    "hidden": 64,
    "ffn": 172,
    "layers": 2,
    "heads": 2,
    "vocab": 256,
    "rank": 16,
    "rounds": 2,
    "steps": 3,
}
WARMUP = 3
GAP = 10**9
HPARAMS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
GALORE = {"update_proj_gap": GAP, "scale": 0.25, "proj_type": "std"}


def optimizers(model: nn.Module, rank: int) -> dict[str, torch.optim.Optimizer]:
    groups = galore2.param_groups(model, "all-linear", rank=rank, **GALORE)
    galore_ids = {id(p) for p in groups[0]["params"]}
    params = list(model.parameters())
    gt_groups = [
        {"params": [p for p in params if id(p) in galore_ids], "rank": rank, **GALORE},
        {"params": [p for p in params if id(p) not in galore_ids]},
    ]
    galore_torch = import_galore_torch()
    return {
        "torch AdamW (foreach)": torch.optim.AdamW(params, foreach=True, **HPARAMS),
        "torch AdamW (for-loop)": torch.optim.AdamW(params, foreach=False, **HPARAMS),
        "galore-torch 1.0 GaLoreAdamW": galore_torch.GaLoreAdamW(
            gt_groups, no_deprecation_warning=True, **HPARAMS
        ),
        "galore2 GaLoreAdamW": galore2.GaLoreAdamW(groups, **HPARAMS),
        "galore2 GaLoreAdamW, nonfinite='ignore' (no NaN check)": galore2.GaLoreAdamW(
            groups, nonfinite="ignore", **HPARAMS
        ),
        "galore2 GaLoreAdamW, rank=None (plain)": galore2.GaLoreAdamW(params, **HPARAMS),
    }


def check_no_refresh(opt: torch.optim.Optimizer) -> None:
    """Every projected parameter of a galore2 optimizer was refreshed exactly once."""
    if isinstance(opt, galore2.GaLoreAdamW):
        counts = {int(s["galore.refreshes"]) for s in opt.state.values() if "galore.refreshes" in s}
        assert counts in (set(), {1}), f"refresh counts {counts}: a timed step refreshed"


def run(quick: bool = False, rounds: int | None = None) -> dict[str, Any]:
    size = QUICK_SIZE if quick else FULL_SIZE
    rounds = rounds or size["rounds"]
    model = llama(size)
    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    opts = optimizers(model, size["rank"])
    n_galore = sum(p.numel() for p in opts["galore2 GaLoreAdamW"].param_groups[0]["params"])
    times: dict[str, list[float]] = {name: [] for name in opts}
    for opt in opts.values():
        for _ in range(WARMUP):
            opt.step()
    for _ in range(rounds):
        for name, opt in opts.items():
            times[name] += time_call(opt.step, size["steps"], warmup=0)
    for opt in opts.values():
        check_no_refresh(opt)
    ms = {name: 1e3 * median(ts) for name, ts in times.items()}
    base, ref = ms["torch AdamW (foreach)"], ms["galore-torch 1.0 GaLoreAdamW"]
    rows = [[name, f"{v:.2f}", f"{v / base:.2f}×", f"{v / ref:.2f}×"] for name, v in ms.items()]
    headers = ["optimizer", "median ms/step", "vs AdamW(foreach)", "vs galore-torch"]
    md = (
        f"LlamaForCausalLM: hidden {size['hidden']}, ffn {size['ffn']}, {size['layers']} layers, "
        f"vocab {size['vocab']}, untied head: {n_params:,} fp32 params, {n_galore:,} of them in "
        f"the GaLore group (all linear but lm_head), rank {size['rank']}. Non-refresh steps only "
        f"(update_proj_gap={GAP:.0e}, {WARMUP} untimed warm-up steps); "
        f"{rounds}×{size['steps']} timed steps per optimizer, interleaved; "
        f"{torch.get_num_threads()} threads.\n\n" + table(headers, rows)
    )
    return {"markdown": md, "ms": ms, "params": n_params}


def main(argv: list[str] | None = None) -> None:
    cli("benchmarks.step_time", __doc__, run, argv, rounds="interleaved timing rounds")


if __name__ == "__main__":
    main()
