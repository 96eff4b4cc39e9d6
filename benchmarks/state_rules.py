"""Optimizer-state bytes of the peers, counted from each package's storage rules.

Used for task (d), the Llama-7B table on the meta device, where no peer can take a
step. Every rule here is checked against the peer's real state after a step on a
small model (``tests/test_bench_suite.py``: exact equality), so the 7B figures
are what those packages would allocate. galore2's own rows need no rule:
``init_state()`` builds its state on the meta device and ``state_bytes()`` counts it.

Per parameter of n elements (m × n₂ for a matrix; ``big``/``small`` = the larger /
smaller side; r = rank; 4 bytes per fp32 element):

* torch AdamW: two fp32 moments + an fp32 ``step`` tensor: 8n + 4.
* bitsandbytes AdamW8bit (0.50.2): tensors under 4096 elements two fp32 moments
  (8n); larger ones two uint8 moments + one fp32 absmax per 256 elements each;
  plus its two 256-entry fp32 code maps, shared by all parameters.
* galore-torch GaLoreAdamW, pytorch-optimizer GaLore, apollo-torch APOLLO: a
  projected matrix keeps fp32 moments at the projected shape (big × r) and an fp32
  basis (r × small); APOLLO also a 0-d fp32 norm of its last scaled gradient.
  Other parameters: two fp32 moments.
* galore-torch 1.0 keeps its basis as a *view* of the full SVD factor (``U[:, :r]`` or
  ``Vh[:r]``, copied only when the weights are not fp32), so with fp32 weights each
  projected matrix holds small × small fp32 elements of basis, not r × small.
* galore-torch GaLoreAdafactor (no first moment): factored second moment of the
  projected gradient (big + r), the basis as above, and a 0-d fp32 RMS per parameter;
  unprojected matrices m + n₂; vectors n.
* pytorch-optimizer Ranger21: five fp32 tensors per element (gradient EMA, negative-
  momentum EMA, variance EMA, its running max, the lookahead copy).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from torch import nn

BNB_BLOCK, BNB_MIN = 256, 4096
RANGER21_TENSORS = 5


def _sides(p: nn.Parameter) -> tuple[int, int]:
    m, n = p.shape[0], p.numel() // p.shape[0]
    return max(m, n), min(m, n)


def peer_state_bytes(
    name: str, model: nn.Module, projected: Iterable[nn.Parameter], rank: int
) -> int:
    """Bytes the recipe peer ``name`` holds for ``model`` (``projected``: its projected group)."""
    ids = {id(p) for p in projected}
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "adamw":
        return sum(8 * p.numel() + 4 for p in params)
    if name == "adamw8bit":
        total = 2 * 256 * 4  # the two shared code maps
        for p in params:
            n = p.numel()
            total += 8 * n if n < BNB_MIN else 2 * (n + 4 * math.ceil(n / BNB_BLOCK))
        return total
    if name == "pto_ranger21":
        return sum(4 * RANGER21_TENSORS * p.numel() for p in params)
    r = 1 if name == "apollo_mini" else rank
    total = 0
    for p in params:
        if id(p) in ids:
            big, small = _sides(p)
            basis = 4 * (small if name.startswith("gt_") else min(r, small)) * small
            if name == "gt_galore_adafactor":
                total += 4 * (big + min(r, small) + 1) + basis
            else:
                total += 8 * big * min(r, small) + basis
                total += 4 if name in ("apollo", "apollo_mini") else 0
        elif name == "gt_galore_adafactor":
            total += 4 * (sum(p.shape) if p.dim() == 2 else p.numel()) + 4
        else:
            total += 8 * p.numel()
    return total


RULES = ("adamw", "adamw8bit", "gt_galore_adamw", "gt_galore_adafactor", "apollo",
         "apollo_mini", "pto_galore", "pto_ranger21")  # fmt: skip
