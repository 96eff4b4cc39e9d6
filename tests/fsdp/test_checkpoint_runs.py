"""A checkpoint folder holds one run (issue 30 items 1, 2, 3, 6).

Item 1: a save without ``run_id`` by anything that did not save into or load from the
folder is refused before anything is written or pruned; the run itself, resumed by
``load_checkpoint`` into new objects, keeps saving. Item 2: a missing root or a file is a
``FileNotFoundError``. Item 3: a refused load of a checkpoint without ``galore2.json``
changes nothing. Item 6: a second process saving into the folder at the same time is
refused clearly. And the older-step refusal compares with the newest checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import galore2
from galore2.checkpoint import (
    CheckpointBusy,
    CheckpointMismatch,
    list_checkpoints,
    load_checkpoint,
    read_record,
    run_of,
    save_checkpoint,
)

from ..helpers import TinyNet, galore_groups, train

ROOT = Path(__file__).resolve().parents[2]


def _model_opt(rank=4, cls=galore2.GaLoreAdamW):
    torch.manual_seed(0)
    model = TinyNet()
    return model, cls(galore_groups(model, rank=rank, update_proj_gap=3), lr=1e-2)


def _run_a(root, steps=(1, 2, 3)):
    model, opt = _model_opt()
    for step in steps:
        train(model, opt, range(step - 1, step))
        save_checkpoint(root, step, model, opt, extra={"step": torch.tensor(step)}, keep=3)
    return model, opt


def _snapshot(root):
    return sorted(
        (p.relative_to(root).as_posix(), p.stat().st_size) for p in root.rglob("*") if p.is_file()
    )


def _load(root, **kw):
    model, opt = _model_opt(**kw)
    extra = load_checkpoint(root, model, opt, extra={"step": torch.tensor(0)})
    return model, opt, extra


# --- item 1 ----------------------------------------------------------------------------


def test_another_model_cannot_take_over_a_folder(tmp_path):
    """The issue's case: nn.Linear(8, 8) with another optimizer saving steps 4–6 into a
    folder holding run A's steps 1–3 (keep=3) took A's id and pruned A's checkpoints."""
    _run_a(tmp_path)
    run_a = read_record(tmp_path / "step-00000003")["run_id"]
    before = _snapshot(tmp_path)
    other = nn.Linear(8, 8)
    other_opt = galore2.GaLoreAdafactor(galore2.param_groups(other, rank=2), lr=1e-3)
    other(torch.randn(4, 8)).sum().backward()
    other_opt.step()
    with pytest.raises(
        ValueError, match=rf"cannot save step 4 .* holds checkpoints of run {run_a}"
    ):
        save_checkpoint(tmp_path, 4, other, other_opt, keep=3)
    assert _snapshot(tmp_path) == before  # nothing written, nothing pruned, no lock left
    _, _, extra = _load(tmp_path)  # A's resume still works
    assert int(extra["step"]) == 3


def test_a_fresh_run_of_the_same_architecture_is_refused(tmp_path):
    _run_a(tmp_path)
    before = _snapshot(tmp_path)
    model, opt = _model_opt()  # same model and settings, never loaded from the folder
    train(model, opt, range(4))
    with pytest.raises(ValueError, match="neither saved into that folder nor was loaded from it"):
        save_checkpoint(tmp_path, 4, model, opt)
    assert _snapshot(tmp_path) == before and run_of(opt) is None


def test_the_resumed_run_keeps_saving_without_a_run_id(tmp_path):
    """New objects (as in a new process) tied to the run by load_checkpoint alone."""
    _, opt_a = _run_a(tmp_path)
    run_a = read_record(tmp_path / "step-00000003")["run_id"]
    assert run_of(opt_a) == run_a
    del opt_a
    model, opt, _ = _load(tmp_path)
    assert run_of(opt) == run_a
    for step in (4, 5):
        train(model, opt, range(step - 1, step))
        save_checkpoint(tmp_path, step, model, opt, keep=3)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4, 5]
    assert {read_record(p)["run_id"] for _, p in list_checkpoints(tmp_path)} == {run_a}


def test_a_run_resumed_elsewhere_cannot_save_into_a_third_run(tmp_path):
    _run_a(tmp_path / "a")
    model_b, opt_b = _model_opt()
    save_checkpoint(tmp_path / "b", 1, model_b, opt_b)
    model, opt, _ = _load(tmp_path / "a")
    with pytest.raises(ValueError, match=r"this optimizer belongs to run \w+ \(it last saved"):
        save_checkpoint(tmp_path / "b", 4, model, opt)
    # the run may move on into an empty folder (a copy of the run, its id kept)
    moved = save_checkpoint(tmp_path / "c", 4, model, opt)
    assert read_record(moved)["run_id"] == run_of(opt)


def test_a_run_without_records_continues_only_after_loading(tmp_path):
    """Checkpoints of an older release have no galore2.json: only an optimizer loaded from
    that folder continues it."""
    _run_a(tmp_path)
    for _, path in list_checkpoints(tmp_path):
        (path / "galore2.json").unlink()
    model, opt = _model_opt()
    with pytest.raises(ValueError, match=r"a run with no readable galore2\.json"):
        save_checkpoint(tmp_path, 4, model, opt)
    with pytest.warns(UserWarning, match="no galore2.json"):
        model, opt, _ = _load(tmp_path)
    assert save_checkpoint(tmp_path, 4, model, opt).is_dir()


def test_older_step_is_compared_with_the_newest_checkpoint(tmp_path):
    """Steps 10 and 20 in the folder: saving 15 is refused (the oldest, 10, is older)."""
    model, opt = _model_opt()
    for step in (10, 20):
        save_checkpoint(tmp_path, step, model, opt, keep=3)
    before = _snapshot(tmp_path)
    with pytest.raises(ValueError, match=r"cannot save step 15 .* holds step-00000020, a newer"):
        save_checkpoint(tmp_path, 15, model, opt, keep=3)
    assert _snapshot(tmp_path) == before


# --- item 2 ----------------------------------------------------------------------------


def test_load_from_a_missing_path_or_a_file_names_it(tmp_path):
    model, opt = _model_opt()
    missing = tmp_path / "typo"
    with pytest.raises(FileNotFoundError, match=rf"{missing}: it does not exist"):
        load_checkpoint(missing, model, opt)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(FileNotFoundError, match=rf"{a_file} is a file"):
        load_checkpoint(a_file, model, opt)
    _run_a(tmp_path / "run", steps=(1,))
    one = tmp_path / "run" / "step-00000001"
    with pytest.raises(FileNotFoundError, match=r"is a checkpoint, not a folder.*step=1"):
        load_checkpoint(one, model, opt)
    assert not opt.state  # nothing changed
    empty = tmp_path / "empty"
    empty.mkdir()
    assert load_checkpoint(empty, model, opt) is None  # a folder with nothing to resume


# --- item 3 ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [{"rank": 8}, {"cls": galore2.GaLoreAdafactor}, {"seed": 5}, {"projector": "randomized"}],
    ids=["rank", "optimizer", "seed", "projector"],
)
def test_refused_load_without_record_changes_nothing(tmp_path, kw):
    """The issue's case is ``seed``/``projector``: same keys and shapes, so DCP loaded the
    weights, then the optimizer's load_state_dict refused its settings."""
    _run_a(tmp_path, steps=(1, 2))
    for _, path in list_checkpoints(tmp_path):
        (path / "galore2.json").unlink()
    torch.manual_seed(1)  # other weights than the checkpoint's
    model = TinyNet()
    settings = {"rank": 4, "update_proj_gap": 3, **kw}
    cls = settings.pop("cls", galore2.GaLoreAdamW)
    opt = cls(galore_groups(model, **settings), lr=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning), pytest.raises(CheckpointMismatch, match="step-00000002"):
        load_checkpoint(tmp_path, model, opt)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not opt.state and run_of(opt) is None


def test_refused_load_of_another_model_without_record_changes_nothing(tmp_path):
    _run_a(tmp_path, steps=(1,))
    (tmp_path / "step-00000001" / "galore2.json").unlink()
    torch.manual_seed(1)
    model = TinyNet(d_hidden=48)
    opt = galore2.GaLoreAdamW(galore_groups(model, rank=4, update_proj_gap=3), lr=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning), pytest.raises(CheckpointMismatch, match=r"up\.weight"):
        load_checkpoint(tmp_path, model, opt)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not opt.state


# --- item 6 ----------------------------------------------------------------------------

SLOW_WRITER = r"""
import sys, time
from pathlib import Path
import torch
import galore2
import galore2.checkpoint as ck
from tests.helpers import TinyNet, galore_groups

root, go = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
model = TinyNet()
opt = galore2.GaLoreAdamW(galore_groups(model, rank=4, update_proj_gap=3), lr=1e-2)
real_save = ck.dcp.save

def slow_save(state, checkpoint_id):
    print("saving", flush=True)
    while not go.exists():
        time.sleep(0.05)
    real_save(state, checkpoint_id=checkpoint_id)

ck.dcp.save = slow_save
ck.save_checkpoint(root, 1, model, opt)
print("saved", flush=True)
"""


def test_a_second_writer_is_refused_while_one_saves(tmp_path):
    root, go = tmp_path / "ckpt", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_WRITER, str(root), str(go)],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "saving", proc.stderr.read()[-2000:]
        model, opt = _model_opt()
        with pytest.raises(CheckpointBusy, match=rf"another process is saving .* {root}") as e:
            save_checkpoint(root, 1, model, opt)
        assert isinstance(e.value, RuntimeError) and f"pid {proc.pid}" in str(e.value)
        assert not list_checkpoints(root)
    finally:
        go.touch()
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and out.strip() == "saved", err[-2000:]
    assert [s for s, _ in list_checkpoints(root)] == [1] and not (root / ".lock").exists()


def test_a_lock_left_by_a_killed_writer_does_not_block(tmp_path):
    """The lock is the kernel's (flock): a writer that died leaves the file, not the lock."""
    model, opt = _model_opt()
    tmp_path.joinpath(".lock").write_text("pid 1 on elsewhere\n")
    assert save_checkpoint(tmp_path, 1, model, opt).is_dir()
    assert not (tmp_path / ".lock").exists()
