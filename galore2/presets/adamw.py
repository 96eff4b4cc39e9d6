"""``GaLoreAdamW`` (fp32 moments) and ``GaLoreAdamW8bit`` (8-bit moments): AdamW whose moments
live in a low-rank subspace per targeted matrix."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ..core.modules import DecoupledWeightDecay
from ..core.optimizer import ChainOptimizer, ParamsT
from ..core.transform import Transform
from ..optim.adam import ScaleByAdam, ScaleByAdam8bit
from ..optim.galore import GaLore


class GaLoreAdamW(ChainOptimizer):
    """Drop-in replacement for ``torch.optim.AdamW`` with GaLore 2 gradient projection.

    Groups whose ``rank`` is ``None`` (the default) are plain AdamW and match
    ``torch.optim.AdamW`` to rounding. In a group with ``rank`` set, every ≥2-D
    parameter gets its gradient projected onto a rank-``rank`` basis refreshed
    every ``update_proj_gap`` steps; Adam's moments are kept at the low-rank
    shape; the normalized update is projected back and scaled by ``scale``.

    Args:
        params: parameters or parameter groups (see :func:`galore2.param_groups`).
        lr: as ``torch.optim.AdamW``.
        betas: as ``torch.optim.AdamW``.
        eps: as ``torch.optim.AdamW``.
        weight_decay: as ``torch.optim.AdamW``.
        **options: defaults for every other option (``maximize``, ``state_dtype``,
            ``nonfinite``, and the GaLore options ``rank`` — default ``None``, plain AdamW —,
            ``update_proj_gap``, ``scale``, ``proj_type``, ``projector``…); the full list,
            with defaults and allowed values, is :meth:`declared_options` (and the options
            table of the GaLore options guide, generated from it). Unknown names raise ``TypeError``.
    """

    modules = (GaLore, ScaleByAdam, DecoupledWeightDecay)
    #: the Adam transform run inside GaLore (at the low-rank shape for projected matrices)
    adam_transform: ClassVar[Callable[[], Transform]] = ScaleByAdam

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        **options: Any,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, **options}
        super().__init__(params, [GaLore(self.adam_transform())], defaults)


class GaLoreAdamW8bit(GaLoreAdamW):
    """:class:`GaLoreAdamW` with Adam's moments stored 8-bit blockwise (bitsandbytes).

    Same arguments and arithmetic as :class:`GaLoreAdamW`; only the storage of the two
    moments changes (``ScaleByAdam(moments="dynamic8")``, the storage format of
    :mod:`galore2.storage.dynamic8`). Acts on every
    parameter's Adam moments: the low-rank r×n / m×r moments of projected matrices and
    the full-shape moments of everything else. Each step dequantizes them to fp32,
    updates, and requantizes with bitsandbytes' dynamic 8-bit map — on CUDA with triton
    installed, in one fused Triton kernel (:mod:`galore2.kernels`, ``GALORE2_KERNELS``).

    State cost per moment element: 1 byte (uint8 code) + 4 bytes (fp32 absmax) per
    block of at most 256 elements — ~1.016 bytes instead of fp32's 4, so ~0.254× of
    :class:`GaLoreAdamW`'s moment bytes for blocks of 256.

    Block layout: the direction is viewed as 2-D (dim 0 × rest) and blocked along the
    axis FSDP never shards — along each row (absmax ``(rows, ceil(cols/256))``) for the
    parameter's own moments and GaLore's right-side m×r and full-side r×r moments, along
    each column (absmax ``(ceil(rows/256), cols)``) for GaLore's left-side r×n moments,
    which are sharded by columns. State shapes therefore do not depend on the sharding
    and DCP checkpoints reshard. GaLore moments are blocked along the rank axis (rank <
    256: blocks of ``rank`` elements, e.g. 1.03 bytes/element at rank 128).

    Directions with fewer than 4096 elements (bitsandbytes' ``min_8bit_size``, judged
    by the global shape), 1-D ones and ones whose blocked axis has length 1 keep
    ``state_dtype`` moments and match :class:`GaLoreAdamW` exactly (``state_dtype`` has
    no effect on the 8-bit ones, which are updated in fp32). With ``rank=None`` the rest
    follows ``bitsandbytes.optim.AdamW8bit`` within bitsandbytes' own test tolerances
    (its blocks are ours when each row's length is a multiple of 256; only last-bit
    differences of the fp32 arithmetic remain).

    Needs bitsandbytes (``pip install bitsandbytes``); constructing it without raises
    ``ImportError``, while ``import galore2`` does not need it.
    """

    modules = (GaLore, ScaleByAdam8bit, DecoupledWeightDecay)
    adam_transform = ScaleByAdam8bit
