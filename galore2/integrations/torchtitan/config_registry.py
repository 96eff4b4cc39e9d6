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

from .common import GALORE_7B, GALORE_DEBUG
from .container import galore_config

__all__ = ["GALORE_7B", "GALORE_DEBUG", "llama3_8b_galore", "llama3_8b_galore_8bit",
           "llama3_debugmodel_galore"]  # fmt: skip


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
