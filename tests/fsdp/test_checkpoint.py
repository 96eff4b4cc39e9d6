"""Optimizer state is tensors only, loads with weights_only=True, and resumes bit-identically."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import galore2

from ..helpers import TinyNet, galore_groups, train
from . import resume_worker

ROOT = Path(__file__).resolve().parents[2]


def _run(mode: str, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, "-m", "tests.fsdp.resume_worker", mode, str(out)],
        check=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )


def test_resume_in_fresh_process_is_bit_identical(tmp_path):
    _run("full", tmp_path)
    _run("resume", tmp_path)
    for name in resume_worker.CONFIGS:
        a = torch.load(tmp_path / f"{name}.uninterrupted", weights_only=True)
        b = torch.load(tmp_path / f"{name}.resumed", weights_only=True)
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}: {key} differs after resume"


def test_state_dict_holds_tensors_only_and_loads_weights_only(tmp_path):
    model = TinyNet()
    opt = galore2.GaLoreAdamW(galore_groups(model, rank=4, update_proj_gap=2), lr=1e-3)
    train(model, opt, range(3))
    sd = opt.state_dict()
    for per_param in sd["state"].values():
        assert all(isinstance(v, torch.Tensor) for v in per_param.values())
    torch.save(sd, tmp_path / "opt.pt")
    loaded = torch.load(tmp_path / "opt.pt", weights_only=True)
    opt.load_state_dict(loaded)


def test_load_state_dict_keeps_saved_dtypes_and_copies():
    model = TinyNet().to(torch.bfloat16)
    opt = galore2.GaLoreAdamW(galore_groups(model, rank=4, update_proj_gap=2), lr=1e-3)
    train(model, opt, range(3))
    sd = opt.state_dict()
    model2 = TinyNet().to(torch.bfloat16)
    opt2 = galore2.GaLoreAdamW(galore_groups(model2, rank=4, update_proj_gap=2), lr=1e-3)
    opt2.load_state_dict(sd)
    for p1, p2 in zip(model.parameters(), model2.parameters(), strict=False):
        s1, s2 = opt.state[p1], opt2.state[p2]
        assert s1.keys() == s2.keys()
        for key in s1:
            assert s2[key].dtype == s1[key].dtype, key  # fp32 moments, int64 counters
            assert torch.equal(s2[key], s1[key])
            assert s2[key].data_ptr() != s1[key].data_ptr()  # no aliasing with the source
    assert opt2.state[model2.up.weight]["adam.exp_avg"].dtype == torch.float32
