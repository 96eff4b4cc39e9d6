"""``Ranger21`` and ``GaLoreRanger21``: AdamW plus Ranger21's components, each a switch.

Ranger21 (Wright & Demeure 2021, arXiv 2106.13731) is AdamW with eight add-ons. Here
each is a separate module (usable in any :class:`ChainOptimizer`), and these presets
compose them. Per step, in this order:

==========================  ============================  ===============================
component (switch)          acts on                       state per element
==========================  ============================  ===============================
AGC (``use_agc``)           full gradient, per row        0
centralization (``use_gc``) full gradient, per row        0
normalization (``use_gn``)  full gradient, whole tensor   0
GaLore projection           (GaLoreRanger21 only)         basis r·min(m,n)/(m·n)
PNM (``use_pnm``)           moments: full or subspace     3 (Adam without PNM: 2)
softplus / AdamD / AMSGrad  the PNM denominator           AMSGrad: +1
update ``p ← p − lr·u``     weights
norm loss                   weights, per row              0
stable weight decay         weights (σ over all params)   0
lookahead                   weights, every k steps        1 (param dtype) or 0.5 (bf16)
warmup / warmdown           the learning rate             one int64 counter per param
==========================  ============================  ===============================

Inside GaLore the gradient modules and the weight modules act in full space; the moment
module (PNM, with its softplus denominator) acts on the projected gradient, and stable
weight decay's σ² sums the low-rank second moments divided by the *full* element
count. With every switch off, ``Ranger21`` is ``torch.optim.AdamW`` (tested).

Fixed relative to the reference implementation: stable weight decay and norm loss
reach every parameter (issue #53); lookahead and schedule counters are in the state
dict, so resuming is exact (issue #18); the schedule keeps per-group learning rates;
AMSGrad stores its running max; PNM uses β₀; normalization cannot produce NaN.
Decay order: stable weight decay is applied after the update (σ needs this step's
second moments of every parameter), the order galore-torch uses for projected matrices.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from ..core.config import GALORE_DEFAULTS
from ..core.optimizer import ChainOptimizer, ParamsT
from ..optim.adam import ScaleByAdam
from ..optim.galore import GaLore
from ..optim.gradient import AdaptiveGradientClipping, CentralizeGradient, NormalizeGradient
from ..optim.pnm import ScaleByPNM
from ..optim.schedules import ranger21_lr
from ..optim.weights import Lookahead, NormLoss, StableWeightDecay

_LOOKAHEAD_DTYPES = (None, "bfloat16")


def _schedule(
    group: dict[str, Any], step: int, *, warmup: bool, warmdown: bool, options: dict[str, Any]
) -> float:
    return ranger21_lr(
        float(group["lr"]),
        step,
        group["num_iterations"],
        beta2=group["betas"][1],
        warmup=warmup,
        warmdown=warmdown,
        **options,
    )


class _Ranger21Base(ChainOptimizer):
    _galore = False

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        num_iterations: int | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-4,
        *,
        use_agc: bool = True,
        agc_clip: float = 1e-2,
        agc_eps: float = 1e-3,
        use_gc: bool = True,
        use_gn: bool = True,
        gn_eps: float = 1e-8,
        use_pnm: bool = True,
        pnm_beta0: float = 1.0,
        softplus: bool = True,
        softplus_beta: float = 50.0,
        adamd: bool = False,
        amsgrad: bool = False,
        use_norm_loss: bool = True,
        norm_loss_factor: float = 1e-4,
        norm_loss_eps: float = 1e-8,
        use_stable_weight_decay: bool = True,
        use_lookahead: bool = True,
        lookahead_k: int = 5,
        lookahead_alpha: float = 0.5,
        lookahead_dtype: str | None = None,
        use_warmup: bool = True,
        use_warmdown: bool = True,
        warmup_iterations: int | None = None,
        warmdown_start: float = 0.72,
        min_lr: float = 3e-5,
        maximize: bool = False,
        state_dtype: str | torch.dtype = "float32",
        nonfinite: str = "skip",
        **galore: Any,
    ) -> None:
        unknown = set(galore) - set(GALORE_DEFAULTS)
        if unknown or (galore and not self._galore):
            allowed = sorted(GALORE_DEFAULTS) if self._galore else "none (use GaLoreRanger21)"
            raise TypeError(
                f"unexpected keyword arguments {sorted(unknown or galore)}; GaLore options: "
                f"{allowed}"
            )
        if not use_pnm and (softplus or adamd or amsgrad):
            on = [
                n for n, v in (("softplus", softplus), ("adamd", adamd), ("amsgrad", amsgrad)) if v
            ]
            raise ValueError(
                f"{', '.join(on)} modify the PNM moment module: they need use_pnm=True "
                "(or switch them off)"
            )
        if (use_warmup or use_warmdown) and num_iterations is None:
            raise ValueError(
                "num_iterations (the run's optimizer steps) is required for the warmup / "
                "warmdown schedule; pass it, or use_warmup=False and use_warmdown=False"
            )
        if num_iterations is not None and (
            not isinstance(num_iterations, int) or num_iterations < 1
        ):
            raise ValueError(f"num_iterations must be an int >= 1, got {num_iterations!r}")
        if lookahead_dtype not in _LOOKAHEAD_DTYPES:
            raise ValueError(
                f"lookahead_dtype must be one of {_LOOKAHEAD_DTYPES}, got {lookahead_dtype!r}"
            )
        defaults: dict[str, Any] = {
            **GALORE_DEFAULTS,
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "maximize": maximize,
            "state_dtype": state_dtype,
            "nonfinite": nonfinite,
            "num_iterations": num_iterations,
            "agc_clip": agc_clip,
            "agc_eps": agc_eps,
            "gn_eps": gn_eps,
            "pnm_beta0": pnm_beta0,
            "softplus_beta": softplus_beta,
            "norm_loss_factor": norm_loss_factor,
            "norm_loss_eps": norm_loss_eps,
            "lookahead_k": lookahead_k,
            "lookahead_alpha": lookahead_alpha,
            **galore,
        }
        moments = (
            ScaleByPNM(softplus=softplus, adamd=adamd, amsgrad=amsgrad)
            if use_pnm
            else ScaleByAdam()
        )
        chain = [GaLore(moments)] if self._galore else [moments]
        grad_transforms = [
            m
            for m, on in (
                (AdaptiveGradientClipping(), use_agc),
                (CentralizeGradient(), use_gc),
                (NormalizeGradient(), use_gn),
            )
            if on
        ]
        param_transforms = [
            m
            for m, on in (
                (NormLoss(), use_norm_loss),
                (StableWeightDecay(), use_stable_weight_decay),
                (Lookahead(slow_dtype=lookahead_dtype), use_lookahead),
            )
            if on
        ]
        schedule = None
        if use_warmup or use_warmdown:
            options = {
                "warmup_iterations": warmup_iterations,
                "warmdown_start": warmdown_start,
                "min_lr": min_lr,
            }
            schedule = partial(_schedule, warmup=use_warmup, warmdown=use_warmdown, options=options)
        super().__init__(
            params,
            chain,
            defaults,
            grad_transforms=grad_transforms,
            param_transforms=param_transforms,
            lr_schedule=schedule,
        )


class Ranger21(_Ranger21Base):
    """Ranger21 at full rank: AdamW + AGC, centralization, normalization, PNM, softplus,
    norm loss, stable weight decay, lookahead and the warmup/warmdown schedule.

    ``lr`` is each group's peak learning rate; the built-in schedule (``use_warmup``,
    ``use_warmdown``) scales it by step, counted in the optimizer state, so an external
    LR scheduler (HF Trainer's) multiplies on top. ``num_iterations`` is the run's
    number of optimizer steps. Every component has a ``use_*`` switch; see the module
    docstring for the order and the state each costs.
    """


class GaLoreRanger21(_Ranger21Base):
    """Ranger21 with GaLore: in groups with ``rank`` set, PNM's moments live in the
    low-rank subspace; gradient and weight modules act in full space.

    Takes every :class:`Ranger21` argument plus the GaLore options of
    :class:`~galore2.GaLoreAdamW` (``rank``, ``update_proj_gap``, ``scale``,
    ``proj_type``, ``projector``, …) as defaults for groups that do not set them.
    """

    _galore = True
