"""Optimizers, the per-tensor transforms they are built from, and the Ranger21 modules."""

from .adafactor import GaLoreAdafactor, ScaleByAdafactor
from .adam import ScaleByAdam
from .adam8bit import ScaleByAdam8bit
from .adamw import GaLoreAdamW, GaLoreAdamW8bit
from .galore import GaLore
from .gradient import AdaptiveGradientClipping, CentralizeGradient, NormalizeGradient
from .hooks import GradientTransform, ParamTransform
from .optimizer import ChainOptimizer
from .pnm import ScaleByPNM
from .ranger21 import GaLoreRanger21, Ranger21
from .schedules import LinearWarmup, Ranger21Schedule, WarmdownToMin, ranger21_lr
from .transform import Context, Transform
from .weights import Lookahead, NormLoss, StableWeightDecay

__all__ = [
    "AdaptiveGradientClipping",
    "CentralizeGradient",
    "ChainOptimizer",
    "Context",
    "GaLore",
    "GaLoreAdafactor",
    "GaLoreAdamW",
    "GaLoreAdamW8bit",
    "GaLoreRanger21",
    "GradientTransform",
    "LinearWarmup",
    "Lookahead",
    "NormLoss",
    "NormalizeGradient",
    "ParamTransform",
    "Ranger21",
    "Ranger21Schedule",
    "ScaleByAdafactor",
    "ScaleByAdam",
    "ScaleByAdam8bit",
    "ScaleByPNM",
    "StableWeightDecay",
    "Transform",
    "WarmdownToMin",
    "ranger21_lr",
]
