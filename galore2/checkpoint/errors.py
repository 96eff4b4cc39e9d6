"""Why a checkpoint folder cannot be loaded — damaged files, or a state that does not fit —
or saved into (another process is saving there).

All are ``Exception`` subclasses naming the folder (``path``). DCP reports its own load
and save failures as ``CheckpointException``, a ``BaseException`` that ``except
Exception`` misses and whose message names neither the folder nor the cause:
:func:`from_dcp` and :func:`write_failed` turn it into one of these.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException


def _listed(items: list[str], shown: int) -> str:
    """The first ``shown`` of ``items`` joined by '; ', and how many more there are."""
    more = f" (and {len(items) - shown} more)" if len(items) > shown else ""
    return "; ".join(items[:shown]) + more


class CheckpointError(Exception):
    """A checkpoint folder that cannot be loaded into this model / optimizer, or saved into."""

    def __init__(self, message: str, path: str | os.PathLike | None = None) -> None:
        super().__init__(message)
        self.path = Path(path) if path is not None else None


class CheckpointCorrupt(CheckpointError):
    """The folder's files are damaged or incomplete (truncated, changed bytes, a file
    missing): an older checkpoint of the same run may still be intact."""


class CheckpointMismatch(CheckpointError, ValueError):
    """The files are intact but hold another state: another optimizer, other non-resumable
    settings (rank, projector...), other parameter shapes or parameter groups."""


class CheckpointBusy(CheckpointError, RuntimeError):
    """Another process is saving into the same checkpoint folder (it holds the folder's
    ``.lock``): a folder holds one run, written by one writer at a time."""


#: read errors that mean damaged or incomplete files, not a state that does not fit
_DAMAGE = (EOFError, pickle.UnpicklingError, UnicodeDecodeError, OSError, zipfile.BadZipFile)
_DAMAGE_TEXT = ("PytorchStreamReader", "miniz", "zip archive", "invalid header", "file read failed")


def causes(exc: BaseException) -> list[BaseException]:
    """The per-rank exceptions inside a DCP ``CheckpointException`` (else ``[exc]``)."""
    if isinstance(exc, CheckpointException):
        return [pair[0] if isinstance(pair, tuple) else pair for pair in exc.failures.values()]
    return [exc]


def _damage(exc: BaseException) -> bool:
    return isinstance(exc, _DAMAGE) or any(s in str(exc) for s in _DAMAGE_TEXT)


def _text(found: list[BaseException]) -> str:
    text = "; ".join(dict.fromkeys(f"{type(e).__name__}: {e}" for e in found))
    return " ".join((text[:600] + " ..." if len(text) > 600 else text).split())


def write_failed(exc: BaseException, root: Path, tmp: Path) -> CheckpointError:
    """A DCP save failure (a file where its temporary folder goes, a full disk...) as a
    :class:`CheckpointError` naming the folder and the cause: the checkpoints already in
    ``root`` are untouched (nothing is renamed or pruned before the write succeeds)."""
    return CheckpointError(
        f"cannot save a checkpoint into {root}: writing {tmp.name} failed "
        f"({_text(causes(exc))}); the checkpoints already there are untouched",
        root,
    )


def from_dcp(exc: BaseException, folder: Path, intact: bool) -> CheckpointError:
    """A DCP load failure as :class:`CheckpointCorrupt` (read errors, unless the files were
    just verified against their recorded checksums) or :class:`CheckpointMismatch`."""
    found = causes(exc)
    text = _text(found)
    if not intact and any(_damage(e) for e in found):
        return CheckpointCorrupt(
            f"checkpoint {folder} cannot be read (damaged files): {text}", folder
        )
    return CheckpointMismatch(
        f"checkpoint {folder} does not fit this model / optimizer: {text}", folder
    )
