"""Checkpoint records (galore2.json): one run per folder, checks before DCP reads, clear errors.

Issue 16: a save of an older step or of another run into a folder (items 1), damaged files
(item 11), a checkpoint of another optimizer / rank / model (item 12), a non-int step (item 16).
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import galore2
from galore2.checkpoint import (
    CheckpointCorrupt,
    CheckpointMismatch,
    list_checkpoints,
    load_checkpoint,
    read_record,
    save_checkpoint,
    set_aside,
)

from ..helpers import TinyNet, galore_groups, train


def _model_opt(cls=galore2.GaLoreAdamW, rank=4, model=None):
    torch.manual_seed(0)
    model = model or TinyNet()
    return model, cls(galore_groups(model, rank=rank, update_proj_gap=3), lr=1e-2)


def _trained(root, steps=(2, 4)):
    model, opt = _model_opt()
    for step in steps:
        train(model, opt, range(step - 2, step))
        save_checkpoint(root, step, model, opt, extra={"step": torch.tensor(step)}, keep=2)
    return model, opt


def _load(root, **kw):
    model, opt = _model_opt(**kw)
    return load_checkpoint(root, model, opt, extra={"step": torch.tensor(0)})


# --- item 1: a folder holds one run; pruning never deletes what was just written -------------


def test_save_refuses_an_older_step_or_another_run(tmp_path):
    model, opt = _trained(tmp_path, steps=(10,))
    before = list_checkpoints(tmp_path)
    with pytest.raises(ValueError, match=r"cannot save step 2 .* holds step-00000010, a newer"):
        save_checkpoint(tmp_path, 2, model, opt, keep=1)
    assert list_checkpoints(tmp_path) == before  # nothing written, nothing pruned
    assert not (tmp_path / ".tmp-step-00000002").exists()
    with pytest.raises(ValueError, match=r"holds checkpoints of run \w+ \(steps \[10\]\)"):
        save_checkpoint(tmp_path, 12, model, opt, run_id="another-run")
    # the legit cases: the same run saving the same step again, or a newer one
    run_id = read_record(tmp_path / "step-00000010")["run_id"]
    again = save_checkpoint(tmp_path, 10, model, opt, keep=1, run_id=run_id)
    newer = save_checkpoint(tmp_path, 11, model, opt, keep=1)  # run id: the folder's
    assert newer.is_dir() and not again.exists()  # keep=1: 10 pruned, 11 (just written) kept
    assert read_record(newer)["run_id"] == run_id
    assert [s for s, _ in list_checkpoints(tmp_path)] == [11]


def test_record_is_json_with_run_settings_shapes_and_meta(tmp_path):
    model, opt = _model_opt()
    train(model, opt, range(2))
    path = save_checkpoint(tmp_path, 2, model, opt, meta={"config": {"lr": 0.01}}, run_id="r1")
    rec = json.loads((path / "galore2.json").read_text())  # plain JSON, no pickle
    assert rec == read_record(path)
    assert (rec["run_id"], rec["step"], rec["optimizer"]) == ("r1", 2, "GaLoreAdamW")
    assert rec["meta"] == {"config": {"lr": 0.01}} and rec["world_size"] == 1
    assert rec["params"]["up.weight"] == [40, 24]
    assert rec["groups"][0]["params"] == ["up.weight", "mid.weight", "down.weight"]
    assert rec["groups"][0]["options"]["rank"] == 4
    assert set(rec["files"]) == {p.name for p in path.iterdir()} - {"galore2.json"}
    with pytest.raises(TypeError, match="meta must be a dict of JSON values"):
        save_checkpoint(tmp_path, 3, model, opt, meta={"x": object()})


# --- item 16: bad step / keep fail before anything touches the disk ---------------------------


@pytest.mark.parametrize(
    "kw", [{"step": 5.0}, {"step": True}, {"step": -1}, {"step": "5"}, {"keep": 0}, {"keep": 1.5}]
)
def test_step_and_keep_are_checked_before_touching_disk(tmp_path, kw):
    model, opt = _model_opt()
    args = {"step": 5, "keep": 2, **kw}
    name = next(iter(kw))
    with pytest.raises(ValueError, match=rf"{name} must be an int >= \d, got"):
        save_checkpoint(tmp_path / "root", args["step"], model, opt, keep=args["keep"])
    assert not (tmp_path / "root").exists()


# --- item 11: damaged files are named, and told apart from a mismatch -------------------------


def _truncate(folder):
    shard = next(folder.glob("*.distcp"))
    os.truncate(shard, shard.stat().st_size // 2)


def _flip(folder):
    shard = next(folder.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2  # inside a tensor: DCP itself loads this silently
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    shard.write_bytes(bytes(data))


DAMAGE = {
    "truncated": (_truncate, r"__0_0\.distcp has \d+ bytes, \d+ written"),
    "no_metadata": (lambda f: (f / ".metadata").unlink(), r"\.metadata is missing"),
    "flipped": (_flip, r"__0_0\.distcp has changed bytes"),
    "bad_record": (lambda f: (f / "galore2.json").write_text("{"), r"galore2\.json is unreadable"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_checkpoint_raises_naming_the_folder(tmp_path, damage):
    _trained(tmp_path)
    newest = tmp_path / "step-00000004"
    mutate, why = DAMAGE[damage]
    mutate(newest)
    with pytest.raises(CheckpointCorrupt, match=why) as info:
        _load(tmp_path)
    assert isinstance(info.value, Exception) and info.value.path == newest
    assert str(newest) in str(info.value)
    model, opt = _model_opt()  # the older checkpoint is intact
    extra = load_checkpoint(tmp_path, model, opt, step=2, extra={"step": torch.tensor(0)})
    assert int(extra["step"]) == 2


def test_run_continues_after_setting_a_damaged_checkpoint_aside(tmp_path):
    """The legit case of saving a step a folder held before: the damaged newest checkpoint
    is moved aside (kept), the run resumes from the older one and saves that step again."""
    _trained(tmp_path)
    _truncate(tmp_path / "step-00000004")
    model, opt = _model_opt()
    with pytest.raises(CheckpointCorrupt):
        load_checkpoint(tmp_path, model, opt)
    moved = set_aside(tmp_path / "step-00000004")
    assert moved.name == "step-00000004.corrupt" and moved.is_dir()
    assert int(load_checkpoint(tmp_path, model, opt, extra={"step": torch.tensor(0)})["step"]) == 2
    train(model, opt, range(2, 4))
    again = save_checkpoint(tmp_path, 4, model, opt, keep=2)
    assert read_record(again)["run_id"] == read_record(tmp_path / "step-00000002")["run_id"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 4] and moved.is_dir()


# --- item 12: a checkpoint of another optimizer, rank or model --------------------------------


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            {"cls": galore2.GaLoreAdafactor, "rank": 8},
            r"written by GaLoreAdamW \(rank 4\); this run is GaLoreAdafactor \(rank 8\)",
        ),
        ({"rank": 8}, r"group 0 rank: 4 → 8"),
        ({"model": TinyNet(d_hidden=48)}, r"up\.weight \[40, 24\] → \[48, 24\]"),
    ],
    ids=["optimizer", "rank", "shape"],
)
def test_mismatch_is_a_value_error_naming_both_sides(tmp_path, kw, message):
    _trained(tmp_path)
    with pytest.raises(CheckpointMismatch, match=message) as info:
        _load(tmp_path, **kw)
    assert isinstance(info.value, ValueError) and "step-00000004" in str(info.value)


def test_checkpoint_without_record_loads_and_dcp_errors_are_wrapped(tmp_path):
    """Checkpoints of older releases have no galore2.json: they load (one warning), and a
    mismatch DCP finds is a CheckpointMismatch naming the folder, not a BaseException."""
    _trained(tmp_path)
    for _, path in list_checkpoints(tmp_path):
        (path / "galore2.json").unlink()
    with pytest.warns(UserWarning, match="no galore2.json"):
        assert int(_load(tmp_path)["step"]) == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        assert int(_load(tmp_path)["step"]) == 4
    with pytest.raises(
        CheckpointMismatch, match=r"step-00000004 does not fit.*proj\.right \[24, 4\] → \[24, 8\]"
    ):
        _load(tmp_path, rank=8)
    (tmp_path / "step-00000004" / ".metadata").unlink()
    with pytest.raises(CheckpointCorrupt, match=r"step-00000004 is damaged: \.metadata"):
        _load(tmp_path)


def test_a_shard_that_grew_is_refused_without_checksums(tmp_path):
    """Sizes are checked even under verify=False: bytes appended to a shard (DCP reads by
    offset and would not notice) are a damaged checkpoint."""
    _trained(tmp_path)
    shard = next((tmp_path / "step-00000004").glob("*.distcp"))
    size = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(b"\0" * 64)
    model, opt = _model_opt()
    with pytest.raises(CheckpointCorrupt, match=rf"__0_0\.distcp has {size + 64} bytes, {size}"):
        load_checkpoint(tmp_path, model, opt, verify=False)
    assert not opt.state
