"""Collective traffic of galore2 under FSDP2 for Llama-7B shapes, on paper (meta device).

``python -m benchmarks.run --tasks traffic_7b``: Llama-7B, r=1024, p = 8, 64, 512;
with ``--quick`` the recipe's llama_60m at its rank, p = 2, 8.

Nothing is measured: every number comes from :func:`galore2.traffic.collective_bytes`,
the formula ``tests/fsdp/test_fsdp_traffic.py`` checks against the collectives that spawned
FSDP2 runs issue at p = 2 and 3. The model is the recipe's ``llama_7b`` on the meta
device, as in ``benchmarks/llama_7b.py`` (fp32, untied head); GaLore
projects q/k/v/o/gate/up/down at r=1024, with ``proj_type="std"``: q/k/v/o (4096×4096)
and gate/up (11008×4096) are projected on the right (no per-step collective) and down
(4096×11008) on the left (reduce-scatter of PᵀG + all-gather of Adam's direction, both
1024×11008 fp32). FSDP2: ``fully_shard`` on each decoder layer, then on the root
(embeddings, final norm and ``lm_head`` stay unsharded between forward and backward).

GB = 1e9 bytes. "logical" = the full tensor each collective reduces / assembles /
distributes, summed over calls; "per rank" = bytes a rank receives under ring
algorithms, averaged over ranks (2(p−1)/p·N for all-reduce, (p−1)/p·N for
reduce-scatter / all-gather / broadcast, (p−1)/p²·N for a gather). FSDP's traffic is per
forward + backward of one micro-batch (it repeats with gradient accumulation; galore2's
does not).
"""

from __future__ import annotations

from typing import Any

import torch

from galore2.traffic import Traffic, collective_bytes
from recipes.config import JobConfig
from recipes.optimizers import setting

from ._common import render, table
from .llama_7b import meta_model, shapes

FULL_WORLDS = (8, 64, 512)
QUICK_WORLDS = (2, 8)
PROJECTORS = ("randomized", "power", "svd", "random")
GAP = 200  # GaLore's default update_proj_gap, for the amortized column


def _gb(x: float) -> str:
    return f"{x / 1e9:.3f}" if x >= 1e6 or x == 0 else f"{x / 1e3:.1f} kB"


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def traffic(model: torch.nn.Module, job: JobConfig, p: int, **kw: Any) -> Traffic:
    units = [f"model.layers.{i}" for i in range(job.model.n_layers)]
    return collective_bytes(model, p, rank=setting(job.optim, "rank"), target_modules=job.optim.target_modules,
                            fsdp_units=units, update_proj_gap=GAP, **kw)  # fmt: skip


def traffic_7b(quick: bool) -> str:
    job, _ = shapes(quick)
    worlds = QUICK_WORLDS if quick else FULL_WORLDS
    model = meta_model(job)
    results: dict[int, dict[str, Traffic]] = {}
    mixed: dict[int, Traffic] = {}
    for p in worlds:
        results[p] = {proj: traffic(model, job, p, projector=proj) for proj in PROJECTORS}
        mixed[p] = traffic(model, job, p, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    step_rows = []
    for p in worlds:
        t, mp = results[p]["randomized"], mixed[p]
        step_rows.append(
            [
                p,
                f"{_gb(t.bytes('fsdp'))} / {_gb(t.wire_bytes('fsdp'))}",
                f"{_gb(t.bytes('step'))} / {_gb(t.wire_bytes('step'))}",
                _pct(t.wire_bytes("step") / t.wire_bytes("fsdp")),
                _pct(mp.wire_bytes("step") / mp.wire_bytes("fsdp")),
                f"{t.calls('step')} / {t.calls('fsdp')}",
            ]
        )
    step_headers = [
        "p",
        "FSDP2 per step, GB logical / per rank",
        "galore2 per step, GB logical / per rank",
        "galore2 / FSDP2 (per rank)",
        "… with FSDP2 bf16 all-gather",
        "calls galore2 / FSDP2",
    ]

    refresh_rows = []
    for p in worlds:
        for proj in PROJECTORS:
            t = results[p][proj]
            fsdp = t.wire_bytes("fsdp")
            first = (
                "" if t.first_refresh == t.refresh else f" (first: {_gb(t.bytes('first_refresh'))})"
            )
            amortized = t.amortized_bytes(wire=True)
            refresh_rows.append(
                [
                    p,
                    proj,
                    t.calls("refresh"),
                    _gb(t.bytes("refresh")) + first,
                    _gb(t.wire_bytes("refresh")),
                    f"{t.wire_bytes('refresh') / fsdp:.3f}",
                    _gb(amortized),
                    _pct(amortized / fsdp),
                ]
            )
    refresh_headers = [
        "p",
        "projector",
        "calls",
        "GB logical",
        "GB per rank",
        "× one FSDP2 step",
        f"galore2 per step incl. refresh/{GAP}, GB per rank",
        "vs FSDP2",
    ]

    t8 = results[worlds[0]]["randomized"]
    per_layer = traffic(model, job, worlds[0], per_layer=True)
    n_params = sum(p.numel() for p in model.parameters())
    down = [c for c in t8.step if c.op == "reduce_scatter"]
    m = job.model
    return render("traffic_7b", dim=m.dim, layers=m.n_layers, ffn=m.ffn_dim, vocab=m.vocab_size,
                  params=n_params, rank=setting(job.optim, "rank"), weights=len(t8.galore_params),
                  left=len(down), step_table=table(step_headers, step_rows), gap=GAP,
                  refresh_table=table(refresh_headers, refresh_rows),
                  per_layer_calls=per_layer.calls("step"), calls=t8.calls("step"))  # fmt: skip
