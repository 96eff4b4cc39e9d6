"""The public optimizers: thin presets of :class:`~galore2.core.ChainOptimizer`."""

from .adafactor import GaLoreAdafactor
from .adamw import GaLoreAdamW, GaLoreAdamW8bit
from .ranger21 import GaLoreRanger21, Ranger21

__all__ = ["GaLoreAdafactor", "GaLoreAdamW", "GaLoreAdamW8bit", "GaLoreRanger21", "Ranger21"]
