"""Trainer configs for ``--module galore2.integrations.torchtitan --config NAME``.

torchtitan's ``ConfigManager`` imports ``<module>.config_registry`` and calls ``NAME()``
for a ``Trainer.Config``; each function here takes torchtitan's own Llama-3 config of the
same size and swaps in a galore2 optimizer (:func:`galore_config`), so every other setting
(model, data, parallelism, LR schedule, checkpointing) is torchtitan's, and its command-line
overrides (``--training.steps``, ``--lr_scheduler.warmup_steps``…) apply as usual.

These import torchtitan's trainer and Llama-3 registry (which need torchtitan's full
dependencies: ``torchdata``, ``tensorboard``…) when called, not when imported.
"""

from __future__ import annotations

from typing import Any

from .container import galore_config

#: GaLore's published LLaMA-7B pre-training settings (its C4 script for 7B on 8 nodes):
#: rank 1024, subspace refresh every 500 steps, scale α = 0.25, lr 0.005, AdamW's default
#: betas, no weight decay. (Its schedule: 150k steps, 15k warmup, cosine to 0.1·lr, gradient
#: clipping 1.0; set with torchtitan's flags, see docs/guides/torchtitan.md.)
GALORE_7B: dict[str, Any] = {
    "lr": 5e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.0,
    "rank": 1024,
    "update_proj_gap": 500,
    "scale": 0.25,
}
#: The debug model (dim 256) at rank 64 with torchtitan's debug AdamW settings.
GALORE_DEBUG: dict[str, Any] = {
    "lr": 8e-4,
    "betas": (0.9, 0.95),
    "eps": 1e-8,
    "weight_decay": 0.1,
    "rank": 64,
    "update_proj_gap": 200,
    "scale": 0.25,
}


def _llama3(name: str, settings: dict[str, Any], optimizer: str = "galore_adamw"):
    """torchtitan's Llama-3 trainer config ``name`` with a galore2 optimizer."""
    from torchtitan.models.llama3 import config_registry

    config = getattr(config_registry, name)()
    config.optimizer = galore_config(optimizer, **settings)
    return config


def llama3_8b_galore():
    """torchtitan's ``llama3_8b`` trained with ``GaLoreAdamW`` at GaLore's 7B settings
    (:data:`GALORE_7B`): attention and MLP weights projected at rank 1024, embeddings,
    output head and norms plain AdamW."""
    return _llama3("llama3_8b", GALORE_7B)


def llama3_8b_galore_8bit():
    """:func:`llama3_8b_galore` with ``GaLoreAdamW8bit`` (8-bit moments; needs bitsandbytes)."""
    return _llama3("llama3_8b", GALORE_7B, "galore_adamw8bit")


def llama3_debugmodel_galore():
    """torchtitan's ``llama3_debugmodel`` (dim 256, 6 layers) with ``GaLoreAdamW`` at rank 64
    (:data:`GALORE_DEBUG`): a quick check that a setup runs."""
    return _llama3("llama3_debugmodel", GALORE_DEBUG)
