"""``GaLoreAdafactor``: Adafactor whose factored second moment lives in a low-rank subspace."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..core.modules import DecoupledWeightDecay
from ..core.optimizer import ChainOptimizer, ParamsT
from ..optim.adafactor import ScaleByAdafactor
from ..optim.galore import GaLore
from ..storage.moments import MOMENTS_8BIT


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
        lr: as ``torch.optim.Adafactor``: caps the relative step size
            ρ_t = min(lr, 1/√t) and scales the decoupled weight decay.
        beta2_decay: as ``torch.optim.Adafactor`` (β̂₂ = 1 − t^beta2_decay).
        eps: as ``torch.optim.Adafactor``: (eps1, eps2).
        d: as ``torch.optim.Adafactor``: the clipping threshold of the update's RMS.
        weight_decay: as ``torch.optim.Adafactor``.
        **options: every other option: ``beta1`` (optional momentum of the update),
            ``relative_step`` (cap the step size at 1/√t; False: ρ_t = lr, galore-torch's
            ``relative_step=False``), ``scale_parameter`` (multiply it by max(eps2, RMS(θ)))
            — GaLore pre-training usually sets both False and sweeps ``lr`` as for
            GaLoreAdamW —, ``maximize`` (as ``torch.optim.Adafactor``), ``state_dtype``,
            ``nonfinite`` and the GaLore options of :class:`~galore2.GaLoreAdamW`; see
            :meth:`declared_options`. Also the constructor switch ``moments_8bit``: store
            the moments of tensors with ≥ 4096 elements 8-bit blockwise (bitsandbytes'
            dynamic map, :mod:`galore2.storage.moments`): the ``beta1`` momentum of a large
            direction, long factors of batched directions; the factored second moment of a
            matrix stays in ``state_dtype``. A switch fixes the state keys for the
            optimizer's lifetime, like Ranger21's.
    """

    modules = (GaLore, ScaleByAdafactor, DecoupledWeightDecay)
    construct_options = (MOMENTS_8BIT,)
    option_hints: ClassVar[dict[str, str]] = {
        "betas": "betas is not a GaLoreAdafactor key: Adafactor's second-moment decay is "
        "beta2_decay (β̂₂ = 1 − t^beta2_decay) and its optional momentum beta1"
    }

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[float | None, float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        **options: Any,
    ) -> None:
        moments_8bit = MOMENTS_8BIT.validate(options.pop("moments_8bit", MOMENTS_8BIT.default))
        #: the constructor switches this optimizer was built with
        self.switches = {"moments_8bit": moments_8bit}
        storage = "dynamic8" if moments_8bit else "state_dtype"
        defaults = {
            "lr": lr,
            "beta2_decay": beta2_decay,
            "eps": eps,
            "d": d,
            "weight_decay": weight_decay,
            **options,
        }
        super().__init__(params, [GaLore(ScaleByAdafactor(moments=storage))], defaults)
