"""The update rules and modules optimizers are built from: per-tensor transforms (Adam,
Adafactor, PNM, GaLore), gradient modules, weight modules and the Ranger21 schedules."""

from ..core.module import Module
from ..core.modules import DecoupledWeightDecay, GradientTransform, ParamTransform
from ..core.optimizer import ChainOptimizer
from ..core.transform import Context, Transform
from .adafactor import ScaleByAdafactor
from .adam import ScaleByAdam, ScaleByAdam8bit
from .galore import GaLore
from .gradient import AdaptiveGradientClipping, CentralizeGradient, NormalizeGradient
from .pnm import ScaleByPNM
from .projection import (
    FullProjection,
    LeftProjection,
    Projection,
    RightProjection,
    TuckerProjection,
    projection_for,
)
from .schedules import LinearWarmup, Ranger21Schedule, WarmdownToMin, ranger21_lr
from .weights import Lookahead, NormLoss, StableWeightDecay

__all__ = [
    "AdaptiveGradientClipping",
    "CentralizeGradient",
    "ChainOptimizer",
    "Context",
    "DecoupledWeightDecay",
    "FullProjection",
    "GaLore",
    "GradientTransform",
    "LeftProjection",
    "LinearWarmup",
    "Lookahead",
    "Module",
    "NormLoss",
    "NormalizeGradient",
    "ParamTransform",
    "Projection",
    "Ranger21Schedule",
    "RightProjection",
    "ScaleByAdafactor",
    "ScaleByAdam",
    "ScaleByAdam8bit",
    "ScaleByPNM",
    "StableWeightDecay",
    "Transform",
    "TuckerProjection",
    "WarmdownToMin",
    "projection_for",
    "ranger21_lr",
]
