"""Llama-7B shapes on the meta device (nothing allocated): optimizer state and per-GPU memory.

Model: the recipe's ``llama_7b`` config (dim 4096, 32 layers, ffn 11008, vocab 32000,
untied head) with fp32 weights, built on the meta device by ``recipes.model.build_model``;
projected optimizers get the attention and MLP matrices (q/k/v/o/gate/up/down) at the
config's r = 1024, everything else full rank in the same optimizer. ``--quick``: the
recipe's ``llama_60m`` config at its rank. Every byte count comes from ``benchmarks/state.py``:
galore2 optimizers measured (``init_state()``, then ``state_bytes()``), the others counted
by their packages' storage rules.

Tasks: ``memory_7b`` (torch AdamW vs galore2 GaLoreAdamW: moments / basis / other),
``recipe_memory_7b`` (``recipes.memory``: expected per-GPU memory of the llama_7b recipe
on 1 and 8 GPUs) and the figures of the suite's ``state_7b`` (every contender).
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

import galore2
from recipes.config import JobConfig, OptimConfig
from recipes.memory import OPTIMIZERS, report
from recipes.model import build_model
from recipes.optimizers import setting
from recipes.resolve import parse_args

from ._common import render, table
from .contenders import Contender
from .state import galore2_state, optimizer_state, projected_params


def shapes(quick: bool) -> tuple[JobConfig, str]:
    """The recipe config (``llama_60m`` with ``--quick``, else ``llama_7b``) and its description."""
    name = "llama_60m" if quick else "llama_7b"
    job = parse_args(["--config", name])
    m = job.model
    return job, f"{name}: dim {m.dim}, {m.n_layers} layers, ffn {m.ffn_dim}, r = {setting(job.optim, 'rank')}"


def meta_model(job: JobConfig) -> nn.Module:
    """The config's Llama with fp32 weights on the meta device."""
    return build_model(replace(job.model, dtype="fp32"), device="meta")


def state_by_contender(contenders: list[Contender], quick: bool) -> dict[str, int | None]:
    """key → state bytes (``None``: no galore2 class and no verified rule, e.g. CUDA-only)."""
    job, _ = shapes(quick)
    model = meta_model(job)
    out: dict[str, int | None] = {}
    for c in contenders:
        state = optimizer_state(model, c.optim_config(rank=setting(job.optim, "rank")))
        out[c.key] = None if state is None else state["total"]
    return out


def memory_7b(quick: bool) -> str:
    job, _ = shapes(quick)
    model, rank, m = meta_model(job), setting(job.optim, "rank"), job.model
    galore = OptimConfig(name="galore_adamw", options={"rank": rank})
    projected = {id(p) for p in projected_params(model, galore)}
    targets = dict.fromkeys(name.split(".")[-2].removesuffix("_proj")
                            for name, p in model.named_parameters() if id(p) in projected)  # fmt: skip
    n_params = sum(p.numel() for p in model.parameters())
    n_galore = sum(p.numel() for p in model.parameters() if id(p) in projected)
    results = {
        "torch.optim.AdamW fp32 (counted)": optimizer_state(model, OptimConfig(name="adamw")),
        "galore2 GaLoreAdamW, rank=None (plain)": galore2_state(
            galore2.GaLoreAdamW(model.parameters())
        ),
        f"galore2 GaLoreAdamW, r={rank}": optimizer_state(model, galore),
    }
    base = results["torch.optim.AdamW fp32 (counted)"]["total"]
    rows = [[name, f"{b['moments'] / 1e9:.3f}", f"{b['basis'] / 1e9:.3f}", f"{b['other']:,}",
             f"{b['total'] / 1e9:.3f}", f"{b['total'] / 2**30:.2f}", f"{b['total'] / base:.3f}"]
            for name, b in results.items()]  # fmt: skip
    headers = ["optimizer", "moments GB", "basis GB", "other bytes", "total GB", "total GiB",
               "vs AdamW"]  # fmt: skip
    return render("llama_7b", "memory_7b", dim=m.dim, layers=m.n_layers, ffn=m.ffn_dim,
                  vocab=m.vocab_size, params=n_params, targets="/".join(targets),
                  projected=n_galore, rank=rank, rest=n_params - n_galore,
                  ratio=base / results[rows[-1][0]]["total"], table=table(headers, rows))  # fmt: skip


def recipe_memory_7b() -> str:
    """``recipes.memory``'s report for llama_7b, batch 1 × 2048 on 1 and 8 GPUs (meta-device
    arithmetic: quick and full are the same)."""
    job = parse_args(["--config", "llama_7b"])
    return "\n\n".join(
        report(job, 1, 2048, world, list(OPTIMIZERS), "llama_7b", "float32") for world in (1, 8)
    )
