"""Task (d): every contender's optimizer state for Llama-7B, on the meta device (nothing allocated).

Model: the recipe's ``llama_7b`` config (dim 4096, 32 layers, ffn 11008, vocab
32000, untied head) with fp32 weights, built on the meta device; projected
optimizers get the attention and MLP matrices at r = 1024 (the config's rank),
everything else full rank in the same optimizer. galore2 rows: ``init_state()``
then ``state_bytes()``; peers: their storage rules (``benchmarks/state_rules.py``,
each checked against the real state on a small model by the test suite).
``--quick``: the recipe's ``llama_60m`` config at its rank.
"""

from __future__ import annotations

from dataclasses import replace

from recipes.config import JobConfig, load_toml
from recipes.model import build_model
from recipes.optimizers import build_optimizer, param_groups

from .contenders import Contender
from .state_rules import RULES, peer_state_bytes


def shapes(quick: bool) -> tuple[JobConfig, str]:
    name = "llama_60m" if quick else "llama_7b"
    job = load_toml(JobConfig(), name)
    m = job.model
    return job, f"{name}: dim {m.dim}, {m.n_layers} layers, ffn {m.ffn_dim}, r = {job.optim.rank}"


def run(contenders: list[Contender], quick: bool) -> dict[str, int | None]:
    """key → state bytes (``None``: no galore2 class and no verified rule, e.g. CUDA-only)."""
    job, _ = shapes(quick)
    model = build_model(replace(job.model, dtype="fp32"), device="meta")
    rank = job.optim.rank
    out: dict[str, int | None] = {}
    for c in contenders:
        cfg = c.optim_config(rank=rank)
        if c.package == "galore2":
            opt = build_optimizer(model, cfg, 1)
            opt.init_state()
            out[c.key] = int(opt.state_bytes()["total"])
        elif c.optimizer in RULES:
            groups = param_groups(model, cfg, c.projected)
            projected = [p for g in groups if "rank" in g for p in g["params"]]
            out[c.key] = peer_state_bytes(c.optimizer, model, projected, rank)
        else:
            out[c.key] = None
    return out
