"""Distributed checkpoints that reshard: model + optimizer (+ your extras) through DCP.

``save_checkpoint(root, step, model, optimizer, extra=...)`` writes
``root/step-{step:08d}`` with ``torch.distributed.checkpoint`` (every rank
writes its shards), atomically: it writes into ``root/.tmp-step-…``, records what it
wrote in ``galore2.json`` (:mod:`.record`: run id, optimizer, groups, shapes, file
checksums, your ``meta``), and rank 0 renames the folder only after every rank finished,
so a writer killed mid-save leaves the previous checkpoint intact. The newest ``keep``
checkpoints are kept. A root holds one run: saving a step older than the newest one
there, into a root holding another run's checkpoints (``run_id``), or — without a
``run_id`` — by an optimizer that neither saved into nor loaded from that root
(:mod:`.runs`) is an error, as is a second process saving into the root at the same time
(:class:`CheckpointBusy`); all are refused before anything is written or pruned.

``load_checkpoint(root, model, optimizer)`` loads the newest complete
checkpoint into the current model/optimizer — at any world size, FSDP2 or
not: DTensor state (moments sharded by rows or columns, bases, replicated
pieces) is resharded by DCP. It returns the ``extra`` dict saved with it (``None`` for a
folder without checkpoints; a missing root or a file is a ``FileNotFoundError``). Before
anything changes it checks the record: damaged files raise :class:`CheckpointCorrupt`, a
checkpoint of another optimizer, rank, projector or model raises
:class:`CheckpointMismatch`; both name the folder. A checkpoint without a record (older
releases) is compared with DCP's metadata (names, shapes) instead.

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

from . import _dist, files, layout, record, runs
from .errors import (
    CheckpointBusy,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMismatch,
    from_dcp,
    write_failed,
)
from .record import new_run_id, read
from .runs import run_of

__all__ = [
    "CheckpointBusy",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointMismatch",
    "list_checkpoints",
    "load_checkpoint",
    "new_run_id",
    "read_record",
    "run_of",
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
    """Complete checkpoints under ``root`` as (step, path), oldest first.

    A checkpoint is a ``step-XXXXXXXX`` folder that ``save_checkpoint`` renamed into place:
    it holds DCP's ``.metadata``, its ``.distcp`` shards or galore2's record (some may be
    damaged or missing: loading tells). A folder or file of that name with none of them —
    empty, or put there by hand — is a stray: not listed (so it never counts toward
    ``keep`` nor is loaded), never deleted, named once in a warning."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if (m := _DONE.match(p.name)) is not None:
            if _complete(p):
                found.append((int(m.group(1)), p))
            else:
                _warn_once(
                    f"{p} is not a checkpoint (no .metadata, .distcp or {record.FILE}): it is left "
                    "alone, not loaded and not counted toward keep; remove it by hand",
                    stacklevel=3,
                )
    return sorted(found)


def _complete(path: Path) -> bool:
    """Was ``path`` renamed into place by a save (see :func:`list_checkpoints`)?"""
    if not path.is_dir():
        return False
    return any((path / f).is_file() for f in (".metadata", record.FILE)) or any(
        path.glob("*.distcp")
    )


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

    A folder holds one run. ``run_id`` names the run explicitly; without it, a save into a
    folder holding checkpoints continues the run of the newest one only if this
    ``optimizer`` belongs to it — it saved into that folder, or ``load_checkpoint`` loaded
    it from there, in this process (:func:`run_of`) — and an empty folder starts a new run
    (or continues the optimizer's). ``meta`` is any JSON object stored in the record
    (``read_record``). Saving the same step again replaces it. A step older than the
    newest in ``root``, another run's id, or a save by an optimizer that did not save into
    or load from the folder raises ``ValueError``; another process saving into ``root`` at
    the same time raises :class:`CheckpointBusy`; all before anything is written or pruned.
    """
    _int("step", step, 0)
    _int("keep", keep, 1)
    meta = record.check_meta(meta)
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(f"cannot save a checkpoint into {root}: it is a file")
    with runs.writer_lock(root):
        run_id = runs.choose(root, step, run_id, optimizer, list_checkpoints(root))
        final = _write(root, step, model, optimizer, extra, flatten, run_id, meta, keep)
    runs.remember(optimizer, run_id, root)
    return final


def _write(root, step, model, optimizer, extra, flatten, run_id, meta, keep) -> Path:
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
    try:
        with _quiet_single_process():
            dcp.save(state, checkpoint_id=str(tmp))
    except (CheckpointException, Exception) as e:  # DCP's is a BaseException
        raise write_failed(e, root, tmp) from e
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
        if final.exists() and not _complete(final):  # a stray of that name: kept aside
            stray = final.with_name(final.name + ".stray")
            n = 1
            while stray.exists():
                stray, n = final.with_name(f"{final.name}.stray-{n}"), n + 1
            os.replace(final, stray)
            warnings.warn(f"{final} was not a checkpoint: moved to {stray.name}", stacklevel=3)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for _, old in list_checkpoints(root)[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    _dist.barrier()
    return final


def _warn_once(message: str, stacklevel: int = 4) -> None:
    """Warn (default: at the caller of load_checkpoint) once per process per message."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=stacklevel)


def _check(
    folder: Path,
    saved: dict[str, Any] | None,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, Any],
    verify: bool,
) -> tuple[bool, Any]:
    """Check ``folder`` before DCP reads it (a checkpoint without a record: its model part
    against DCP's metadata); (whether its files were verified intact, DCP's metadata when
    there is no record)."""
    if saved is None:
        _warn_once(
            f"checkpoint {folder} has no {record.FILE} (written by an older galore2): "
            "checking it against DCP's metadata only (names and shapes)"
        )
        if not (folder / ".metadata").is_file():
            raise CheckpointCorrupt(f"checkpoint {folder} is damaged: .metadata is missing", folder)
        metadata = layout.stored(folder)
        layout.check(folder, metadata, model_state, "model", exact=True)
        return False, metadata
    all_options = getattr(type(optimizer), "all_options", None)
    now = record.describe(model, optimizer, model_state)
    record.check_fits(saved, now, folder, all_options() if callable(all_options) else None)
    files.verify(folder, saved["files"], checksums=verify)
    return verify, None


def _folder(root: str | os.PathLike, step: int | None) -> Path | None:
    """The checkpoint folder to load (``None``: ``root`` is a folder with no checkpoint);
    ``FileNotFoundError`` naming ``root`` when it is missing, a file, or a checkpoint."""
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"no checkpoint folder {root}: it does not exist")
    if not root.is_dir():
        raise FileNotFoundError(
            f"{root} is a file; load_checkpoint takes the folder save_checkpoint wrote into"
        )
    found = dict(list_checkpoints(root))
    if not found and _DONE.match(root.name) and (root / ".metadata").exists():
        raise FileNotFoundError(
            f"{root} is a checkpoint, not a folder of checkpoints: pass {root.parent} "
            f"(and step={int(root.name[5:])} for this one)"
        )
    if not found:
        return None
    step = max(found) if step is None else step
    if step not in found:
        raise FileNotFoundError(f"no complete checkpoint for step {step} under {root}")
    return found[step]


def _optimizer_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    flatten: bool,
    folder: Path,
    metadata: Any,
) -> dict[str, Any]:
    """The optimizer's state dict to load into. DCP's helper creates the state of an
    optimizer that has none (a zero-gradient step); a checkpoint without a record is then
    compared with it (a refusal removes that state again: :func:`load_checkpoint`)."""
    state = get_optimizer_state_dict(model, optimizer, options=_options(flatten))
    if metadata is not None:
        all_options = getattr(type(optimizer), "all_options", None)
        options = all_options() if callable(all_options) else None
        layout.check(folder, metadata, state, "optim", exact=False)
        with _quiet_single_process():
            layout.check_options(folder, state, options)
    return state


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

    ``root`` is the folder ``save_checkpoint`` wrote into: ``FileNotFoundError`` naming it
    when it does not exist or is a file (a mistyped resume path never restarts a run from
    scratch); ``None`` when it is a folder without checkpoints (nothing to resume).
    ``extra`` is a template of what was saved (DCP loads into existing objects): pass
    the same keys with placeholder values of the same kinds (tensors, ints...).
    Raises :class:`CheckpointMismatch` (a ``ValueError``) when the checkpoint holds another
    optimizer / rank / projector / model, :class:`CheckpointCorrupt` when its files are
    damaged (``verify``: check every file's CRC-32 first; sizes are always checked). Every
    check runs before any weight or state changes. A loaded ``optimizer`` belongs to the
    checkpoint's run (:func:`run_of`): ``save_checkpoint`` into ``root`` continues it.
    """
    folder = _folder(root, step)
    if folder is None:
        return None
    extra = dict(extra or {})
    saved = read(folder)
    model_state = get_model_state_dict(model)
    intact, metadata = _check(folder, saved, model, optimizer, model_state, verify)
    fresh = not optimizer.state
    try:
        extra = _load(folder, model, optimizer, model_state, extra, flatten, metadata, intact)
    except BaseException:
        if fresh:  # the state DCP's zero-gradient step made: a refused load leaves none
            optimizer.state.clear()
        raise
    runs.remember(optimizer, saved["run_id"] if saved is not None else new_run_id(), Path(root))
    return extra


def _load(folder, model, optimizer, model_state, extra, flatten, metadata, intact) -> dict:
    """DCP reads ``folder`` into the model, the optimizer and ``extra``; returns ``extra``."""
    state = {
        "model": model_state,
        "optim": _optimizer_state(model, optimizer, flatten, folder, metadata),
        "extra": extra,
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
