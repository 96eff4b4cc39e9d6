"""Starting a run in ``--out``: a fresh run, or the continuation of the run there.

Checked before the model is built, so a wrong setting costs seconds, not a training run:

* The out dir and its ``checkpoints`` folder must be folders we can write into.
* A fresh run (``--train.resume false``, or nothing to resume) refuses an out dir that
  holds a run (checkpoints, ``metrics.jsonl``, ``config.json``, ``summary.json``): their
  files would mix. ``--train.overwrite true`` deletes that run (and always starts
  afresh) — only once the model and the optimizer are built, so a setting refused on the
  way leaves the old run intact; nothing is deleted without it.
* A resumed run compares its settings with the configuration recorded in the checkpoint
  (``galore2.json``). It refuses, naming each key with both values, what a checkpoint
  cannot continue under: the model and data (``model.*`` except activation checkpointing
  and compile, ``data.*``), the optimizer, its target modules, the global batch
  (``train.batch_size`` × ranks: another world size with the same global batch resumes),
  ``train.grad_accum`` / ``seed``, and every galore2 option declared ``resumable=False`` (rank,
  proj_type, projector, seed, storage formats...). Everything else (lr, weight decay,
  scale, update_proj_gap, schedule and run lengths, log / eval / checkpoint cadence...)
  applies from the next step; it is printed and recorded under ``changes`` in
  ``config.json`` and in later checkpoints.
* A damaged newest checkpoint is moved aside (``step-XXXXXXXX.corrupt``, never deleted)
  with a warning naming it, and the run resumes from the newest intact one.
* One writer per out dir, for the whole run: :func:`prepare` takes ``OUT/.lock`` (the
  lock checkpoint saves take, :func:`galore2.checkpoint.runs.writer_lock`) before it reads
  or deletes anything, and the run holds it until it ends (:class:`Run` is a context
  manager). A second process on the same out dir is refused naming it, before it changes
  anything; a lock left by a process that died is taken over.
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from galore2.checkpoint import (
    CheckpointCorrupt,
    list_checkpoints,
    new_run_id,
    read_record,
    set_aside,
)
from galore2.checkpoint.record import jsonable
from galore2.checkpoint.runs import writer_lock

from . import checkpoint
from .config import JobConfig, OptimConfig
from .optimizers import declarations, galore2_options, setting
from .resolve import FIELDS, parse_options, recorded

#: what a run leaves in its out dir
RUN_FILES = ("checkpoints", "metrics.jsonl", "config.json", "summary.json")
#: what a second process on the same out dir is told (galore2.checkpoint.runs.writer_lock)
RUNNING = (
    "running in",
    "A run folder has one writer for the whole run: use another --out, or wait for that run to end",
)
#: settings of one invocation, not of the run: never compared
INVOCATION = frozenset(
    ("train.out", "train.resume", "train.overwrite", "train.stop_after", "train.progress",
     "train.threads")
)  # fmt: skip
#: model settings that change how the same computation runs, not what it computes
EXECUTION = frozenset(("model.activation_checkpointing", "model.compile"))
#: settings a checkpoint cannot continue under, besides model.* / data.* and the galore2
#: options declared resumable=False
FIXED = frozenset(("optim.name", "optim.target_modules", "train.grad_accum", "train.seed"))


def _flat(config: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """``{"optim.lr": ..., "optim.projector": ...}`` and the keys that came from ``options``
    (unset there means the option's default, so absence on one side is a difference)."""
    out: dict[str, Any] = {}
    for section, values in config.items():
        if isinstance(values, dict):
            out.update({f"{section}.{k}": v for k, v in values.items() if k != "options"})
    from_options = set()
    for section, values in config.items():
        for k, v in (values.get("options") or {} if isinstance(values, dict) else {}).items():
            key = f"{section}.{k}" if f"{section}.{k}" not in out else f"{section}.options.{k}"
            out[key] = v
            from_options.add(key)
    return out, from_options


def _option_diffs(old: dict[str, Any], new: OptimConfig) -> dict[str, tuple[Any, Any]]:
    """``optim.NAME`` → (old, new) for galore2 options declared not resumable that differ
    (``old``: a recorded [optim] section in today's layout, :func:`recipes.resolve.recorded`)."""
    try:
        before_cfg = OptimConfig(**{k: v for k, v in old.items() if k in FIELDS})
        before_cfg.options = parse_options(before_cfg.name, old["options"])  # as recorded (JSON)
        before = galore2_options(before_cfg)
    except (TypeError, ValueError):  # a configuration of another release: no option check
        return {}
    if old.get("name") != new.name:
        return {}  # optim.name itself is refused
    out = {}
    for name, (value, resumable) in galore2_options(new).items():
        if not resumable and name in before and jsonable(before[name][0]) != jsonable(value):
            out[f"optim.{name}"] = (jsonable(before[name][0]), jsonable(value))
    return out


def _batch(old: dict[str, Any], job: JobConfig, worlds: tuple[int, int]) -> dict[str, tuple]:
    """The global batch, if it changed: sequences per micro-batch over all ranks."""
    before, now = old.get("train", {}).get("batch_size"), job.train.batch_size
    if before is None or before * worlds[0] == now * worlds[1]:
        return {}
    if worlds[0] == worlds[1]:
        return {"train.batch_size": (before, now)}
    return {"train.batch_size × ranks": (f"{before} × {worlds[0]}", f"{now} × {worlds[1]}")}


def compare(
    old: dict[str, Any], job: JobConfig, worlds: tuple[int, int] = (1, 1)
) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(changes a resumed run may apply, changes it must refuse) between the recorded
    configuration ``old`` (written at world size ``worlds[0]``) and ``job`` (run at
    ``worlds[1]``), each as ``{key: (old value, new value)}``."""
    old = {**old, "optim": recorded(old.get("optim", {}))}  # of any release: today's layout
    a, opt_a = _flat(old)
    b, opt_b = _flat(jsonable(job.to_dict()))
    unset, declared = OptimConfig(name=job.optim.name), declarations(job.optim.name)
    for key in opt_a | opt_b:  # an unset option is at its value in force (the recipe's default
        name = _option_key(key)[6:]  # or the declared one)
        default = setting(unset, name) if name in declared else None
        a.setdefault(key, jsonable(default))
        b.setdefault(key, jsonable(default))
    diffs = {}
    for key in sorted(a.keys() | b.keys()):
        known = key in a and key in b
        if key in INVOCATION or not (known or key in opt_a | opt_b):
            continue  # a field only one release has
        if a.get(key) != b.get(key):
            diffs[key] = (a.get(key), b.get(key))
    refused = {**_option_diffs(old["optim"], job.optim), **_batch(old, job, worlds)}
    for key, values in diffs.items():
        if key in FIXED or (key.split(".")[0] in ("model", "data") and key not in EXECUTION):
            refused[key] = values
    # an option refused by name may sit under optim.options.NAME (a name an [optim] field has)
    changes = {k: v for k, v in diffs.items() if _option_key(k) not in refused and k not in refused}
    if "train.batch_size × ranks" in refused:
        changes.pop("train.batch_size", None)
    return changes, dict(sorted(refused.items()))


def _option_key(key: str) -> str:
    return f"optim.{key.rsplit('.', 1)[-1]}" if key.startswith("optim.") else key


def _pairs(values: dict[str, tuple]) -> str:
    return "; ".join(f"{k}: {a!r} → {b!r}" for k, (a, b) in values.items())


@dataclass
class Run:
    """This job's run in its out dir: its id, the checkpoints it may resume from (newest
    first; none for a fresh run) and the setting changes recorded so far."""

    job: JobConfig
    run_id: str
    candidates: list[Path] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)  # recorded by the checkpoint
    changes: list[dict[str, Any]] = field(default_factory=list)  # applied by this job
    checked: Path | None = None  # the checkpoint the settings were compared with
    held: ExitStack = field(default_factory=ExitStack)  # the out dir's lock
    doomed: list[str] = field(default_factory=list)  # --train.overwrite: the old run's files

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the out dir (its lock): the run has ended."""
        self.held.close()

    @property
    def all_changes(self) -> list[dict[str, Any]]:
        return self.history + self.changes

    def meta(self) -> dict[str, Any]:
        """What each checkpoint records of the job (``galore2.json``'s ``meta``)."""
        return {"config": jsonable(self.job.to_dict()), "changes": self.all_changes}

    def save(self, step, model, optimizer, loader, tokens: int, device) -> Path:
        t = self.job.train
        return checkpoint.save(
            t.out, step, model, optimizer, loader, tokens, device, t.keep_checkpoints,
            run_id=self.run_id, meta=self.meta(),
        )  # fmt: skip

    def check(self, path: Path) -> None:
        """Compare this job with checkpoint ``path``'s recorded configuration: refuse what
        cannot change, adopt its run id and history, print what changes."""
        found = read_record(path)  # CheckpointCorrupt if unreadable
        self.checked, self.changes = path, []
        if found is None:
            self.run_id, self.history = new_run_id(), []
            return _say(f"{path} has no galore2.json (an older checkpoint): resuming "
                        "without checking the settings against it")  # fmt: skip
        step, config = found["step"], found["meta"].get("config")
        self.run_id, self.history = found["run_id"], list(found["meta"].get("changes", []))
        if not isinstance(config, dict):
            return _say(f"{path} records no recipe configuration: settings not checked")
        worlds = (found.get("world_size", 1), _world())
        changes, refused = compare(config, self.job, worlds)
        if refused:
            raise ValueError(
                f"cannot resume {self.job.train.out} from {path.name} (step {step}) with "
                f"changed settings: {_pairs(refused)}. A checkpoint cannot continue under "
                "another model, data, optimizer, batch size, seed or these optimizer options "
                "(they shape its stored state). Resume with the values recorded in "
                f"{path / 'galore2.json'}, or start a new run: another --out, or "
                "--train.overwrite true to replace this one."
            )
        self.changes = [
            {"step": step, "key": k, "from": a, "to": b} for k, (a, b) in changes.items()
        ]
        if changes:
            _say(f"resuming {self.job.train.out} at step {step}; from step {step + 1} on: "
                 f"{_pairs(changes)}")  # fmt: skip

    def load(self, model, optimizer, scheduler, loader, device) -> tuple[int, int]:
        """Load the newest intact checkpoint (damaged ones moved aside); (step, tokens),
        (0, 0) for a fresh run (``--train.overwrite``: the old run is deleted now, after
        every setting was checked by building the model and the optimizer)."""
        if self.doomed:
            _delete(Path(self.job.train.out), self.doomed)
            self.doomed = []
        moved = []
        for path in self.candidates:
            try:
                if path != self.checked:
                    self.check(path)
                step = int(path.name.removeprefix("step-"))
                return checkpoint.resume(
                    self.job.train.out, model, optimizer, scheduler, loader, device, step=step
                )
            except CheckpointCorrupt as e:
                moved.append(_set_aside(path, e))
        if moved:
            raise CheckpointCorrupt(
                f"no checkpoint under {checkpoint.checkpoint_dir(self.job.train.out)} can be "
                f"loaded: {', '.join(moved)} are damaged (moved aside, not deleted). Start a "
                "new run: another --out, or --train.overwrite true"
            )
        return 0, 0


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _say(message: str) -> None:
    if _rank() == 0:
        print(message, flush=True)


def _set_aside(path: Path, error: Exception) -> str:
    """Move damaged checkpoint ``path`` aside with a loud warning (every rank gets the same
    error: galore2.checkpoint verifies collectively); returns its new name."""
    dest = set_aside(path)
    if _rank() == 0:
        print(f"\n{'!' * 72}\nWARNING: damaged checkpoint {path}\n  {error}\n  moved to "
              f"{dest.name}; resuming from the next older checkpoint\n{'!' * 72}",
              file=sys.stderr, flush=True)  # fmt: skip
    warnings.warn(f"checkpoint {path} is damaged, moved to {dest.name}: {error}", stacklevel=3)
    return dest.name


def _check_out(out: Path) -> None:
    """The out dir and its checkpoints folder are folders (or absent) we can write into."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"train.out {out} is a file; --out must name a folder")
    ckpt = checkpoint.checkpoint_dir(out)
    if ckpt.exists() and not ckpt.is_dir():
        raise NotADirectoryError(
            f"{ckpt} is a file, but checkpoints are written into that folder: move it away "
            "or use another --out"
        )
    probe = next(p for p in (ckpt, *ckpt.parents) if p.exists())
    if not os.access(probe, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write into {probe} (train.out is {out})")


def _held(out: Path) -> list[str]:
    """The run files in ``out`` (an empty checkpoints folder does not count)."""
    held = [n for n in RUN_FILES if (out / n).exists()]
    ckpt = out / "checkpoints"
    return [n for n in held if n != "checkpoints" or any(ckpt.iterdir())]


def _refusal(out: Path, held: list[str], resume: bool, newest: int | None) -> str:
    what = ", ".join(held) + (f"; newest checkpoint: step {newest}" if newest is not None else "")
    if not resume:
        return (
            f"{out} already holds a run ({what}); a fresh run (--train.resume false) there "
            "would mix the two runs' files. Continue that run (leave out --train.resume "
            "false), start the new one with another --out, or pass --train.overwrite true "
            "to delete the old run first."
        )
    return (
        f"{out} holds files of a run with no checkpoint to resume from ({what}). Start the "
        "new run with another --out, or pass --train.overwrite true to delete them first."
    )


def prepare(job: JobConfig) -> Run:
    """Check the out dir and take its lock (held by the returned :class:`Run` until it is
    closed), then: resume (settings checked against the newest checkpoint's record), or
    start afresh (refusing an out dir that holds a run unless overwriting). Collective
    under torchrun: every rank reads the same files and decides the same."""
    out = Path(job.train.out)
    _check_out(out)
    held = ExitStack()
    if not out.exists():  # a refused run leaves no empty out dir behind
        held.callback(_remove_if_empty, out)
    try:
        held.enter_context(writer_lock(out, RUNNING))
        run = _prepare(job, out)
    except BaseException:
        held.close()
        raise
    run.held = held
    return run


def _remove_if_empty(out: Path) -> None:
    if _rank() == 0:
        with suppress(OSError):  # the run wrote into it
            out.rmdir()


def _prepare(job: JobConfig, out: Path) -> Run:
    t = job.train
    found = list_checkpoints(checkpoint.checkpoint_dir(out))
    if t.resume and found and not t.overwrite:
        run = Run(job, "", candidates=[p for _, p in reversed(found)])
        for path in run.candidates:
            try:
                run.check(path)
                break
            except CheckpointCorrupt:
                continue  # moved aside by load, with a warning
        _barrier()  # no rank writes into out (config.json...) before every rank has read it
        return run
    held = _held(out)
    if held and not t.overwrite:
        raise FileExistsError(_refusal(out, held, t.resume, found[-1][0] if found else None))
    # a broadcast: ranks leave together here too; the old run is deleted by Run.load, once
    # the model and the optimizer are built (every setting checked)
    return Run(job, new_run_id(), doomed=held)


def _delete(out: Path, held: list[str]) -> None:
    """``--train.overwrite``: delete the old run's files (collective)."""
    _barrier()
    if _rank() == 0:
        _say(f"train.overwrite: deleting the run in {out} ({', '.join(held)})")
        for name in held:
            path = out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    _barrier()
