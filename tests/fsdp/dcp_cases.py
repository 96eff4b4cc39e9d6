"""Workers for test_dcp.py: save with DCP at one world size, load at another, continue."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import galore2
from galore2.checkpoint import (
    CheckpointCorrupt,
    CheckpointMismatch,
    load_checkpoint,
    save_checkpoint,
)
from galore2.fsdp.detect import is_dtensor

from ..dist import GAP, full_params, make_model, optimizer, shard, train

STOP, END = 10, 20  # refreshes at 0 and 8 before the save, 16 after it
SETTINGS = {"projector": "randomized", "moments_on_refresh": "project"}


def _build(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_model()
    if world > 1:
        shard(model, world)
    return model, optimizer(model, SETTINGS)


def save_then_continue(rank: int, world: int, root: str) -> None:
    model, opt = _build(world)
    train(model, opt, range(STOP), rank, world)
    for flatten in (True, False):
        save_checkpoint(
            Path(root) / f"flat{int(flatten)}",
            STOP,
            model,
            opt,
            flatten=flatten,
            extra={"step": torch.tensor(STOP)},
        )
    train(model, opt, range(STOP, END), rank, world)
    full = full_params(model)  # a collective: every rank takes part
    if rank == 0:
        torch.save(full, Path(root) / "uninterrupted.pt")


def load_then_continue(rank: int, world: int, root: str) -> None:
    expected = torch.load(Path(root) / "uninterrupted.pt", weights_only=True)
    for flatten in (True, False):
        model, opt = _build(world)
        extra = load_checkpoint(
            Path(root) / f"flat{int(flatten)}",
            model,
            opt,
            flatten=flatten,
            extra={"step": torch.tensor(0)},
        )
        assert int(extra["step"]) == STOP
        state = next(s for s in opt.state.values() if "galore.refreshes" in s)
        assert int(state["galore.refreshes"]) == 2 and int(state["galore.step"]) == STOP
        train(model, opt, range(STOP, END), rank, world)
        for name, value in full_params(model).items():
            diff = (value - expected[name]).abs().max().item()
            assert diff <= 1e-5, f"world {world}, flatten={flatten}: {name} differs by {diff:.2e}"


def damaged_fails_on_every_rank(rank: int, world: int, root: str) -> None:
    """Ranks split the checksum work; a damaged shard only one rank reads fails them all."""
    model, opt = _build(world)
    try:
        load_checkpoint(Path(root) / "flat1", model, opt, extra={"step": torch.tensor(0)})
    except CheckpointCorrupt as e:
        assert "__0_0.distcp has changed bytes" in str(e), e
    else:
        raise AssertionError(f"rank {rank}: a damaged checkpoint loaded")


def sharded_load_checks(rank: int, world: int, root: str) -> None:
    """load_state_dict with DTensor state: the same settings load (global shapes compared),
    another rank is refused before anything changes, through DCP as well."""
    model, opt = _build(world)
    train(model, opt, range(3), rank, world)
    saved = opt.state_dict()
    assert any(is_dtensor(v) for s in saved["state"].values() for v in s.values())
    model2, opt2 = _build(world)
    opt2.load_state_dict(saved)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        for key, value in opt.state[p].items():
            got = opt2.state[q][key]
            assert torch.equal(got.to_local() if is_dtensor(got) else got,
                               value.to_local() if is_dtensor(value) else value), key  # fmt: skip
    save_checkpoint(Path(root), 3, model, opt)
    for change in ({"rank": 2}, {"seed": 5}):
        model3 = make_model()
        shard(model3, world)
        settings = {**SETTINGS, "rank": 3, "update_proj_gap": GAP, **change}
        groups = galore2.param_groups(model3, **settings)
        opt3 = galore2.GaLoreAdamW(groups, lr=1e-2, weight_decay=0.05)
        key, value = next(iter(change.items()))
        message = f"{key}: checkpoint {saved['param_groups'][0][key]}, this optimizer {value}"
        with pytest.raises(ValueError, match=message):
            opt3.load_state_dict(saved)
        assert not opt3.state and opt3.param_groups[0][key] == value
        # load_checkpoint compares the checkpoint's record first: refused before DCP reads
        with pytest.raises(CheckpointMismatch, match=key):
            load_checkpoint(Path(root), model3, opt3)
        assert not opt3.state
