"""Subprocess worker for test_checkpoint.py: train, checkpoint, resume in a fresh process.

``python -m tests.resume_worker full DIR``   trains every config for STOP steps, saves a
checkpoint (model + optimizer state_dict), keeps training to END and saves final params.
``python -m tests.resume_worker resume DIR`` (a new process) loads each checkpoint with
``torch.load(weights_only=True)``, trains STOP→END and saves its final params.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import galore2
from tests.helpers import TinyNet, galore_groups, train

GAP, STOP, END = 4, 6, 13  # refreshes at 0, 4, 8, 12: the resumed part crosses two

CONFIGS = {
    "svd": {"projector": "svd"},
    "randomized": {"projector": "randomized"},
    "power": {"projector": "power"},
    "random": {"projector": "random"},
    "randomized-project": {"projector": "randomized", "moments_on_refresh": "project"},
    "power-reset": {"projector": "power", "moments_on_refresh": "reset"},
    "svd-full": {"projector": "svd", "proj_type": "full"},
    "randomized-bf16": {"projector": "randomized", "dtype": torch.bfloat16},
}


def build(name: str) -> tuple[torch.nn.Module, galore2.GaLoreAdamW]:
    settings = dict(CONFIGS[name])
    dtype = settings.pop("dtype", torch.float32)
    torch.manual_seed(0)
    model = TinyNet().to(dtype)
    opt = galore2.GaLoreAdamW(
        galore_groups(model, rank=5, update_proj_gap=GAP, **settings), lr=3e-3, weight_decay=0.05
    )
    return model, opt


def main(mode: str, out: Path) -> None:
    for name in CONFIGS:
        model, opt = build(name)
        if mode == "full":
            train(model, opt, range(STOP))
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, out / f"{name}.ckpt")
            train(model, opt, range(STOP, END))
            torch.save(model.state_dict(), out / f"{name}.uninterrupted")
        else:
            ckpt = torch.load(out / f"{name}.ckpt", weights_only=True)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
            train(model, opt, range(STOP, END))
            torch.save(model.state_dict(), out / f"{name}.resumed")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
