"""Recipe checkpoints: model, optimizer, LR schedule, data position, token count and RNG.

Written with ``galore2.checkpoint.save_checkpoint`` (DCP, atomic, resharding) under
``OUT/checkpoints/step-XXXXXXXX``. Everything in ``extra`` is a tensor (no
pickled Python objects): the step, tokens seen, the data loader's position and
the CPU (and CUDA) RNG states. Every rank seeds identically, so the RNG state is
replicated and DCP stores it once. A run that stops and resumes follows the same
loss curve as one that does not (tests/recipes/test_recipe.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from galore2.checkpoint import load_checkpoint, save_checkpoint

from .optimizers import restore_scheduler


def _extra(step: int, tokens: int, loader: Any, device: torch.device) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "step": torch.tensor(step, dtype=torch.int64),
        "tokens": torch.tensor(tokens, dtype=torch.int64),
        "data": loader.state_dict(),
        "rng_cpu": torch.get_rng_state(),
    }
    if device.type == "cuda":
        extra["rng_cuda"] = torch.cuda.get_rng_state(device)
    return extra


def checkpoint_dir(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def save(out, step, model, optimizer, loader, tokens: int, device, keep: int) -> Path:
    extra = _extra(step, tokens, loader, device)
    return save_checkpoint(checkpoint_dir(out), step, model, optimizer, extra=extra, keep=keep)


def resume(out, model, optimizer, scheduler, loader, device) -> tuple[int, int]:
    """Load the newest checkpoint under ``out`` if any; returns (step, tokens) — (0, 0) if none."""
    template = _extra(0, 0, loader, device)
    extra = load_checkpoint(checkpoint_dir(out), model, optimizer, extra=template)
    if extra is None:
        return 0, 0
    step = int(extra["step"])
    loader.load_state_dict(extra["data"])
    torch.set_rng_state(extra["rng_cpu"])
    if "rng_cuda" in extra:
        torch.cuda.set_rng_state(extra["rng_cuda"], device)
    restore_scheduler(scheduler, step)
    return step, int(extra["tokens"])
