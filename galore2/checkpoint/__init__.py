"""Distributed checkpoints that reshard: model + optimizer (+ your extras) through DCP.

``save_checkpoint(root, step, model, optimizer, extra=...)`` writes
``root/step-{step:08d}`` with ``torch.distributed.checkpoint`` (every rank
writes its shards), atomically: it writes into ``root/.tmp-step-…``, records what it
wrote in ``galore2.json`` (:mod:`.record`: run id, optimizer, groups, shapes, file
checksums, your ``meta``), and rank 0 renames the folder only after every rank finished,
so a writer killed mid-save leaves the previous checkpoint intact. The newest ``keep``
checkpoints are kept. A root holds one run: saving a step older than the newest one
there, or into a root holding another run's checkpoints (``run_id``), is an error.

``load_checkpoint(root, model, optimizer)`` loads the newest complete
checkpoint into the current model/optimizer — at any world size, FSDP2 or
not: DTensor state (moments sharded by rows or columns, bases, replicated
pieces) is resharded by DCP. It returns the ``extra`` dict saved with it (or
``None`` when there is no checkpoint). Before DCP reads anything it checks the record:
damaged files raise :class:`CheckpointCorrupt`, a checkpoint of another optimizer,
rank, projector or model raises :class:`CheckpointMismatch`; both name the folder.

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
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from . import _dist, files, record
from .errors import CheckpointCorrupt, CheckpointError, CheckpointMismatch, from_dcp
from .record import new_run_id, read

__all__ = [
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointMismatch",
    "list_checkpoints",
    "load_checkpoint",
    "new_run_id",
    "read_record",
    "save_checkpoint",
    "set_aside",
]

_DONE = re.compile(r"^step-(\d{8})$")
_WARNED: set[str] = set()


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


def read_record(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The ``galore2.json`` record of a checkpoint folder (``None`` for one written before
    records existed); :class:`CheckpointCorrupt` if it is unreadable."""
    return read(Path(folder))


def set_aside(folder: str | os.PathLike) -> Path:
    """Rename a damaged checkpoint ``step-XXXXXXXX`` to ``step-XXXXXXXX.corrupt`` (``-1``,
    ``-2``... if taken), out of ``list_checkpoints``' sight but not deleted, so the run can
    continue from an older one and save these steps again. Collective: every rank calls it
    (rank 0 renames). Returns the new path."""
    folder = Path(folder)
    dest, n = folder.with_name(folder.name + ".corrupt"), 1
    while dest.exists():
        dest, n = folder.with_name(f"{folder.name}.corrupt-{n}"), n + 1
    _dist.barrier()
    if _dist.rank() == 0:
        os.replace(folder, dest)
    _dist.barrier()
    return dest


def _options(flatten: bool) -> StateDictOptions:
    return StateDictOptions(flatten_optimizer_state_dict=flatten)


def _int(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _owner(root: Path, step: int, run_id: str | None) -> str:
    """The run id this save writes under; ``ValueError`` if ``root`` holds a newer step or
    another run's checkpoints (one root, one run: pruning goes by step number)."""
    existing = list_checkpoints(root)
    if existing and existing[-1][0] > step:
        raise ValueError(
            f"cannot save step {step} into {root}: it holds {existing[-1][1].name}, a newer "
            "step, and keeping the newest checkpoints would delete this one or mix two runs. "
            "Save into another folder, or move the newer checkpoints away first (set_aside "
            "does that for a damaged one)"
        )
    owners: dict[str, list[int]] = {}
    for s, path in existing:
        try:
            found = read(path)
        except CheckpointError:
            continue  # a damaged record: its run is unknown
        if found is not None:
            owners.setdefault(found["run_id"], []).append(s)
    if run_id is None:  # continue the run of the newest checkpoint, else a new one
        newest = [r for r, steps in owners.items() if existing and existing[-1][0] in steps]
        run_id = newest[0] if newest else new_run_id()
    others = {r: steps for r, steps in owners.items() if r != run_id}
    if others:
        other, steps = next(iter(others.items()))
        raise ValueError(
            f"cannot save run {run_id} into {root}: it holds checkpoints of run {other} "
            f"(steps {steps}); a checkpoint folder holds one run. Save into another folder, "
            "or remove those checkpoints first"
        )
    return run_id


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    extra: dict[str, Any] | None = None,
    keep: int = 3,
    flatten: bool = True,
    run_id: str | None = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically and keep the newest ``keep``; returns its path.

    ``run_id`` names the run (default: the run of the newest checkpoint in ``root``, or a
    new id); ``meta`` is any JSON object stored in the record (``read_record``). Saving the
    same step again replaces it; a step older than the newest in ``root``, or another run's
    id, raises ``ValueError`` before anything is written.
    """
    _int("step", step, 0)
    _int("keep", keep, 1)
    meta = record.check_meta(meta)
    root = Path(root)
    run_id = _owner(root, step, run_id)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}"
    if _dist.rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _dist.barrier()
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer, options=_options(flatten)),
        "extra": extra or {},
    }
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=str(tmp))
    _dist.barrier()
    written = files.fingerprint(tmp, skip=(record.FILE,))
    if _dist.rank() == 0:
        info = {
            "format": record.FORMAT,
            "run_id": run_id,
            "step": step,
            "world_size": _dist.world(),
            **record.describe(model, optimizer, state["model"]),
            "files": written,
            "meta": meta,
        }
        record.write(tmp, info)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for _, old in list_checkpoints(root)[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    _dist.barrier()
    return final


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=4)  # the caller of load_checkpoint


def _check(
    folder: Path,
    saved: dict[str, Any] | None,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, Any],
    verify: bool,
) -> bool:
    """Check ``folder`` before DCP reads it; whether its files were verified intact."""
    if saved is None:
        _warn_once(
            f"checkpoint {folder} has no {record.FILE} (written by an older galore2): "
            "loading it without checking that it fits this model and optimizer"
        )
        if not (folder / ".metadata").is_file():
            raise CheckpointCorrupt(f"checkpoint {folder} is damaged: .metadata is missing", folder)
        return False
    all_options = getattr(type(optimizer), "all_options", None)
    now = record.describe(model, optimizer, model_state)
    record.check_fits(saved, now, folder, all_options() if callable(all_options) else None)
    files.verify(folder, saved["files"], checksums=verify)
    return verify


def load_checkpoint(
    root: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    step: int | None = None,
    extra: dict[str, Any] | None = None,
    flatten: bool = True,
    verify: bool = True,
) -> dict[str, Any] | None:
    """Load checkpoint ``step`` (default: the newest complete one); returns its ``extra``.

    ``extra`` is a template of what was saved (DCP loads into existing objects): pass
    the same keys with placeholder values of the same kinds (tensors, ints...).
    Raises :class:`CheckpointMismatch` (a ``ValueError``) when the checkpoint holds another
    optimizer / rank / projector / model, :class:`CheckpointCorrupt` when its files are
    damaged (``verify``: check every file's CRC-32 first; sizes are always checked).
    """
    found = dict(list_checkpoints(root))
    if not found:
        return None
    if step is None:
        step = max(found)
    if step not in found:
        raise FileNotFoundError(f"no complete checkpoint for step {step} under {root}")
    folder = found[step]
    saved = read(folder)
    model_state = get_model_state_dict(model)
    intact = _check(folder, saved, model, optimizer, model_state, verify)
    state = {
        "model": model_state,
        "optim": get_optimizer_state_dict(model, optimizer, options=_options(flatten)),
        "extra": dict(extra or {}),
    }
    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=str(folder))
    except (CheckpointException, Exception) as e:
        raise from_dcp(e, folder, intact) from e
    try:
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"], options=_options(flatten))
    except CheckpointError:
        raise
    except (KeyError, RuntimeError, ValueError) as e:
        raise CheckpointMismatch(f"checkpoint {folder} does not fit: {e}", folder) from e
    return state["extra"]
