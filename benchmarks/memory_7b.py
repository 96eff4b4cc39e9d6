"""Optimizer-state memory for Llama-7B shapes, computed on the meta device (nothing allocated).

Usage (repository root, venv active)::

    python -m benchmarks.memory_7b            # Llama-7B: dim 4096, 32 layers, ffn 11008, r=1024
    python -m benchmarks.memory_7b --quick    # dim 256, 2 layers, ffn 688, vocab 1000, r=64

Model: ``transformers.LlamaForCausalLM`` built under ``torch.device("meta")``
(fp32, untied ``embed_tokens`` / ``lm_head``, vocab 32000). GaLore projects
every q/k/v/o/gate/up/down weight at rank 1024 (``galore2.param_groups`` with
those names); embeddings, ``lm_head`` and the norms are on plain AdamW.
``GaLoreAdamW.init_state()`` creates all state at its final shapes on the meta
device and ``state_bytes()`` counts it (moments / basis / other).

Rows: torch.optim.AdamW in fp32, counted analytically (2 × 4 bytes per
parameter for exp_avg and exp_avg_sq, plus one fp32 ``step`` scalar per
tensor); galore2 with ``rank=None`` (plain AdamW through galore2, measured the
same way as GaLore: its int64 counters are the "other" column); galore2 GaLore
at r=1024. GB = 1e9 bytes, GiB = 2**30. Expected: ≈53.9 GB vs ≈18.8 GB.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import galore2

from ._common import cli, llama, table

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FULL_SIZE = {"hidden": 4096, "ffn": 11008, "layers": 32, "heads": 32, "vocab": 32000, "rank": 1024}
QUICK_SIZE = {"hidden": 256, "ffn": 688, "layers": 2, "heads": 4, "vocab": 1000, "rank": 64}


def meta_llama(size: dict[str, int]) -> nn.Module:
    model = llama(size, device="meta")
    bad = {p.dtype for p in model.parameters()} - {torch.float32}
    assert not bad, f"expected fp32 parameters, got {bad}"
    return model


def torch_adamw_bytes(model: nn.Module) -> dict[str, int]:
    """torch.optim.AdamW's fp32 state, counted: exp_avg + exp_avg_sq, one fp32 step per tensor."""
    params = list(model.parameters())
    moments = sum(2 * 4 * p.numel() for p in params)
    other = 4 * len(params)
    return {"moments": moments, "basis": 0, "other": other, "total": moments + other}


def galore2_bytes(model: nn.Module, rank: int | None) -> dict[str, int]:
    """``state_bytes()`` of a galore2 GaLoreAdamW after ``init_state()`` (plain if rank is None)."""
    if rank is None:
        opt = galore2.GaLoreAdamW(model.parameters())
    else:
        opt = galore2.GaLoreAdamW(galore2.param_groups(model, TARGETS, rank=rank))
    opt.init_state()
    out = opt.state_bytes()
    assert all(t.device.type in ("meta", "cpu") for s in opt.state.values() for t in s.values())
    return out


def run(quick: bool = False) -> dict[str, Any]:
    size = QUICK_SIZE if quick else FULL_SIZE
    model = meta_llama(size)
    n_params = sum(p.numel() for p in model.parameters())
    groups = galore2.param_groups(model, TARGETS, rank=size["rank"])
    n_galore = sum(p.numel() for p in groups[0]["params"])
    results = {
        "torch.optim.AdamW fp32 (counted)": torch_adamw_bytes(model),
        "galore2 GaLoreAdamW, rank=None (plain)": galore2_bytes(model, None),
        f"galore2 GaLoreAdamW, r={size['rank']}": galore2_bytes(model, size["rank"]),
    }
    base = results["torch.optim.AdamW fp32 (counted)"]["total"]
    rows = [
        [
            name,
            f"{b['moments'] / 1e9:.3f}",
            f"{b['basis'] / 1e9:.3f}",
            f"{b['other']:,}",
            f"{b['total'] / 1e9:.3f}",
            f"{b['total'] / 2**30:.2f}",
            f"{b['total'] / base:.3f}",
        ]
        for name, b in results.items()
    ]
    headers = [
        "optimizer",
        "moments GB",
        "basis GB",
        "other bytes",
        "total GB",
        "total GiB",
        "vs AdamW",
    ]
    md = (
        f"LlamaForCausalLM on the meta device: dim {size['hidden']}, {size['layers']} layers, "
        f"ffn {size['ffn']}, vocab {size['vocab']}, untied head: {n_params:,} fp32 params; "
        f"GaLore on {'/'.join(t.removesuffix('_proj') for t in TARGETS)} "
        f"({n_galore:,} params) at r={size['rank']}, the rest ({n_params - n_galore:,}) on "
        f"plain AdamW. AdamW / GaLore total: {base / results[rows[-1][0]]['total']:.2f}×.\n\n"
        + table(headers, rows)
    )
    return {"markdown": md, "bytes": results, "params": n_params}


def main(argv: list[str] | None = None) -> None:
    cli("benchmarks.memory_7b", __doc__, run, argv)


if __name__ == "__main__":
    main()
