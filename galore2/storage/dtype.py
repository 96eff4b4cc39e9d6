"""The dtype optimizer moments are kept in (``state_dtype``), read by every moment module."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..core.options import Choice, Option

STATE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
_ALIASES: dict[object, str] = {
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp64": "float64",
}
_ALIASES.update({dt: name for name, dt in STATE_DTYPES.items()})

STATE_DTYPE = Option(
    "state_dtype",
    "float32",
    Choice(tuple(STATE_DTYPES), _ALIASES),
    "dtype of the moments (fp32 / bf16 / fp16 / fp64 aliases and torch dtypes accepted)",
    resumable=False,
)


def normalize_state_dtype(value: object) -> str:
    """The canonical name (``"float32"``...) of a state dtype given as a str or a torch dtype."""
    return STATE_DTYPE.validate(value)


FLOAT16_NOTE = (
    "galore2: state_dtype='float16' keeps second moments (running means of g²) in float16, "
    "whose largest value is 65504: a gradient whose sum of squares exceeds it (‖g‖ > 255.9) "
    "is treated like a non-finite one (skipped under nonfinite='skip', see "
    "galore2.core.nonfinite), which for large tensors can skip most steps; "
    "state_dtype='bfloat16' takes the same memory with float32's range"
)


def warn_float16(group: dict, warn_once: Callable[[str], None]) -> None:
    """Warn (once per optimizer) that float16 second moments overflow easily."""
    if group.get("state_dtype") == "float16":
        warn_once(FLOAT16_NOTE)
