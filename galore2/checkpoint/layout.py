"""A checkpoint without ``galore2.json`` checked against DCP's own ``.metadata``.

Older releases wrote no record, so the only description of such a checkpoint is DCP's
metadata: every stored entry's flattened name and, for tensors, its global size. DCP reads
entry by entry into the live model's tensors, so a size mismatch found while reading
leaves the model half-loaded; comparing names and sizes first refuses such a checkpoint
before any weight changes, and so does comparing the group options DCP stored (small
non-tensor entries, read alone first) with those of the optimizer at hand.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .errors import CheckpointCorrupt, CheckpointMismatch, _listed, from_dcp
from .record import jsonable

_SHOWN = 6


def stored(folder: Path) -> Mapping[str, Any]:
    """DCP's metadata of ``folder``: flattened name → storage metadata."""
    try:
        return dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    except Exception as e:  # a damaged .metadata (truncated pickle...)
        raise CheckpointCorrupt(
            f"checkpoint {folder} is damaged: .metadata cannot be read ({e})", folder
        ) from None


def check(
    folder: Path,
    metadata: Mapping[str, Any],
    state: Mapping[str, Any],
    prefix: str,
    *,
    exact: bool,
) -> None:
    """Raise :class:`CheckpointMismatch` if ``state`` (``{prefix: ...}``, as DCP flattens
    it) has entries the checkpoint lacks, tensors of other sizes, or — ``exact`` — the
    checkpoint has entries under ``prefix`` that ``state`` lacks."""
    flat, _ = flatten_state_dict({prefix: state})
    problems = []
    for name, value in flat.items():
        found = metadata.get(name)
        if found is None:
            problems.append(f"{name} is not in the checkpoint")
        elif isinstance(value, torch.Tensor):
            if not isinstance(found, TensorStorageMetadata):
                problems.append(f"{name} is not a tensor in the checkpoint")
            elif tuple(found.size) != tuple(value.shape):
                problems.append(f"{name} {list(found.size)} → {list(value.shape)}")
    if exact:
        extra = [n for n in metadata if n.startswith(prefix + ".") and n not in flat]
        problems += [f"{n} is only in the checkpoint" for n in extra]
    if problems:
        raise CheckpointMismatch(
            f"checkpoint {folder} does not fit this model / optimizer (it has no galore2.json; "
            f"DCP's .metadata was compared): {_listed(problems, _SHOWN)}. "
            "Nothing was loaded.",
            folder,
        )


def _groups(optim_state: Mapping[str, Any]) -> dict[str, Any]:
    """The group-option part of an optimizer state dict (flattened or not), copied."""
    if "param_groups" in optim_state:
        return {"param_groups": copy.deepcopy(optim_state["param_groups"])}
    return {k: copy.deepcopy(v) for k, v in optim_state.items() if k.startswith("param_groups.")}


def _option_values(groups: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """where → (option, value) of every group option (``params`` lists left out)."""
    if "param_groups" in groups:
        return {
            f"group {i} {k}": (k, v)
            for i, g in enumerate(groups["param_groups"])
            for k, v in g.items()
            if k != "params"
        }
    out = {}
    for key, value in groups.items():
        where, _, name = key.removeprefix("param_groups.").rpartition(".")
        out[f"{where} {name}"] = (name, value)
    return out


def check_options(
    folder: Path,
    optim_state: Mapping[str, Any],
    options: Mapping[str, Any] | None,
) -> None:
    """Read only the checkpoint's group options and raise :class:`CheckpointMismatch` for
    each option declared not resumable (``options``: name → galore2 ``Option``) whose value
    differs from ``optim_state``'s (another rank, projector, seed...)."""
    if not options:
        return
    now = _groups(optim_state)
    saved = {"optim": _groups(optim_state)}
    try:
        dcp.load(saved, checkpoint_id=str(folder))
    except (CheckpointException, Exception) as e:  # DCP's is a BaseException
        raise from_dcp(e, folder, False) from e
    before, after = _option_values(saved["optim"]), _option_values(now)
    problems = []
    for where, (name, value) in after.items():
        option = options.get(name)
        old = before.get(where, (name, value))[1]
        if option is not None and not option.resumable and jsonable(old) != jsonable(value):
            problems.append(f"{where}: {jsonable(old)!r} → {jsonable(value)!r}")
    if problems:
        raise CheckpointMismatch(
            f"checkpoint {folder} was written with other settings that its state depends on "
            f"(it has no galore2.json; DCP's stored group options were compared): "
            f"{_listed(problems, _SHOWN)}. Nothing was loaded.",
            folder,
        )
