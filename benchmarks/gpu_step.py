"""Optimizer step time on a GPU at Llama-7B layer shapes, with the syncs torch reports.

``python -m benchmarks.run --tasks gpu_step`` (a CUDA device; ~5 min on an H100):

* **step** — Llama-7B shapes (dim 4096, ffn 11008, 32 heads, vocab 32000) with
  ``LAYERS`` decoder layers, fp32 parameters and gradients (fixed seeded values). GaLore's
  7B settings on every attention and MLP matrix: rank 1024, α = 0.25, the refresh gap large
  (non-refresh steps are timed); embeddings, norms and the head get AdamW. Each optimizer
  takes 3 untimed steps (the first creates state and the bases), then ``REPEATS`` steps
  each timed with CUDA events (:func:`benchmarks.timing.time_steps`, one optimizer at a
  time); the median is reported, with the ratio to torch AdamW (foreach) measured in the
  same run. **syncs/step**: warnings raised by
  ``torch.cuda.set_sync_debug_mode("warn")`` during one step — every device→host
  synchronization torch performs (``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero``…).
* **refresh** — one step with ``update_proj_gap=1`` (every matrix refreshes) minus the
  median non-refresh step, per projector, on one decoder layer (7 matrices).
* **projection batching** — the projection R = PᵀG of 32 same-shape matrices (4096×4096,
  r = 1024: one per 7B layer) as 32 ``mm`` calls vs ``torch.stack`` + one ``bmm``.

``--quick`` runs the same on small shapes (smoke test; works on the CPU with
``GALORE2_BENCH_DEVICE=cpu``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch

import galore2
from recipes.config import ModelConfig

from ._common import table
from .timing import llama, median_ms, seeded_grads, time_calls, time_steps

LAYERS, RANK, REPEATS = 4, 1024, 10
SEVEN_B = {"vocab_size": 32000, "dim": 4096, "n_heads": 32, "ffn_dim": 11008}
QUICK = {"vocab_size": 512, "dim": 128, "n_heads": 4, "ffn_dim": 344}


def _device() -> torch.device:
    return torch.device(os.environ.get("GALORE2_BENCH_DEVICE", "cuda"))


def _model(quick: bool, layers: int) -> torch.nn.Module:
    cfg = ModelConfig(**(QUICK if quick else SEVEN_B), n_layers=layers, max_seq_len=16)
    return llama(cfg, _device())


def _groups(model: torch.nn.Module, rank: int, gap: int, projector: str | None = None) -> list:
    groups = galore2.param_groups(model, rank=rank, update_proj_gap=gap, scale=0.25)
    if projector is not None:
        for g in groups:
            if g.get("rank") is not None:
                g["projector"] = projector
    return groups


def _syncs(opt: torch.optim.Optimizer) -> int | str:
    if _device().type != "cuda":
        return "n/a"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            opt.step()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


MAKERS: dict[str, Callable] = {
    "torch AdamW (foreach)": lambda m, r, gap: torch.optim.AdamW(m.parameters(), foreach=True),
    "torch AdamW (fused)": lambda m, r, gap: torch.optim.AdamW(m.parameters(), fused=True),
    "galore2 GaLoreAdamW (default: batched)": lambda m, r, gap: galore2.GaLoreAdamW(
        _groups(m, r, gap)
    ),
    "galore2 GaLoreAdamW, foreach=False": lambda m, r, gap: galore2.GaLoreAdamW(
        _groups(m, r, gap), foreach=False
    ),
    "galore2 GaLoreAdamW, capturable=True": lambda m, r, gap: galore2.GaLoreAdamW(
        _groups(m, r, gap), capturable=True
    ),
    "galore2 GaLoreAdamW, compile=True": lambda m, r, gap: galore2.GaLoreAdamW(
        _groups(m, r, gap), compile=True
    ),
    "galore2 GaLoreAdamW8bit": lambda m, r, gap: galore2.GaLoreAdamW8bit(_groups(m, r, gap)),
    "galore2 Fira": lambda m, r, gap: galore2.Fira(_groups(m, r, gap)),
    "galore2 GaLoreAdafactor": lambda m, r, gap: galore2.GaLoreAdafactor(_groups(m, r, gap)),
}


def _galore_torch(m: torch.nn.Module, rank: int, gap: int) -> torch.optim.Optimizer:
    from galore_torch import GaLoreAdamW

    projected = [p for n, p in m.named_parameters() if p.dim() == 2 and ("attn" in n or "mlp" in n)]
    ids = {id(p) for p in projected}
    rest = [p for p in m.parameters() if id(p) not in ids]
    return GaLoreAdamW(
        [{"params": rest},
         {"params": projected, "rank": rank, "update_proj_gap": gap, "scale": 0.25,
          "proj_type": "std"}]
    )  # fmt: skip


def step_rows(quick: bool) -> list[list]:
    device = _device()
    rank = 16 if quick else RANK
    makers = dict(MAKERS)
    try:
        import galore_torch  # noqa: F401

        makers["galore-torch 1.0 GaLoreAdamW"] = _galore_torch
    except ImportError:
        pass
    model = _model(quick, 2 if quick else LAYERS)
    seeded_grads(model)
    syncs: dict[str, int | str] = {}
    builders = {
        name: (lambda make=make: make(model, rank, 10**9).step) for name, make in makers.items()
    }
    times = time_steps(builders, 1, REPEATS, 3, device, interleave=False,
                       after=lambda name, step: syncs.update({name: _syncs(step.__self__)}))  # fmt: skip
    results: dict[str, tuple[float, int | str]] = {}
    for name, ts in times.items():
        if isinstance(ts, Exception):  # a contender that cannot run here: say why
            results[name] = (float("nan"), f"{type(ts).__name__}: {ts}"[:80])
        else:
            results[name] = (median_ms(ts), syncs[name])
    base = results["torch AdamW (foreach)"][0]
    return [[n, f"{t:.2f}", f"{t / base:.2f}×", s] for n, (t, s) in results.items()]


def refresh_rows(quick: bool) -> list[list]:
    device = _device()
    rank = 16 if quick else RANK
    model = _model(quick, 1)
    seeded_grads(model)
    rows = []
    for projector in ("svd", "randomized", "power"):
        steady = galore2.GaLoreAdamW(_groups(model, rank, 10**9, projector))
        every = galore2.GaLoreAdamW(_groups(model, rank, 1, projector))
        for _ in range(2):
            steady.step()
            every.step()
        base = median_ms(time_calls(steady.step, 5, device=device))
        ref = median_ms(time_calls(every.step, 3, device=device))
        rows.append([projector, f"{ref - base:.1f}"])
    svd = float(rows[0][1])
    return [[p, t, f"{svd / float(t):.1f}×"] for p, t in rows]


def batching_rows(quick: bool) -> list[list]:
    device = _device()
    n, r, k = (128, 16, 8) if quick else (4096, RANK, 32)
    gen = torch.Generator(device=_device()).manual_seed(2)
    G = [torch.randn(n, n, generator=gen, device=_device()) for _ in range(k)]
    P = [torch.randn(n, r, generator=gen, device=_device()) for _ in range(k)]

    def loop() -> None:
        for p, g in zip(P, G, strict=True):
            torch.mm(p.mT, g)

    def batched() -> None:
        torch.bmm(torch.stack(P).mT, torch.stack(G))

    out = []
    for name, fn in (("32 × mm", loop), ("stack + bmm", batched)):
        out.append([name, f"{median_ms(time_calls(fn, 10, 1, device)):.2f}"])
    return out


def gpu_step(quick: bool = False) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        steps = step_rows(quick)
        refresh = refresh_rows(quick)
        batching = batching_rows(quick)
    name = torch.cuda.get_device_name() if _device().type == "cuda" else "CPU"
    layers = 2 if quick else LAYERS
    return "\n\n".join(
        [
            f"{name}; {layers} decoder layers of Llama-7B shapes (fp32), GaLore rank "
            f"{16 if quick else RANK} on the attention and MLP matrices, non-refresh steps: "
            f"median of {REPEATS} steps timed with CUDA events after 3 untimed ones.",
            table(["optimizer", "ms/step", "vs AdamW (foreach)", "syncs/step"], steps),
            "Refresh of one decoder layer's 7 matrices (a step with update_proj_gap=1 minus a "
            "non-refresh step; median of 3):",
            table(["projector", "ms", "speedup vs exact SVD"], refresh),
            "Projection R = PᵀG of 32 same-shape matrices (4096×4096, r = 1024):",
            table(["how", "ms"], batching),
        ]
    )
