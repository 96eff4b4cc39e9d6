"""The recipe's start-up: one run per out dir, settings changed on resume, bad checkpoint
settings found before training, damaged checkpoints (issue 16 items 1, 3, 10, 11)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from recipes import optimizers
from recipes.config import OptimConfig
from recipes.metrics import read_metrics

from .test_recipe import run


def _steps(out: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("step-????????"))


def _record(out: Path, step: int) -> dict:
    return json.loads((out / "checkpoints" / f"step-{step:08d}" / "galore2.json").read_text())


@pytest.fixture(scope="module")
def old_run(tmp_path_factory) -> Path:
    """A finished 12-step run with checkpoints at steps 8 and 12 (keep 2)."""
    out = tmp_path_factory.mktemp("old") / "run"
    run(out, "--steps", "12", "--train.checkpoint_every", "4")
    assert _steps(out) == [8, 12]
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# --- item 1: a fresh run never mixes with the run in its out dir ------------------------------


def test_fresh_run_refuses_an_out_dir_holding_a_run(old_run, tmp_path):
    out = _copy(old_run, tmp_path / "run")
    metrics = (out / "metrics.jsonl").read_text()
    fresh = ["--steps", "6", "--train.resume", "false", "--train.checkpoint_every", "4"]
    with pytest.raises(FileExistsError, match=r"already holds a run .*--train\.overwrite true"):
        run(out, *fresh)
    assert _steps(out) == [8, 12] and (out / "metrics.jsonl").read_text() == metrics
    # asked explicitly: the old run goes, the new run's checkpoints stay
    new = run(out, *fresh, "--train.overwrite", "true")
    assert _steps(out) == [4, 6] and read_metrics(out) == new
    assert json.loads((out / "config.json").read_text())["train"]["steps"] == 6
    # a later plain resume continues the new run, not the old one
    more = run(out, "--steps", "8", "--train.checkpoint_every", "4")
    assert [r["step"] for r in more] == [8] and _steps(out) == [6, 8]
    assert _record(out, 8)["run_id"] == _record(out, 6)["run_id"]


def test_resume_with_nothing_to_resume_refuses_a_used_out_dir(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 2, "loss": 5.0}\n')
    with pytest.raises(FileExistsError, match="no checkpoint to resume from"):
        run(out, "--steps", "2")
    assert (out / "metrics.jsonl").read_text() == '{"step": 2, "loss": 5.0}\n'


# --- item 3: what may change on resume is applied and recorded; the rest is refused ------------


def test_resume_applies_changed_settings_and_records_them(old_run, tmp_path, capsys):
    out = _copy(old_run, tmp_path / "run")
    changed = ["--optim.scale", "2.0", "--optim.weight_decay", "0.3", "--optim.update_proj_gap",
               "7", "--optim.lr", "0.02", "--train.eval_every", "2"]  # fmt: skip
    hist = run(out, "--steps", "16", *changed)
    assert [r["step"] for r in hist] == [14, 16]
    said = capsys.readouterr().out
    assert "at step 12; from step 13 on: optim.lr: 0.01 → 0.02" in said
    assert "optim.scale: 0.25 → 2.0" in said
    config = json.loads((out / "config.json").read_text())
    assert config["optim"]["options"]["lr"] == 0.02  # the settings in force, and how they came
    changes = {c["key"]: (c["step"], c["from"], c["to"]) for c in config["changes"]}
    assert changes == {
        "optim.lr": (12, 0.01, 0.02),
        "optim.scale": (12, 0.25, 2.0),
        "optim.update_proj_gap": (12, 5, 7),
        "optim.weight_decay": (12, 0.0, 0.3),
        "train.checkpoint_every": (12, 4, 0),
        "train.eval_every": (12, 4, 2),
        "train.steps": (12, 12, 16),
    }
    groups = [g["options"] for g in _record(out, 16)["groups"]]  # what the optimizer ran with
    projected = next(g for g in groups if g["rank"] is not None)
    assert (projected["scale"], projected["update_proj_gap"]) == (2.0, 7)
    assert sorted({g["weight_decay"] for g in groups}) == [0.0, 0.3]
    assert {g["initial_lr"] for g in groups} == {0.02}
    lrs = {r["step"]: r["lr"] for r in hist}
    fn = optimizers.schedule_fn(OptimConfig(), 16)  # the new base lr on the new schedule
    assert lrs[16] == pytest.approx(0.02 * fn(16)) and hist[-1]["val_loss"] > 0
    assert _record(out, 16)["meta"]["changes"] == config["changes"]


def test_resumed_run_refreshes_on_the_changed_gap(old_run, tmp_path, monkeypatch):
    """Issue 30 item 4: "optim.update_proj_gap: 5 → 2" on resume at step 12 (the old
    schedule's next refresh: step 15) refreshes every projected matrix at steps 12 and 14
    (0-based optimizer steps: one new gap after the last refresh at 10), not at 15."""
    from galore2.optim import GaLore

    calls: list[int] = []
    original = GaLore.refresh

    def counted(self, G, state, group, plan, step, *args, **kwargs):
        done = original(self, G, state, group, plan, step, *args, **kwargs)
        if done:  # (the state-creating zero-gradient step of a DCP load refreshes nothing)
            calls.append(step)
        return done

    monkeypatch.setattr(GaLore, "refresh", counted)
    run(_copy(old_run, tmp_path / "run"), "--steps", "16", "--optim.update_proj_gap", "2")
    assert sorted(set(calls)) == [12, 14]
    assert len(calls) == 2 * 14  # 2 layers × 7 projected matrices, twice


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--optim.projector", "svd"], "optim.projector: 'power' → 'svd'"),
        (["--optim.rank", "4", "--optim.seed", "3"], "optim.rank: 8 → 4; optim.seed: 0 → 3"),
        (["--model.dim", "64"], "model.dim: 32 → 64"),
        (["--data.seq_len", "32", "--model.max_seq_len", "32"], "data.seq_len: 64 → 32"),
        (["--train.batch_size", "2"], "train.batch_size: 4 → 2"),
        (["--optimizer", "galore_adafactor"], "optim.name: 'galore_adamw' → 'galore_adafactor'"),
    ],
    ids=["projector", "rank_seed", "model", "data", "batch", "optimizer"],
)
def test_resume_refuses_changes_a_checkpoint_cannot_continue(old_run, tmp_path, flags, named):
    out = _copy(old_run, tmp_path / "run")
    metrics = (out / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match="cannot resume") as info:
        run(out, "--steps", "16", *flags)
    assert named in str(info.value) and "step-00000012 (step 12)" in str(info.value)
    assert (out / "metrics.jsonl").read_text() == metrics and _steps(out) == [8, 12]


# --- item 10: checkpoint settings and the out dir are checked before the first step ------------


@pytest.mark.parametrize(
    "flags, error, match",
    [
        (["--train.keep_checkpoints", "0"], ValueError, r"train\.keep_checkpoints must be >= 1"),
        (["--train.log_every", "0"], ValueError, r"train\.log_every must be >= 1"),
        (["--train.eval_every", "0"], ValueError, r"train\.eval_every must be >= 1"),
        (["--train.checkpoint_every", "-2"], ValueError, r"train\.checkpoint_every must be >= -1"),
        ("checkpoints_file", NotADirectoryError, r"checkpoints is a file"),
        ("out_file", NotADirectoryError, r"is a file; --out must name a folder"),
    ],
    ids=["keep0", "log0", "eval0", "checkpoint_every", "checkpoints_file", "out_file"],
)
def test_bad_settings_fail_before_training(tmp_path, flags, error, match):
    out = tmp_path / "run"
    if flags == "checkpoints_file":
        out.mkdir()
        (out / "checkpoints").write_text("not a folder")
    elif flags == "out_file":
        out.write_text("not a folder")
    argv = [] if isinstance(flags, str) else flags
    with pytest.raises(error, match=match):
        run(out, "--steps", "4", "--train.checkpoint_every", "0", *argv)
    assert not (out / "metrics.jsonl").exists() if out.is_dir() else True


# --- item 11: a damaged newest checkpoint is set aside and the older one resumes ---------------


def _truncate(folder: Path) -> None:
    shard = next(folder.glob("*.distcp"))
    os.truncate(shard, shard.stat().st_size // 2)


def _flip(folder: Path) -> None:
    shard = next(folder.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    at = len(data) // 2
    data[at : at + 8] = bytes(b ^ 0xFF for b in data[at : at + 8])
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage",
    [_truncate, lambda f: (f / ".metadata").unlink(), _flip],
    ids=["truncated", "no_metadata", "flipped"],
)
def test_damaged_newest_checkpoint_falls_back_to_the_older_one(old_run, tmp_path, damage):
    out = _copy(old_run, tmp_path / "run")
    damage(out / "checkpoints" / "step-00000012")
    with pytest.warns(
        UserWarning, match=r"step-00000012 is damaged, moved to step-00000012\.corrupt"
    ):
        hist = run(out, "--steps", "12", "--train.checkpoint_every", "4")
    assert (out / "checkpoints" / "step-00000012.corrupt").is_dir()  # kept, not deleted
    assert _steps(out) == [8, 12]  # step 12 written again, from step 8
    original = {r["step"]: r for r in read_metrics(old_run)}
    assert [r["step"] for r in hist] == [10, 12]
    for r in hist:  # from step 8 exactly as the uninterrupted run went
        assert r["loss"] == original[r["step"]]["loss"]


def test_compare_goes_by_global_batch_and_option_declarations():
    """The pure comparison behind resume: the global batch (batch × ranks) may be re-split
    across another world size; an option set back to its default is a change too; which
    galore2 options are refused comes from their declarations (``resumable``)."""
    from recipes.resolve import parse_args
    from recipes.resume import compare

    base = ["--config", "tiny", "--train.batch_size", "4"]
    old = json.loads(json.dumps(parse_args([*base, "--optim.basis_dtype", "int8"]).to_dict()))
    same_global = parse_args([*base[:-1], "8", "--optim.basis_dtype", "int8"])
    changes, refused = compare(old, same_global, worlds=(2, 1))
    assert refused == {} and changes == {"train.batch_size": (4, 8)}
    changes, refused = compare(old, same_global, worlds=(1, 1))
    assert refused == {"train.batch_size": (4, 8)}
    changes, refused = compare(old, parse_args([*base[:-1], "2"]), worlds=(1, 4))
    assert set(refused) == {"train.batch_size × ranks", "optim.basis_dtype"}
    assert refused["optim.basis_dtype"] == ("int8", "fp32")  # unset: its default
    changes, refused = compare(old, parse_args([*base, "--optim.basis_dtype", "int8",
                                                "--optim.moments_on_refresh", "reset"]))  # fmt: skip
    assert refused == {} and changes == {"optim.moments_on_refresh": ("keep", "reset")}


def test_resume_with_another_train_seed_is_refused():
    """The per-epoch shuffle derives from train.seed: under a restored loader position another
    seed would silently change which sequences the rest of the epoch sees."""
    from recipes.resolve import parse_args
    from recipes.resume import compare

    base = ["--config", "tiny", "--train.seed", "1"]
    old = json.loads(json.dumps(parse_args(base).to_dict()))
    changes, refused = compare(old, parse_args([*base[:-1], "2"]))
    assert refused == {"train.seed": (1, 2)} and "train.seed" not in changes
    assert compare(old, parse_args(base)) == ({}, {})
