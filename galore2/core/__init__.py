"""The core every galore2 optimizer shares: the module protocols, the one optimizer loop
(:class:`ChainOptimizer`), per-layer updates and the option declarations."""

from .modules import GradientTransform, ParamTransform
from .optimizer import ChainOptimizer
from .per_layer import PerLayerUpdates, per_layer
from .transform import Context, LowRankUpdate, Transform

__all__ = [
    "ChainOptimizer",
    "Context",
    "GradientTransform",
    "LowRankUpdate",
    "ParamTransform",
    "PerLayerUpdates",
    "Transform",
    "per_layer",
]
