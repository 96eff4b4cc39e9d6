"""Every optimizer the side-by-side suite measures, and whether it can run here.

A contender is a recipe optimizer (``--optimizer NAME``, see ``recipes/optimizers.py``)
or a peer (``benchmarks/peers.py``) plus recipe flags. Peers come from their PyPI packages
(the ``bench`` extra); a peer that cannot run on this machine is kept in the list
with the exact exception its first step raised.
"""

from __future__ import annotations

import importlib.metadata
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from galore2.presets import PRESETS
from recipes import optimizers
from recipes.config import ModelConfig, OptimConfig
from recipes.model import build_model
from recipes.resolve import optim_config

from .peers import PEERS, quiet_peers


@dataclass(frozen=True)
class Contender:
    key: str  # short id: tables, plots, --optimizers
    label: str
    optimizer: str  # recipe --optimizer name
    package: str  # PyPI distribution it comes from
    flags: tuple[str, ...] = ()  # extra recipe flags (--optim.KEY VALUE ...)
    family: str = "galore"  # "adam": full-rank lr scale (quick lr 1e-3); "galore": 1e-2
    projected: bool = True

    def optim_config(self, **fields) -> OptimConfig:
        """``OptimConfig`` for this contender: ``fields`` then ``flags`` applied, resolved as
        the recipe resolves its command line (:func:`recipes.resolve.optim_config`)."""
        return optim_config({"name": self.optimizer, **fields, **optim_flags(self.flags)})


def optim_flags(flags: Sequence[str]) -> dict[str, str]:
    """``{"KEY": VALUE}`` of the ``--optim.KEY VALUE`` pairs in recipe flags (others left out)."""
    pairs = zip(flags[::2], flags[1::2], strict=True)
    return {f.removeprefix("--optim."): v for f, v in pairs if f.startswith("--optim.")}


def _as_flags(preset: str) -> tuple[str, ...]:
    """Recipe flags giving another galore2 optimizer what preset ``preset`` sets: its
    ``preset_defaults`` and the [optim] fields it fixes (APOLLO-Mini's rank 1, α = √128)."""
    settings = PRESETS[preset].preset_defaults | optimizers.preset_fields(preset)
    return tuple(x for k, v in settings.items() for x in (f"--optim.{k}", str(v)))


def _c(key, label, optimizer, package, *flags, family="galore", projected=True) -> Contender:
    return Contender(key, label, optimizer, package, tuple(flags), family, projected)


CONTENDERS: tuple[Contender, ...] = (
    _c("adamw", "torch AdamW (foreach)", "adamw", "torch", family="adam", projected=False),
    _c("bnb_adamw8bit", "bitsandbytes AdamW8bit", "adamw8bit", "bitsandbytes",
       family="adam", projected=False),
    _c("gt_galore_adamw", "galore-torch GaLoreAdamW", "gt_galore_adamw", "galore-torch"),
    _c("gt_galore_adamw8bit", "galore-torch GaLoreAdamW8bit", "gt_galore_adamw8bit",
       "galore-torch"),
    _c("gt_galore_adafactor", "galore-torch GaLoreAdafactor", "gt_galore_adafactor",
       "galore-torch"),
    _c("qgalore", "q-galore-torch QGaLoreAdamW8bit", "qgalore_adamw8bit", "q-galore-torch"),
    # keys kept from before galore2 had its own APOLLO (results JSON); recipe names at_*
    _c("apollo", "apollo-torch APOLLO", "at_apollo", "apollo-torch"),
    _c("apollo_mini", "apollo-torch APOLLO-Mini", "at_apollo_mini", "apollo-torch"),
    _c("fira_adamw", "fira FiraAdamW", "fira_adamw", "fira"),
    _c("pto_galore", "pytorch-optimizer GaLore", "pto_galore", "pytorch-optimizer"),
    _c("pto_ranger21", "pytorch-optimizer Ranger21", "pto_ranger21", "pytorch-optimizer",
       family="adam", projected=False),
    _c("galore_adamw", "galore2 GaLoreAdamW", "galore_adamw", "galore2"),
    _c("galore_adamw_power", "galore2 GaLoreAdamW (warm power)", "galore_adamw", "galore2",
       "--optim.projector", "power"),
    _c("galore_adamw8bit", "galore2 GaLoreAdamW8bit", "galore_adamw8bit", "galore2"),
    _c("galore_adamw8bit_int8", "galore2 GaLoreAdamW8bit + INT8 basis", "galore_adamw8bit",
       "galore2", "--optim.basis_dtype", "int8"),
    _c("galore_adamw8bit_int4", "galore2 GaLoreAdamW8bit + INT4 basis + Hadamard",
       "galore_adamw8bit", "galore2", "--optim.basis_dtype", "int4",
       "--optim.basis_hadamard", "true"),
    _c("galore_adafactor", "galore2 GaLoreAdafactor", "galore_adafactor", "galore2"),
    _c("galore_adafactor_int8", "galore2 GaLoreAdafactor + INT8 basis", "galore_adafactor",
       "galore2", "--optim.basis_dtype", "int8"),
    _c("ranger21", "galore2 Ranger21", "ranger21", "galore2", family="adam", projected=False),
    _c("galore_ranger21", "galore2 GaLoreRanger21", "galore_ranger21", "galore2"),
    _c("galore2_fira", "galore2 Fira", "fira", "galore2"),
    _c("galore2_fira_reference", "galore2 Fira (fira 1.0.2's residual)", "fira", "galore2",
       "--optim.residual", "fira_reference"),
    _c("galore2_fira_power", "galore2 Fira (warm power)", "fira", "galore2",
       "--optim.projector", "power"),
    _c("galore2_fira_8bit_int8", "galore2 Fira 8-bit + INT8 basis", "galore_adamw8bit",
       "galore2", *_as_flags("fira"), "--optim.basis_dtype", "int8"),
    _c("galore2_apollo", "galore2 APOLLO", "apollo", "galore2"),
    _c("galore2_apollo_mini", "galore2 APOLLO-Mini", "apollo_mini", "galore2"),
    # no 8-bit APOLLO preset: GaLoreAdamW8bit with APOLLO's / APOLLO-Mini's settings
    _c("galore2_apollo_8bit", "galore2 APOLLO 8-bit", "galore_adamw8bit", "galore2",
       *_as_flags("apollo")),
    _c("galore2_apollo_mini_8bit", "galore2 APOLLO-Mini 8-bit", "galore_adamw8bit", "galore2",
       *_as_flags("apollo_mini")),
    _c("galore2_muon", "galore2 GaLoreMuon", "galore_muon", "galore2"),
    _c("galore2_muon_polar", "galore2 GaLoreMuon (polar)", "galore_muon", "galore2",
       "--optim.orthogonalize", "polar"),
)  # fmt: skip
BY_KEY = {c.key: c for c in CONTENDERS}


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _probe_model() -> torch.nn.Module:
    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=1, n_heads=2, ffn_dim=128, max_seq_len=16)
    torch.manual_seed(0)
    return build_model(cfg)


def _at(frame: traceback.FrameSummary) -> str:
    return f"{'/'.join(Path(frame.filename).parts[-2:])}:{frame.lineno}"


@cache
def why_not(key: str) -> str | None:
    """``None`` if the contender builds and takes two steps here; else the exact reason."""
    contender = BY_KEY[key]
    try:
        with quiet_peers():
            model = _probe_model()
            opt = optimizers.build_optimizer(model, contender.optim_config(rank=4), 10, PEERS)
            for _ in range(2):
                for p in model.parameters():
                    p.grad = torch.randn_like(p)
                opt.step()
    except Exception as e:  # a peer's own failure, reported verbatim with where it was raised
        frames = traceback.extract_tb(e.__traceback__)
        peer = PEERS.get(contender.optimizer)
        module = peer.module if peer else contender.package
        where = [_at(frames[-1])]
        own = [f for f in frames if f"/{module}/" in f.filename]
        if own and own[-1] is not frames[-1]:
            where.append(f"called from {_at(own[-1])}")
        return f"{type(e).__name__}: {e} (raised at {', '.join(where)})"
    return None
