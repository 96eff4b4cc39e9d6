"""The public optimizers: thin presets of :class:`~galore2.core.ChainOptimizer`."""

from .adafactor import GaLoreAdafactor
from .adamw import GaLoreAdamW, GaLoreAdamW8bit
from .ranger21 import GaLoreRanger21, Ranger21

#: every public optimizer by its recipe / integration name
PRESETS = {
    "galore_adamw": GaLoreAdamW,
    "galore_adamw8bit": GaLoreAdamW8bit,
    "galore_adafactor": GaLoreAdafactor,
    "ranger21": Ranger21,
    "galore_ranger21": GaLoreRanger21,
}

__all__ = [
    "PRESETS",
    "GaLoreAdafactor",
    "GaLoreAdamW",
    "GaLoreAdamW8bit",
    "GaLoreRanger21",
    "Ranger21",
]
