"""The public optimizers: thin presets of :class:`~galore2.core.ChainOptimizer`."""

from .adafactor import GaLoreAdafactor
from .adamw import GaLoreAdamW, GaLoreAdamW8bit
from .lowrank import APOLLO, APOLLOMini, Fira, GaLoreMuon
from .ranger21 import GaLoreRanger21, Ranger21

#: every public optimizer by its recipe / integration name
PRESETS = {
    "galore_adamw": GaLoreAdamW,
    "galore_adamw8bit": GaLoreAdamW8bit,
    "galore_adafactor": GaLoreAdafactor,
    "ranger21": Ranger21,
    "galore_ranger21": GaLoreRanger21,
    "fira": Fira,
    "apollo": APOLLO,
    "apollo_mini": APOLLOMini,
    "galore_muon": GaLoreMuon,
}

__all__ = [
    "APOLLO",
    "PRESETS",
    "APOLLOMini",
    "Fira",
    "GaLoreAdafactor",
    "GaLoreAdamW",
    "GaLoreAdamW8bit",
    "GaLoreMuon",
    "GaLoreRanger21",
    "Ranger21",
]
