"""Collective traffic of galore2 under FSDP2 for Llama-7B shapes, on paper (meta device).

Usage (repository root, venv active)::

    python -m benchmarks.traffic_7b            # Llama-7B, r=1024, p = 8, 64, 512
    python -m benchmarks.traffic_7b --quick    # dim 256, 2 layers, r=64, p = 2, 8

Nothing is measured: every number comes from :func:`galore2.traffic.collective_bytes`,
the formula ``tests/test_fsdp_traffic.py`` checks against the collectives that spawned
FSDP2 runs issue at p = 2 and 3. The model is ``LlamaForCausalLM`` built under
``torch.device("meta")`` as in ``benchmarks/memory_7b.py`` (fp32, untied head); GaLore
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

from ._common import cli, table
from .memory_7b import FULL_SIZE, QUICK_SIZE, TARGETS, meta_llama

FULL_WORLDS = (8, 64, 512)
QUICK_WORLDS = (2, 8)
PROJECTORS = ("randomized", "power", "svd", "random")
GAP = 200  # GaLore's default update_proj_gap, for the amortized column


def _gb(x: float) -> str:
    return f"{x / 1e9:.3f}" if x >= 1e6 or x == 0 else f"{x / 1e3:.1f} kB"


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def traffic(model: torch.nn.Module, size: dict[str, int], p: int, **kw: Any) -> Traffic:
    units = [f"model.layers.{i}" for i in range(size["layers"])]
    return collective_bytes(
        model,
        p,
        rank=size["rank"],
        target_modules=TARGETS,
        fsdp_units=units,
        update_proj_gap=GAP,
        **kw,
    )


def run(quick: bool = False) -> dict[str, Any]:
    size = QUICK_SIZE if quick else FULL_SIZE
    worlds = QUICK_WORLDS if quick else FULL_WORLDS
    model = meta_llama(size)
    results: dict[int, dict[str, Traffic]] = {}
    mixed: dict[int, Traffic] = {}
    for p in worlds:
        results[p] = {proj: traffic(model, size, p, projector=proj) for proj in PROJECTORS}
        mixed[p] = traffic(model, size, p, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

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
    per_layer = traffic(model, size, worlds[0], per_layer=True)
    n_params = sum(p.numel() for p in model.parameters())
    down = [c for c in t8.step if c.op == "reduce_scatter"]
    md = (
        f"LlamaForCausalLM on the meta device (dim {size['hidden']}, {size['layers']} layers, "
        f"ffn {size['ffn']}, vocab {size['vocab']}, {n_params:,} fp32 params), GaLore on "
        f"q/k/v/o/gate/up/down at r={size['rank']} ({len(t8.galore_params)} weights), FSDP2 "
        f"`fully_shard` per decoder layer + root, p = FSDP world size. **Computed, not "
        f"measured**: `galore2.traffic.collective_bytes`, the formula "
        f"`tests/test_fsdp_traffic.py` checks call by call against the collectives FSDP2 runs "
        f"issue at p = 2 and 3. Per rank = bytes received by a rank under ring algorithms, "
        f"averaged over ranks (see `benchmarks/traffic_7b.py`). FSDP2 per step = forward "
        f"all-gather + backward all-gather (not the root's) + gradient reduce-scatter, fp32 "
        f"(the '… bf16' column: `MixedPrecisionPolicy(param_dtype=bf16, "
        f"reduce_dtype=fp32)`).\n\n"
        f"Every step galore2 adds, per left-projected weight ({len(down)} down_proj "
        f"{size['hidden']}×{size['ffn']}), a reduce-scatter of PᵀG and an all-gather of Adam's "
        f"direction ({size['rank']}×{size['ffn']} fp32 each), plus one int32 flag per "
        f"parameter (one all-reduce per group); right-projected weights (q/k/v/o/gate/up) "
        f"need no per-step collective.\n\n"
        + table(step_headers, step_rows)
        + f"\n\nPer refresh (every {GAP} steps at the default gap; later refreshes — the "
        f"first differs only for `power`, a randomized cold start):\n\n"
        + table(refresh_headers, refresh_rows)
        + "\n\n`svd` gathers each weight's gradient onto one owner rank (owners balanced by SVD "
        "cost, `galore2.fsdp.assign_owners`) and broadcasts the basis: its per-rank column is an "
        "average, the owner receiving the whole m×n gradient it factors. `random` moves only the scalar `usable_norm` all-reduces. "
        "Per step the all-gather carries Adam's direction in `state_dtype` (fp32 here); it is "
        "cast to the parameter dtype only after the gather. With per-layer updates "
        f"(`galore2.per_layer`) the same bytes go in {per_layer.calls('step')} calls per step "
        f"(one 1-flag all-reduce per parameter, inside backward) instead of {t8.calls('step')}."
    )
    return {"markdown": md, "traffic": results, "mixed": mixed}


def main(argv: list[str] | None = None) -> None:
    cli("benchmarks.traffic_7b", __doc__, run, argv)


if __name__ == "__main__":
    main()
