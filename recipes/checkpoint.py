"""Recipe checkpoints: model, optimizer, LR schedule, data position, token count and RNG.

Written with ``galore2.checkpoint.save_checkpoint`` (DCP, atomic, resharding) under
``OUT/checkpoints/step-XXXXXXXX``. Everything in ``extra`` is a tensor (no
pickled Python objects): the step, tokens seen, the data loader's position and
the CPU (and CUDA) RNG states. Every rank seeds identically, so the RNG state is
replicated and DCP stores it once. A run that stops and resumes follows the same
loss curve as one that does not (tests/recipes/test_recipe.py). Each checkpoint's
``galore2.json`` carries the run id and the job's configuration (``meta``), which
:mod:`recipes.resume` compares with a resumed job's.
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


def save(
    out, step, model, optimizer, loader, tokens: int, device, keep: int, *, run_id=None, meta=None
) -> Path:
    extra = _extra(step, tokens, loader, device)
    return save_checkpoint(
        checkpoint_dir(out),
        step,
        model,
        optimizer,
        extra=extra,
        keep=keep,
        run_id=run_id,
        meta=meta,
    )


def _settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each group's settings as this run built them (``initial_lr`` included)."""
    keys = {*optimizer.defaults, "initial_lr"} - {"lr", "params"}
    return [{k: v for k, v in g.items() if k in keys} for g in optimizer.param_groups]


def resume(
    out, model, optimizer, scheduler, loader, device, *, step: int | None = None
) -> tuple[int, int]:
    """Load checkpoint ``step`` (default: the newest) under ``out`` if any; returns (step,
    tokens) — (0, 0) if none. The groups keep this run's settings (a resumed job may have
    changed lr, weight decay, scale...; recipes.resume has refused what cannot change), and
    the schedule continues from this run's lr at the checkpoint's step."""
    settings = _settings(optimizer)
    template = _extra(0, 0, loader, device)
    extra = load_checkpoint(checkpoint_dir(out), model, optimizer, extra=template, step=step)
    if extra is None:
        return 0, 0
    step = int(extra["step"])
    loader.load_state_dict(extra["data"])
    torch.set_rng_state(extra["rng_cpu"])
    if "rng_cuda" in extra:
        torch.cuda.set_rng_state(extra["rng_cuda"], device)
    for group, mine in zip(optimizer.param_groups, settings, strict=True):
        group.update(mine)
    restore_scheduler(scheduler, step)
    return step, int(extra["tokens"])
