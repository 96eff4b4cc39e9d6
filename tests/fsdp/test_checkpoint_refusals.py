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


# --- item 4 and item 26 ------------------------------------------------------------------


def test_an_optimizer_loaded_from_a_copy_cannot_save_into_the_original(tmp_path):
    original, copy = tmp_path / "run", tmp_path / "copy"
    _saved(original)
    shutil.copytree(original, copy)
    model, opt = _model_opt()
    load_checkpoint(copy, model, opt, extra={"step": torch.tensor(0)})
    before = _snapshot(original)
    train(model, opt, range(2, 3))
    with pytest.raises(ValueError, match=rf"loaded from {copy}, another folder"):
        save_checkpoint(original, 3, model, opt, keep=1)
    assert _snapshot(original) == before  # nothing written, nothing pruned
    assert save_checkpoint(copy, 3, model, opt, keep=1).is_dir()  # the copy is its folder
    assert [s for s, _ in list_checkpoints(copy)] == [3]


def test_another_path_to_the_same_folder_is_that_folder(tmp_path):
    _saved(tmp_path / "run")
    (tmp_path / "link").symlink_to(tmp_path / "run")
    model, opt = _model_opt()
    load_checkpoint(tmp_path / "link", model, opt, extra={"step": torch.tensor(0)})
    assert save_checkpoint(tmp_path / "run", 3, model, opt).is_dir()


def test_an_optimizer_of_another_run_cannot_take_a_folder_without_records(tmp_path):
    """Item 26: run A's folder whose newest checkpoint has no galore2.json; an optimizer
    tied to run B (it saved elsewhere) saving without run_id would take it over and prune."""
    _saved(tmp_path / "a", steps=(1, 2, 3))
    (tmp_path / "a" / "step-00000003" / "galore2.json").unlink()
    model, opt = _model_opt(seed=1)
    train(model, opt, range(1))
    save_checkpoint(tmp_path / "b", 1, model, opt)
    before = _snapshot(tmp_path / "a")
    with pytest.raises(ValueError, match=r"a run with no readable galore2\.json .* belongs to run"):
        save_checkpoint(tmp_path / "a", 4, model, opt, keep=1)
    assert _snapshot(tmp_path / "a") == before


# --- item 5 ----------------------------------------------------------------------------


@pytest.mark.parametrize("stray", ["empty", "junk", "file"])
def test_a_stray_step_folder_neither_counts_toward_keep_nor_is_deleted(tmp_path, stray):
    model, opt = _saved(tmp_path, steps=(1,))
    path = tmp_path / "step-00000005"
    if stray == "file":
        path.write_text("x")
    else:
        path.mkdir()
        if stray == "junk":
            (path / "notes.txt").write_text("mine")
    with pytest.warns(UserWarning, match=r"step-00000005 is not a checkpoint .* left alone"):
        listed = list_checkpoints(tmp_path)
    assert [s for s, _ in listed] == [1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # warned once above
        for step in (2, 3):
            train(model, opt, range(step - 1, step))
            save_checkpoint(tmp_path, step, model, opt, keep=2, extra={"step": torch.tensor(step)})
        assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]  # 2 was kept
        assert path.exists() and (stray != "junk" or (path / "notes.txt").read_text() == "mine")
        model2, opt2 = _model_opt()
        extra = load_checkpoint(tmp_path, model2, opt2, extra={"step": torch.tensor(0)})
    assert int(extra["step"]) == 3  # the stray is not the newest checkpoint


def test_a_stray_where_a_checkpoint_goes_is_moved_aside_not_deleted(tmp_path):
    model, opt = _model_opt()
    path = tmp_path / "step-00000002"
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    with pytest.warns(UserWarning, match=r"step-00000002 was not a checkpoint: moved to "):
        save_checkpoint(tmp_path, 2, model, opt)
    aside = tmp_path / "step-00000002.stray"
    assert (aside / "notes.txt").read_text() == "mine"
    assert read_record(path)["step"] == 2


# --- item 12: the lock file ----------------------------------------------------------------


def test_a_folder_where_the_lock_file_goes_is_a_clear_error(tmp_path):
    model, opt = _model_opt()
    (tmp_path / ".lock").mkdir()
    lock = tmp_path / ".lock"
    with pytest.raises(CheckpointError, match=rf"cannot lock {lock} \(it is a folder\)"):
        save_checkpoint(tmp_path, 1, model, opt)
    assert not list_checkpoints(tmp_path) and (tmp_path / ".lock").is_dir()
