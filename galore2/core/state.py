"""State helpers shared by every module: step counters (on the CPU; on the parameters' device
where a capturable step must count without the host)."""

from __future__ import annotations

import torch
from torch import Tensor


def counter(value: int = 0) -> Tensor:
    """A scalar int64 counter on the CPU (never moved to an accelerator)."""
    return torch.tensor(value, dtype=torch.int64)


def counter_on(t: Tensor, device: torch.device) -> Tensor:
    """The int64 counter ``t`` on ``device`` (``t`` itself when it is there already): a
    capturable step keeps its counters where its tensors are (``capturable=True``), and a
    checkpoint loads every 0-d integer onto the CPU."""
    return t if t.device == device else t.to(device)
