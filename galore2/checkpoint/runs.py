"""Which run a checkpoint folder holds, which run an optimizer belongs to, and one writer.

A checkpoint folder holds one run. The run an optimizer belongs to is remembered in this
process, on the optimizer object (a weak reference: nothing is added to the optimizer or
its state), by the two calls that tie it to a folder:

* :func:`galore2.checkpoint.load_checkpoint` — the run recorded in the loaded checkpoint's
  ``galore2.json`` (a checkpoint without one, written by an older release, ties the
  optimizer to that folder under a new id);
* :func:`galore2.checkpoint.save_checkpoint` — the run it saved under.

A save without an explicit ``run_id`` into a folder that already holds checkpoints is
accepted only from an optimizer tied to that folder and to the run of its newest
checkpoint (the run that saved there, or resumed from there, in this process): an
optimizer loaded from a copy of the folder belongs to the copy, not to the original.
Anything else — another model or optimizer, or a fresh run of the same architecture that
never loaded from the folder — is refused before anything is written or pruned: it would otherwise take over the run's
id and prune its checkpoints. ``run_id=`` names the run explicitly (the recipe does: it
compares the job with the checkpoint's recorded configuration itself).

Saves take an exclusive lock on ``root/.lock`` (``flock``: released by the kernel when the
writer exits, even when killed), so a second process saving into the same folder at the
same time is refused with an error naming it, instead of both writing one temporary folder.
"""

from __future__ import annotations

import os
import socket
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from . import _dist
from .errors import CheckpointBusy, CheckpointError
from .record import new_run_id, read

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no lock (DCP's multi-process saves need POSIX)
    fcntl = None  # type: ignore[assignment]

#: the lock file a save holds in its root
LOCK = ".lock"


@dataclass(frozen=True)
class Origin:
    """The run an optimizer belongs to: its id and the folder it last saved into or
    loaded from (resolved)."""

    run_id: str
    root: Path


_ORIGINS: weakref.WeakKeyDictionary[torch.optim.Optimizer, Origin] = weakref.WeakKeyDictionary()


def remember(optimizer: torch.optim.Optimizer, run_id: str, root: Path) -> None:
    """Tie ``optimizer`` to run ``run_id`` in folder ``root`` (after a save or a load)."""
    _ORIGINS[optimizer] = Origin(run_id, Path(root).resolve())


def run_of(optimizer: torch.optim.Optimizer) -> str | None:
    """The run id ``optimizer`` last saved under or was loaded from in this process (``None``:
    neither happened). A save without ``run_id`` into a folder that holds checkpoints
    continues this run only."""
    origin = _ORIGINS.get(optimizer)
    return origin.run_id if origin is not None else None


def owners(existing: list[tuple[int, Path]]) -> dict[int, str | None]:
    """step → run id of each checkpoint (``None``: no record, or a damaged one)."""
    out: dict[int, str | None] = {}
    for step, path in existing:
        try:
            found = read(path)
        except CheckpointError:
            found = None  # a damaged record: its run is unknown
        out[step] = found["run_id"] if found is not None else None
    return out


def choose(
    root: Path,
    step: int,
    run_id: str | None,
    optimizer: torch.optim.Optimizer,
    existing: list[tuple[int, Path]],
) -> str:
    """The run id a save of ``step`` into ``root`` writes under; ``ValueError`` (before
    anything is written) for an older step than the newest, another run's id, or — with no
    ``run_id`` — an optimizer not tied to the run of the newest checkpoint there."""
    if existing and existing[-1][0] > step:
        raise ValueError(
            f"cannot save step {step} into {root}: it holds {existing[-1][1].name}, a newer "
            "step, and keeping the newest checkpoints would delete this one or mix two runs. "
            "Save into another folder, or move the newer checkpoints away first (set_aside "
            "does that for a damaged one)"
        )
    by_step = owners(existing)
    if run_id is None:
        run_id = _implicit(root, step, optimizer, existing, by_step)
    others = sorted({r for r in by_step.values() if r is not None and r != run_id})
    if others:
        steps = [s for s, r in by_step.items() if r == others[0]]
        raise ValueError(
            f"cannot save run {run_id} into {root}: it holds checkpoints of run {others[0]} "
            f"(steps {steps}); a checkpoint folder holds one run. Save into another folder, "
            "or remove those checkpoints first"
        )
    return run_id


def _implicit(
    root: Path,
    step: int,
    optimizer: torch.optim.Optimizer,
    existing: list[tuple[int, Path]],
    by_step: dict[int, str | None],
) -> str:
    """No ``run_id`` given: the optimizer's run where the folder is empty or holds that run,
    else ``ValueError``."""
    origin = _ORIGINS.get(optimizer)
    if not existing:  # an empty folder: this optimizer's run, or a new one
        return origin.run_id if origin is not None else new_run_id()
    newest_step, newest = existing[-1]
    held = by_step[newest_step]
    if origin is not None:
        here = _same_folder(origin.root, root)
        if here and held in (origin.run_id, None):
            return origin.run_id
        why = (
            f"this optimizer belongs to run {origin.run_id} (it last saved into or loaded "
            f"from {origin.root}{'' if here else ', another folder'})"
        )
    else:
        why = "this optimizer neither saved into that folder nor was loaded from it"
    what = f"run {held}" if held is not None else "a run with no readable galore2.json"
    raise ValueError(
        f"cannot save step {step} into {root}: it holds checkpoints of "
        f"{what} (newest: {newest.name}) and {why}; a checkpoint folder holds one run, and "
        "saving would take over its id and prune its checkpoints. To continue that run, "
        "load_checkpoint from the folder first (or pass its run_id= explicitly); otherwise "
        "save into another folder"
    )


def _same_folder(a: Path, b: Path) -> bool:
    """Are ``a`` and ``b`` one folder (not a copy of it: another path to the same one, a
    symlink, is the same folder)?"""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them is gone
        return Path(a).resolve() == Path(b).resolve()


#: what a busy checkpoint folder's error says the other process does, and what to do
SAVING = (
    "saving a checkpoint into",
    "A checkpoint folder holds one run: save into another folder, or wait for that save to "
    "finish",
)


@contextmanager
def writer_lock(root: Path, doing: tuple[str, str] = SAVING) -> Iterator[None]:
    """Hold ``root/.lock`` exclusively (rank 0 takes it; every rank learns the outcome):
    for a save, or (the recipe) for a whole run. :class:`CheckpointBusy` naming the folder
    and the process holding the lock when another one does (``doing``: what it is doing,
    and the advice); :class:`CheckpointError` when ``root/.lock`` cannot be a lock file (a
    folder of that name). A lock left by a process that died is taken over (``flock``)."""
    fd, problem = None, None
    if _dist.rank() == 0 and fcntl is not None:
        root.mkdir(parents=True, exist_ok=True)
        fd, problem = _acquire(root / LOCK, doing)
    problem = _dist.gather(problem)[0]
    if problem is not None:
        busy, text = problem
        raise (CheckpointBusy if busy else CheckpointError)(text, root)
    try:
        yield
    finally:
        if fd is not None:
            _release(root / LOCK, fd)


def _acquire(path: Path, doing: tuple[str, str]) -> tuple[int | None, tuple[bool, str] | None]:
    """(fd, None) holding ``path``'s lock, or (None, (held by another process?, why not))."""
    for _ in range(3):  # the holder may unlink the file between our open and flock
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a folder of that name, a file we may not write...
            what = "it is a folder" if path.is_dir() else (e.strerror or str(e))
            return None, (False, (
                f"cannot lock {path} ({what}): a writer of {path.parent} holds this file "
                "while it writes there; remove or rename it (it is not part of any "
                "checkpoint) and try again"
            ))  # fmt: skip
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            return None, (True, (
                f"another process is {doing[0]} {path.parent} ({holder}holds {path}); two "
                f"writers in one folder would overwrite each other's files. {doing[1]}"
            ))  # fmt: skip
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
            return fd, None
        os.close(fd)  # locked a file that was just removed: try the new one
    return None, (True, f"cannot lock {path}: it keeps being replaced")


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return f"{text} " if text else ""


def _release(path: Path, fd: int) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)  # closing releases the flock
