"""The atomic checkpoint helper: keep-last-K, and a writer killed mid-save loses nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import galore2
from galore2.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint

from ..helpers import TinyNet, galore_groups, train

ROOT = Path(__file__).resolve().parents[2]

KILLED_WRITER = r"""
import os, signal, sys
import torch
import galore2
import galore2.checkpoint as ck
from tests.helpers import TinyNet, galore_groups, train

root = sys.argv[1]
torch.set_num_threads(int(sys.argv[2]))  # the parent's: its reference run must match bit for bit
torch.manual_seed(0)
model = TinyNet()
opt = galore2.GaLoreAdamW(galore_groups(model, rank=4, update_proj_gap=3), lr=1e-2)
train(model, opt, range(4))
ck.save_checkpoint(root, 4, model, opt, extra={"step": torch.tensor(4)})
train(model, opt, range(4, 8))
real_save = ck.dcp.save

def dying_save(state, checkpoint_id):
    real_save(state, checkpoint_id=checkpoint_id)  # shards are on disk ...
    os.kill(os.getpid(), signal.SIGKILL)  # ... and the writer dies before the rename

ck.dcp.save = dying_save
ck.save_checkpoint(root, 8, model, opt, extra={"step": torch.tensor(8)})
"""


def _model_opt():
    torch.manual_seed(0)
    model = TinyNet()
    return model, galore2.GaLoreAdamW(galore_groups(model, rank=4, update_proj_gap=3), lr=1e-2)


def test_killed_writer_leaves_previous_checkpoint_loadable(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, str(tmp_path), str(torch.get_num_threads())],
        env=env,
        cwd=ROOT,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert (tmp_path / ".tmp-step-00000008").is_dir()  # the half-finished save is there...
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4]  # ... but never counted
    model, opt = _model_opt()
    extra = load_checkpoint(tmp_path, model, opt, extra={"step": torch.tensor(0)})
    assert int(extra["step"]) == 4
    # It is the real step-4 state: continuing equals an uninterrupted run.
    ref_model, ref_opt = _model_opt()
    train(ref_model, ref_opt, range(4))
    train(ref_model, ref_opt, range(4, 7))
    train(model, opt, range(4, 7))
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)
    # A later save cleans the stale temporary folder and lands.
    save_checkpoint(tmp_path, 7, model, opt)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 7]


def test_keeps_last_k(tmp_path):
    model, opt = _model_opt()
    for step in range(1, 6):
        train(model, opt, range(step - 1, step))
        save_checkpoint(tmp_path, step, model, opt, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path, 6, model, opt, keep=0)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path, model, opt, step=1)
    with pytest.raises(FileNotFoundError, match="missing: it does not exist"):
        load_checkpoint(tmp_path / "missing", model, opt)


def test_dcp_init_step_creates_every_key_at_final_shape():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    trained, trained_opt = _model_opt()
    train(trained, trained_opt, range(5))
    fresh, fresh_opt = _model_opt()
    before = [p.detach().clone() for p in fresh.parameters()]
    sd = get_optimizer_state_dict(fresh, fresh_opt)  # runs DCP's zero-gradient step
    for p, q in zip(fresh.parameters(), trained.parameters(), strict=True):
        a, b = fresh_opt.state[p], trained_opt.state[q]
        assert a.keys() == b.keys()
        assert all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)
    assert all(torch.equal(p, b) for p, b in zip(fresh.parameters(), before, strict=True))
    assert sd["state"]


def test_default_load_is_the_newest_complete_checkpoint(tmp_path):
    """Several complete checkpoints: load_checkpoint without ``step`` restores the newest —
    its extra, weights and optimizer state — not the oldest nor the last touched."""
    model, opt = _model_opt()
    snapshots = {}
    for step in (2, 4, 6):
        train(model, opt, range(step, step + 1))
        save_checkpoint(tmp_path, step, model, opt, extra={"step": torch.tensor(step)})
        snapshots[step] = [p.detach().clone() for p in model.parameters()]
    os.utime(tmp_path / "step-00000002")  # the newest is the largest step, not the latest mtime
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 4, 6]
    fresh, fresh_opt = _model_opt()
    extra = load_checkpoint(tmp_path, fresh, fresh_opt, extra={"step": torch.tensor(0)})
    assert int(extra["step"]) == 6
    for p, q in zip(fresh.parameters(), snapshots[6], strict=True):
        assert torch.equal(p, q)
    assert int(fresh_opt.state[fresh.up.weight]["galore.refreshes"]) == 1  # two steps, T = 3
