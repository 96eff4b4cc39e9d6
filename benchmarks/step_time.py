"""Optimizer step time: non-refresh steps on a small Llama, and GaLoreAdafactor vs galore-torch's.

``python -m benchmarks.run --tasks step_time [--rounds N]``: ~3.3M params (d=256, 4
layers), rank 64; ``--quick``: d=64, 2 layers, rank 16, few steps (smoke test).

Model: ``recipes.model.build_model`` (``transformers.LlamaForCausalLM``, no hub
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
each step is timed on its own and the median is reported (:mod:`benchmarks.timing`). galore2 uses its
default projector (power); non-refresh steps do not depend on it.
On a machine with other load, OpenMP threads contend and single steps can
take 100× longer; measure on a quiet machine (or pass ``--threads 1``).

``python -m benchmarks.run --tasks adafactor_step``: the median of 7 timed calls, after 2
untimed ones, of (a) the Adafactor column statistic Σᵢ u²ᵢⱼ as ``torch.norm(u, dim=-2)``
(torch.optim.Adafactor's op) and as galore2's row-blocked ``_col_sq``; (b) one optimizer
step of galore2's GaLoreAdafactor and galore-torch's GaLoreAdafactor (both with an explicit
lr: ``relative_step=False, scale_parameter=False``) on a single weight: a 32000×1024
embedding (full rank) and 1024×2736 / 2736×1024 matrices at r = 256 (non-refresh steps).
``--quick`` is the same (about a minute).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

import galore2
from recipes.config import ModelConfig

from ._common import import_galore_torch, render, table
from .timing import llama, median_ms, seeded_grads, time_calls, time_steps

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
ADAFACTOR_SHAPES = (((32000, 1024), None), ((1024, 2736), 256), ((2736, 1024), 256))
ADAFACTOR_REPEATS, ADAFACTOR_WARMUP = 7, 2


def model_config(size: dict[str, int]) -> ModelConfig:
    """The recipe's Llama with ``size``'s shapes."""
    return ModelConfig(vocab_size=size["vocab"], dim=size["hidden"], n_layers=size["layers"],
                       n_heads=size["heads"], ffn_dim=size["ffn"])  # fmt: skip


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


def step_time(quick: bool, rounds: int | None = None) -> str:
    size = QUICK_SIZE if quick else FULL_SIZE
    rounds = rounds or size["rounds"]
    model = llama(model_config(size))
    n_params = sum(p.numel() for p in model.parameters())
    seeded_grads(model)
    opts = optimizers(model, size["rank"])
    n_galore = sum(p.numel() for p in opts["galore2 GaLoreAdamW"].param_groups[0]["params"])
    steps = {name: (lambda opt=opt: opt.step) for name, opt in opts.items()}
    times = time_steps(steps, rounds, size["steps"], WARMUP)
    for opt in opts.values():
        check_no_refresh(opt)
    ms = {name: median_ms(ts) for name, ts in times.items()}
    base, ref = ms["torch AdamW (foreach)"], ms["galore-torch 1.0 GaLoreAdamW"]
    rows = [[name, f"{v:.2f}", f"{v / base:.2f}×", f"{v / ref:.2f}×"] for name, v in ms.items()]
    headers = ["optimizer", "median ms/step", "vs AdamW(foreach)", "vs galore-torch"]
    return render("step_time", "step_time", hidden=size["hidden"], ffn=size["ffn"],
                  layers=size["layers"], vocab=size["vocab"], params=n_params,
                  projected=n_galore, rank=size["rank"], gap=GAP, warmup=WARMUP, rounds=rounds,
                  steps=size["steps"], threads=torch.get_num_threads(),
                  table=table(headers, rows))  # fmt: skip


def _adafactor_step_ms(make, shape: tuple[int, int], rank: int | None) -> float:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(*shape) * 0.02)
    group: dict = {"params": [p]}
    if rank:
        group.update(rank=rank, **GALORE)
    opt = make([group])
    p.grad = torch.randn_like(p)
    return median_ms(time_calls(opt.step, ADAFACTOR_REPEATS, ADAFACTOR_WARMUP))


def adafactor_step(quick: bool) -> str:
    """The column statistic and one GaLoreAdafactor step, galore2 vs galore-torch."""
    from galore2.optim.adafactor import _col_sq  # not public: the statistic this probes

    del quick  # already about a minute
    gt = import_galore_torch()
    u = torch.randn(32000, 1024)
    reps = (ADAFACTOR_REPEATS, ADAFACTOR_WARMUP)
    norm_ms = median_ms(time_calls(lambda: torch.norm(u, dim=-2, keepdim=True), *reps))
    blocked_ms = median_ms(time_calls(lambda: _col_sq(u), *reps))
    explicit = {"lr": 1e-2, "relative_step": False, "scale_parameter": False}
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for shape, rank in ADAFACTOR_SHAPES:
            a = _adafactor_step_ms(lambda g: galore2.GaLoreAdafactor(g, **explicit), shape, rank)
            b = _adafactor_step_ms(lambda g: gt.GaLoreAdafactor(g, warmup_init=False, **explicit),
                                   shape, rank)  # fmt: skip
            rows.append([f"{shape[0]}×{shape[1]}", rank or "full", f"{a:.1f}", f"{b:.1f}",
                         f"{a / b:.2f}"])  # fmt: skip
    headers = ["weight", "rank", "galore2 ms", "galore-torch ms", "ratio"]
    return render("step_time", "adafactor_step", repeats=ADAFACTOR_REPEATS,
                  warmup=ADAFACTOR_WARMUP, threads=torch.get_num_threads(), norm_ms=norm_ms,
                  blocked_ms=blocked_ms, speedup=norm_ms / blocked_ms,
                  table=table(headers, rows))  # fmt: skip
