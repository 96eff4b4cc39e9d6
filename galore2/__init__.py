"""galore2: drop-in torch.optim optimizers with GaLore 2 low-rank gradient projection.

Only torch is required to import this package; optional backends
(bitsandbytes, triton, transformers) are imported lazily where used.
"""

from .core import CapturedStep, ChainOptimizer, PerLayerUpdates, per_layer
from .groups import param_groups
from .presets import (
    APOLLO,
    APOLLOMini,
    Fira,
    GaLoreAdafactor,
    GaLoreAdamW,
    GaLoreAdamW8bit,
    GaLoreMuon,
    GaLoreRanger21,
    Ranger21,
)
from .quantize import quantize_weights

# The one version source: pyproject.toml reads this line without importing galore2
# ([tool.setuptools.dynamic]), so it stays a plain string literal.
__version__ = "0.2.0"

__all__ = [
    "APOLLO",
    "APOLLOMini",
    "CapturedStep",
    "ChainOptimizer",
    "Fira",
    "GaLoreAdafactor",
    "GaLoreAdamW",
    "GaLoreAdamW8bit",
    "GaLoreMuon",
    "GaLoreRanger21",
    "PerLayerUpdates",
    "Ranger21",
    "__version__",
    "param_groups",
    "per_layer",
    "quantize_weights",
]
