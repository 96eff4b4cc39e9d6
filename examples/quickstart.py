"""Quickstart: replace torch.optim.AdamW with galore2.GaLoreAdamW in a plain PyTorch loop.

Trains the same small MLP language-model head on a fixed synthetic task with
AdamW (lr 1e-3) and with GaLoreAdamW (rank 32, α = 0.25 with a 10× larger lr, the
pairing the GaLore paper uses) and prints final loss and optimizer-state bytes of
each. No learning-rate sweep: see benchmarks/ for side-by-side comparisons. Runs on
CPU in seconds; needs only torch and galore2.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import galore2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 64)
    )


def run(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 300) -> float:
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(128, 64, generator=gen) / 128**0.5
    loss = torch.tensor(0.0)
    for _ in range(steps):
        x = torch.randn(256, 128, generator=gen)
        loss = nn.functional.mse_loss(model(x), torch.tanh(x @ teacher))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())


def main() -> None:
    base = make_model()
    adamw_model, galore_model = copy.deepcopy(base), copy.deepcopy(base)
    adamw = torch.optim.AdamW(adamw_model.parameters(), lr=1e-3)
    groups = galore2.param_groups(
        galore_model, "all-linear", rank=32, update_proj_gap=50, scale=0.25
    )
    galore = galore2.GaLoreAdamW(groups, lr=1e-2)
    loss_a, loss_g = run(adamw_model, adamw), run(galore_model, galore)
    bytes_a, bytes_g = state_bytes(adamw), galore.state_bytes()["total"]
    print(f"{'optimizer':<14}{'final loss':>12}{'state bytes':>14}")
    print(f"{'AdamW lr 1e-3':<14}{loss_a:>12.5f}{bytes_a:>14,}")
    print(f"{'GaLore lr 1e-2':<14}{loss_g:>12.5f}{bytes_g:>14,}")
    print(f"GaLore state is {bytes_g / bytes_a:.1%} of AdamW's; loss ratio {loss_g / loss_a:.3f}")


if __name__ == "__main__":
    main()
