"""``galore2.json``: which run wrote a checkpoint and what it holds, as JSON (never pickle).

Written into the folder before the atomic rename, so every complete checkpoint has one:
the run id, the step, the world size, the optimizer class, each parameter group's
parameter names and option values, every model entry's global shape, each file's size
and CRC-32 (:mod:`.files`), and the caller's ``meta`` (the recipe stores its whole
configuration there). Loading compares it with the model and optimizer at hand before
DCP reads anything, so a checkpoint that does not fit fails with the difference named.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import _dist
from .errors import CheckpointCorrupt, CheckpointMismatch, _listed

FILE = "galore2.json"
FORMAT = 1
#: module names wrappers insert into parameter names (compile, activation checkpointing,
#: FSDP1); DCP's state-dict names leave them out, so do these records
_WRAPPERS = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}
_SHOWN = 12


def new_run_id() -> str:
    """A fresh run id, the same on every rank (a collective under a process group)."""
    ids = [uuid.uuid4().hex]
    if _dist.active():
        dist.broadcast_object_list(ids, src=0)
    return ids[0]


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON (tensors as numbers, dtypes and other objects as strings)."""
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    return str(value)


def check_meta(meta: Any) -> dict[str, Any]:
    """``meta`` if it is a JSON object (a dict of JSON values), else ``TypeError``."""
    if meta is None:
        return {}
    try:
        if not isinstance(meta, dict):
            raise TypeError(f"a {type(meta).__name__}")
        return json.loads(json.dumps(meta, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise TypeError(f"meta must be a dict of JSON values (it is stored as JSON): {e}") from None


def param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) → its name, without the segments wrappers add."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    clean = lambda n: ".".join(s for s in n.split(".") if s not in _WRAPPERS)  # noqa: E731
    return {id(p): clean(n) for n, p in model.named_parameters(remove_duplicate=False)}


def describe(
    model: nn.Module, optimizer: torch.optim.Optimizer, model_state: Mapping[str, Any]
) -> dict[str, Any]:
    """What a checkpoint of ``model`` / ``optimizer`` holds (global shapes, any world size)."""
    names = param_names(model)
    groups = []
    for group in optimizer.param_groups:
        params = [names.get(id(p), f"<unnamed {tuple(p.shape)}>") for p in group["params"]]
        options = {k: jsonable(v) for k, v in group.items() if k != "params"}
        groups.append({"params": params, "options": options})
    cls = type(optimizer)
    return {
        "optimizer": cls.__name__,
        "optimizer_class": f"{cls.__module__}.{cls.__qualname__}",
        "groups": groups,
        "params": {k: list(v.shape) for k, v in model_state.items() if hasattr(v, "shape")},
    }


def write(folder: Path, record: dict[str, Any]) -> None:
    (folder / FILE).write_text(json.dumps(record, indent=1, allow_nan=False) + "\n")


def read(folder: Path) -> dict[str, Any] | None:
    """The folder's record; ``None`` for a checkpoint written before records existed."""
    path = Path(folder) / FILE
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointCorrupt(
            f"checkpoint {folder}: {FILE} is unreadable ({e})", folder
        ) from None
    keys = ("format", "run_id", "step", "optimizer", "groups", "params", "files", "meta")
    if not isinstance(record, dict) or any(k not in record for k in keys):
        raise CheckpointCorrupt(f"checkpoint {folder}: {FILE} lacks fields of {keys}", folder)
    if record["format"] != FORMAT:
        raise CheckpointMismatch(
            f"checkpoint {folder}: {FILE} has format {record['format']!r}; this galore2 reads "
            f"format {FORMAT} (a newer release wrote it?)",
            folder,
        )
    return record


def summary(record: Mapping[str, Any]) -> str:
    """``GaLoreAdamW (rank 32)``: the optimizer and its projection rank, if any."""
    ranks = [g["options"].get("rank") for g in record["groups"]]
    rank = next((r for r in ranks if r is not None), None)
    return record["optimizer"] + (f" (rank {rank})" if rank is not None else "")


def _params(saved: Mapping[str, list], now: Mapping[str, list]) -> list[str]:
    out = [f"{k} {saved[k]} → {now[k]}" for k in saved if k in now and saved[k] != now[k]]
    gone = [k for k in saved if k not in now]
    new = [k for k in now if k not in saved]
    if gone:
        out.append(f"only in the checkpoint: {', '.join(gone[:4])}{' ...' * (len(gone) > 4)}")
    if new:
        out.append(f"only in this model: {', '.join(new[:4])}{' ...' * (len(new) > 4)}")
    return out


def _groups(saved: list, now: list, options: Mapping[str, Any] | None) -> list[str]:
    if len(saved) != len(now):
        return [f"{len(saved)} parameter groups → {len(now)}"]
    out = []
    for i, (a, b) in enumerate(zip(saved, now, strict=True)):
        if a["params"] != b["params"]:
            out.append(
                f"group {i} holds other parameters ({len(a['params'])} → {len(b['params'])})"
            )
        for key in sorted(set(a["options"]) | set(b["options"])):
            old, new = a["options"].get(key), b["options"].get(key)
            option = (options or {}).get(key)
            if old != new and option is not None and not option.resumable:
                out.append(f"group {i} {key}: {old!r} → {new!r}")
    return out


def check_fits(
    saved: Mapping[str, Any],
    now: Mapping[str, Any],
    folder: Path,
    options: Mapping[str, Any] | None = None,
) -> None:
    """Raise :class:`CheckpointMismatch` if the checkpoint ``saved`` cannot continue as
    ``now`` (both from :func:`describe`): another optimizer class, other parameter names
    or shapes, other groups, or a differing option whose declaration (``options``: name →
    galore2 ``Option``) says it is not resumable."""
    diffs = []
    if saved["optimizer"] != now["optimizer"]:
        diffs.append(f"optimizer {saved['optimizer']} → {now['optimizer']}")
    diffs += _params(saved["params"], now["params"])
    diffs += _groups(saved["groups"], now["groups"], options)
    if diffs:
        raise CheckpointMismatch(
            f"checkpoint {folder} was written by {summary(saved)}; this run is {summary(now)}. "
            f"Differences: {_listed(diffs, _SHOWN)}. Load it with the model and "
            "settings it was written with, or start a new run in another folder.",
            folder,
        )
