"""Distributed checkpoints that reshard: model + optimizer (+ your extras) through DCP.

``save_checkpoint(root, step, model, optimizer, extra=...)`` writes
``root/step-{step:08d}`` with ``torch.distributed.checkpoint`` (every rank
writes its shards), atomically: it writes into ``root/.tmp-step-…`` and rank 0
renames the folder only after every rank finished, so a writer killed mid-save
leaves the previous checkpoint intact. The last ``keep`` checkpoints are kept.

``load_checkpoint(root, model, optimizer)`` loads the newest complete
checkpoint into the current model/optimizer — at any world size, FSDP2 or
not: DTensor state (moments sharded by rows or columns, bases, replicated
pieces) is resharded by DCP. It returns the ``extra`` dict saved with it (or
``None`` when there is no checkpoint).

Optimizer state goes through ``get_optimizer_state_dict`` /
``set_optimizer_state_dict``; galore2's optimizers create every state key at
its final shape in DCP's zero-gradient initialization step, so nothing is
silently skipped on load.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

_DONE = re.compile(r"^step-(\d{8})$")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


@contextmanager
def _quiet_single_process():
    """DCP warns that it 'assumes a single process' when no group exists: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _DONE.match(p.name))]
    return sorted(found)


def _options(flatten: bool) -> StateDictOptions:
    return StateDictOptions(flatten_optimizer_state_dict=flatten)


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    extra: dict[str, Any] | None = None,
    keep: int = 3,
    flatten: bool = True,
) -> Path:
    """Write checkpoint ``step`` atomically and keep the newest ``keep``; returns its path."""
    if keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step!r}")
    root = Path(root)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer, options=_options(flatten)),
        "extra": extra or {},
    }
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=str(tmp))
    _barrier()
    if _rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for _, old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(
    root: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    step: int | None = None,
    extra: dict[str, Any] | None = None,
    flatten: bool = True,
) -> dict[str, Any] | None:
    """Load checkpoint ``step`` (default: the newest complete one); returns its ``extra``.

    ``extra`` is a template of what was saved (DCP loads into existing objects): pass
    the same keys with placeholder values of the same kinds (tensors, ints...).
    """
    found = dict(list_checkpoints(root))
    if not found:
        return None
    if step is None:
        step = max(found)
    if step not in found:
        raise FileNotFoundError(f"no complete checkpoint for step {step} under {root}")
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer, options=_options(flatten)),
        "extra": dict(extra or {}),
    }
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(found[step]))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"], options=_options(flatten))
    return state["extra"]
