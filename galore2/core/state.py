"""State helpers shared by every module: CPU step counters."""

from __future__ import annotations

import torch
from torch import Tensor


def counter(value: int = 0) -> Tensor:
    """A scalar int64 counter on the CPU (never moved to an accelerator)."""
    return torch.tensor(value, dtype=torch.int64)
