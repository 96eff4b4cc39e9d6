"""``GaLoreAdafactor``: Adafactor whose factored second moment lives in a low-rank subspace."""

from __future__ import annotations

from typing import Any

import torch

from ..core.config import GALORE_DEFAULTS, check_galore_kwargs
from ..core.optimizer import ChainOptimizer, ParamsT
from ..optim.adafactor import ScaleByAdafactor
from ..optim.galore import GaLore


class GaLoreAdafactor(ChainOptimizer):
    """Drop-in replacement for ``torch.optim.Adafactor`` with GaLore 2 gradient projection.

    Groups whose ``rank`` is ``None`` (the default) are plain Adafactor and match
    ``torch.optim.Adafactor`` to rounding. In a group with ``rank`` set, every ≥2-D
    parameter gets its gradient projected onto a rank-``rank`` basis refreshed every
    ``update_proj_gap`` steps; Adafactor's factored second moment is kept at the low-rank
    shape (r + n values for an r×n projected gradient); the update is projected back and
    scaled by ``scale``. RMS(θ) in the step size is always the full parameter's.

    Args:
        params: parameters or parameter groups (see :func:`galore2.param_groups`).
        lr, beta2_decay, eps, d, weight_decay, maximize: as ``torch.optim.Adafactor``
            (``lr`` caps the relative step size ρ_t = min(lr, 1/√t) and scales the
            decoupled weight decay).
        beta1: optional momentum of the update (None: none, as torch's Adafactor).
        relative_step: cap the step size at 1/√t, ρ_t = min(lr, 1/√t) (default True, as
            torch's Adafactor); False: ρ_t = lr (galore-torch's ``relative_step=False``).
        scale_parameter: multiply the step size by max(eps2, RMS(θ)) (default True, as
            torch's Adafactor); False: the step size is ρ_t alone. GaLore pre-training
            usually sets both False and sweeps ``lr`` as for GaLoreAdamW.
        state_dtype: dtype of the moments (``"float32"`` default).
        nonfinite: ``"skip"`` (default) | ``"raise"`` | ``"ignore"``, as in
            :class:`~galore2.GaLoreAdamW`.
        **galore: the GaLore options of :class:`~galore2.GaLoreAdamW` (``rank``,
            ``update_proj_gap``, ``scale``, ``proj_type``, ``projector``…).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[float | None, float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        *,
        beta1: float | None = None,
        relative_step: bool = True,
        scale_parameter: bool = True,
        maximize: bool = False,
        state_dtype: str | torch.dtype = "float32",
        nonfinite: str = "skip",
        **galore: Any,
    ) -> None:
        check_galore_kwargs(galore)
        defaults: dict[str, Any] = {
            "lr": lr,
            "beta2_decay": beta2_decay,
            "eps": eps,
            "d": d,
            "beta1": beta1,
            "relative_step": relative_step,
            "scale_parameter": scale_parameter,
            "weight_decay": weight_decay,
            "maximize": maximize,
            "state_dtype": state_dtype,
            "nonfinite": nonfinite,
            **GALORE_DEFAULTS,
            **galore,
        }
        super().__init__(params, chain=[GaLore(ScaleByAdafactor())], defaults=defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, dict) and "betas" in param_group:
            raise ValueError(
                "betas is not a GaLoreAdafactor key: Adafactor's second-moment decay is "
                "beta2_decay (β̂₂ = 1 − t^beta2_decay) and its optional momentum beta1"
            )
        super().add_param_group(param_group)
