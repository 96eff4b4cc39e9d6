"""Workers for test_dcp.py: save with DCP at one world size, load at another, continue."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from galore2.checkpoint import load_checkpoint, save_checkpoint

from .fsdp_cases import BATCH, data, make_model, optimizer, shard

STOP, END = 10, 20  # refreshes at 0 and 8 before the save, 16 after it
SETTINGS = {"projector": "randomized", "moments_on_refresh": "project"}


def _build(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_model()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        shard(model, mesh)
    return model, optimizer(model, SETTINGS)


def _train(model, opt, steps: range, rank: int, world: int) -> None:
    per = BATCH // world
    for step in steps:
        x, y = data(step)
        opt.zero_grad()
        nn.functional.mse_loss(
            model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per]
        ).backward()
        opt.step()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }


def save_then_continue(rank: int, world: int, root: str) -> None:
    model, opt = _build(world)
    _train(model, opt, range(STOP), rank, world)
    for flatten in (True, False):
        save_checkpoint(
            Path(root) / f"flat{int(flatten)}",
            STOP,
            model,
            opt,
            flatten=flatten,
            extra={"step": torch.tensor(STOP)},
        )
    _train(model, opt, range(STOP, END), rank, world)
    full = _full(model)  # a collective: every rank takes part
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
        _train(model, opt, range(STOP, END), rank, world)
        for name, value in _full(model).items():
            diff = (value - expected[name]).abs().max().item()
            assert diff <= 1e-5, f"world {world}, flatten={flatten}: {name} differs by {diff:.2e}"
