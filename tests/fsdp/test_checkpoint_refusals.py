"""Refused loads change nothing, and a folder belongs to the optimizer that loaded from it
(issue 39 items 2, 4, 5, 26; ``.lock`` a folder: item 12).

Item 2: a load refused by DCP itself (an ``extra`` entry that was never saved, or
``flatten=False`` for a flattened checkpoint) came after DCP's zero-gradient step had made
the fresh optimizer's state; training it afterwards differed from a fresh optimizer.
Item 4: ownership was checked by run id only, so an optimizer loaded from a *copy* of a
folder could save into the original. Item 26: an optimizer tied to another run could save
without ``run_id`` into a folder whose newest checkpoint has no ``galore2.json``.
Item 5: a stray ``step-N`` folder (empty, or without DCP's files) counted toward ``keep``.
"""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch

import galore2
from galore2.checkpoint import (
    CheckpointError,
    CheckpointMismatch,
    list_checkpoints,
    load_checkpoint,
    read_record,
    run_of,
    save_checkpoint,
)

from ..helpers import TinyNet, galore_groups, train


def _model_opt(seed=0):
    torch.manual_seed(seed)
    model = TinyNet()
    return model, galore2.GaLoreAdamW(galore_groups(model, rank=4, update_proj_gap=3), lr=1e-2)


def _saved(root, steps=(1, 2)):
    model, opt = _model_opt()
    for step in steps:
        train(model, opt, range(step - 1, step))
        save_checkpoint(root, step, model, opt, extra={"step": torch.tensor(step)})
    return model, opt


def _snapshot(root):
    return sorted(
        (p.relative_to(root).as_posix(), p.stat().st_size) for p in root.rglob("*") if p.is_file()
    )


# --- item 2 ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [{"extra": {"step": torch.tensor(0), "never_saved": torch.tensor(0)}}, {"flatten": False}],
    ids=["extra-never-saved", "flatten-false"],
)
def test_a_load_refused_by_dcp_leaves_a_fresh_optimizer_fresh(tmp_path, kw):
    _saved(tmp_path)
    model, opt = _model_opt(seed=1)
    with pytest.raises(CheckpointMismatch, match="step-00000002"):
        load_checkpoint(tmp_path, model, opt, **kw)
    assert not opt.state and run_of(opt) is None
    twin, twin_opt = _model_opt(seed=1)  # never touched
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    train(model, opt, range(5))
    train(twin, twin_opt, range(5))
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)  # bitwise: the same kernels in the same order
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        for k, v in twin_opt.state[q].items():
            assert torch.equal(opt.state[p][k], v), k


def test_a_load_refused_by_dcp_leaves_a_trained_optimizer_as_it_was(tmp_path):
    _saved(tmp_path)
    model, opt = _model_opt(seed=1)
    train(model, opt, range(2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    with pytest.raises(CheckpointMismatch):
        load_checkpoint(tmp_path, model, opt, extra={"never_saved": torch.tensor(0)})
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    for p, s in opt.state.items():
        assert s.keys() == state[id(p)].keys()
        assert all(torch.equal(v, state[id(p)][k]) for k, v in s.items())
    assert run_of(opt) is None
