"""Optimizers and the per-tensor transforms they are built from."""

from .adam import ScaleByAdam
from .adamw import GaLoreAdamW
from .galore import GaLore
from .optimizer import ChainOptimizer
from .transform import Context, Transform

__all__ = ["ChainOptimizer", "Context", "GaLore", "GaLoreAdamW", "ScaleByAdam", "Transform"]
