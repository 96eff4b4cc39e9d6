"""``GaLoreAdamW``: AdamW whose moments live in a low-rank subspace per targeted matrix."""

from __future__ import annotations

from typing import Any

import torch

from .adam import ScaleByAdam
from .config import GALORE_DEFAULTS
from .galore import GaLore
from .optimizer import ChainOptimizer, ParamsT


class GaLoreAdamW(ChainOptimizer):
    """Drop-in replacement for ``torch.optim.AdamW`` with GaLore 2 gradient projection.

    Groups whose ``rank`` is ``None`` (the default) are plain AdamW and match
    ``torch.optim.AdamW`` to rounding. In a group with ``rank`` set, every ≥2-D
    parameter gets its gradient projected onto a rank-``rank`` basis refreshed
    every ``update_proj_gap`` steps; Adam's moments are kept at the low-rank
    shape; the normalized update is projected back and scaled by ``scale``.

    Args:
        params: parameters or parameter groups (see :func:`galore2.param_groups`).
        lr, betas, eps, weight_decay, maximize: as ``torch.optim.AdamW``.
        state_dtype: dtype of the moments (``"float32"`` default, ``"bfloat16"``…).
        nonfinite: ``"skip"`` (default) skips a parameter's update when its gradient
            has NaN/Inf and counts it in :attr:`nonfinite_skips`; ``"raise"`` raises before
            any parameter changes; ``"ignore"`` does not check (NaN propagates, as in
            ``torch.optim.AdamW``; saves the check's ~5% of a CPU step).
        rank: default rank for groups that do not set one (``None`` = plain AdamW).
        update_proj_gap: steps between subspace refreshes (T).
        scale: α, the multiplier of the back-projected update.
        proj_type: ``std`` | ``reverse_std`` | ``left`` | ``right`` | ``full``.
        projector: ``randomized`` (default) | ``svd`` | ``power`` | ``random``.
        oversample: extra sketch columns for ``randomized`` / ``power`` cold starts.
        power_iters: subspace iterations (randomized: after the sketch; power: per refresh).
        moments_on_refresh: ``keep`` (galore-torch) | ``reset`` | ``project``.
        seed: base seed of the random sketches and projections.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        maximize: bool = False,
        state_dtype: str | torch.dtype = "float32",
        nonfinite: str = "skip",
        **galore: Any,
    ) -> None:
        unknown = set(galore) - set(GALORE_DEFAULTS)
        if unknown:
            raise TypeError(
                f"unexpected keyword arguments {sorted(unknown)}; GaLore options are "
                f"{sorted(GALORE_DEFAULTS)}"
            )
        defaults: dict[str, Any] = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "maximize": maximize,
            "state_dtype": state_dtype,
            "nonfinite": nonfinite,
            **GALORE_DEFAULTS,
            **galore,
        }
        super().__init__(params, chain=[GaLore(ScaleByAdam())], defaults=defaults)
