"""The core every galore2 optimizer shares: the module protocols, the one optimizer loop
(:class:`ChainOptimizer`), per-layer updates, CUDA-graph capture of capturable steps and the
option declarations."""

from .capture import CapturedStep
from .module import Module
from .modules import DecoupledWeightDecay, GradientTransform, ParamTransform
from .optimizer import ChainOptimizer
from .per_layer import PerLayerUpdates, per_layer
from .transform import Context, LowRankUpdate, ResidualUpdate, ScaledUpdate, Transform

__all__ = [
    "CapturedStep",
    "ChainOptimizer",
    "Context",
    "DecoupledWeightDecay",
    "GradientTransform",
    "LowRankUpdate",
    "Module",
    "ParamTransform",
    "PerLayerUpdates",
    "ResidualUpdate",
    "ScaledUpdate",
    "Transform",
    "per_layer",
]
