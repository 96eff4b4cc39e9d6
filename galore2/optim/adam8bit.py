"""Adam with 8-bit blockwise-quantized moments: ``ScaleByAdam(moments="dynamic8")``.

:class:`ScaleByAdam8bit` only fixes the moment storage of
:class:`~galore2.optim.adam.ScaleByAdam`; the update, the fused Triton kernel and the
small-tensor rule live there and in :mod:`galore2.storage.dynamic8` (the format: block
layout, bitsandbytes' dynamic code maps, quantize / dequantize), whose names are
re-exported here for compatibility.
"""

from __future__ import annotations

from ..storage.dynamic8 import (
    BLOCK,
    MIN_8BIT_SIZE,
    absmax_shape,
    block_dim,
    bnb_functional,
    code_bounds,
    dequantize,
    dynamic_code,
    quantize_,
)
from .adam import ScaleByAdam


class ScaleByAdam8bit(ScaleByAdam):
    """``ScaleByAdam(moments="dynamic8")``: Adam whose moments of large directions are stored
    8-bit blockwise (bitsandbytes' dynamic map); constructing it without bitsandbytes raises
    ``ImportError``."""

    def __init__(self) -> None:
        super().__init__(moments="dynamic8")


__all__ = [
    "BLOCK",
    "MIN_8BIT_SIZE",
    "ScaleByAdam8bit",
    "absmax_shape",
    "block_dim",
    "bnb_functional",
    "code_bounds",
    "dequantize",
    "dynamic_code",
    "quantize_",
]
