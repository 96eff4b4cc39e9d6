"""Expected per-GPU memory of the Llama-7B recipe, per optimizer (``recipes.memory``, meta device).

Batch 1 × 2048 tokens on one GPU (world size 1) and on 8 (FSDP2), with and without
per-layer updates. Weights/gradients/state are exact element counts (galore2's state
measured by ``init_state`` on the meta device); activations are the estimate of
``recipes/memory.py``. Nothing is allocated, so quick and full modes are the same.
"""

from __future__ import annotations

from typing import Any

from recipes.config import parse_args
from recipes.memory import OPTIMIZERS, report


def run(quick: bool = False) -> dict[str, Any]:
    del quick  # meta-device arithmetic: the full table is as cheap as a quick one
    job = parse_args(["--config", "llama_7b"])
    parts = [
        report(job, 1, 2048, world, list(OPTIMIZERS), "llama_7b", "float32") for world in (1, 8)
    ]
    return {"markdown": "\n\n".join(parts)}
