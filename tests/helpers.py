"""Small models and deterministic data shared by the tests."""

from __future__ import annotations

import copy
import subprocess
import sys

import torch
from torch import nn


class TinyNet(nn.Module):
    """Matrices of every orientation: wide (m < n), tall (m > n), square; plus biases."""

    def __init__(self, d_in: int = 24, d_hidden: int = 40, d_out: int = 12) -> None:
        super().__init__()
        self.up = nn.Linear(d_in, d_hidden)  # weight 40×24: tall
        self.mid = nn.Linear(d_hidden, d_hidden)  # 40×40: square
        self.down = nn.Linear(d_hidden, d_out)  # 12×40: wide
        self.norm = nn.LayerNorm(d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(torch.tanh(self.mid(torch.tanh(self.up(x))))))


def batch(
    step: int, n: int = 32, d_in: int = 24, d_out: int = 12
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step)
        dtype = next(model.parameters()).dtype
        x, y = x.to(dtype), y.to(dtype)
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def galore_groups(model: TinyNet, **settings) -> list[dict]:
    mats = [model.up.weight, model.mid.weight, model.down.weight]
    ids = {id(p) for p in mats}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [{"params": mats, **settings}, {"params": rest}]


def capturable_twins(
    foreach: bool | None, **settings
) -> tuple[TinyNet, TinyNet, torch.optim.Optimizer, torch.optim.Optimizer]:
    """A seeded TinyNet and its copy, with GaLoreAdamW(capturable=True) on the first and the
    default GaLoreAdamW on the second (``foreach`` given only when not None)."""
    import galore2

    torch.manual_seed(0)
    model = TinyNet()
    twin = copy.deepcopy(model)
    settings |= {} if foreach is None else {"foreach": foreach}
    capt = galore2.GaLoreAdamW(galore_groups(model, **settings), capturable=True)
    other = galore2.GaLoreAdamW(galore_groups(twin, **settings))
    return model, twin, capt, other


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        (x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters(), strict=False)
    )


def run_python(code: str, timeout: float = 120) -> str:
    """Run ``code`` in a fresh interpreter (``python -c``); assert it exits 0; its stdout."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def saved_bytes(model: nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward of a causal
    LM on ``ids`` (labels = ids), parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    return sum(storages.values())


def step_on_weight_dependent_grads(opt: torch.optim.Optimizer, params, steps: int) -> None:
    """``steps`` optimizer steps; gradients are seeded noise + 0.5·p, so they depend on the
    weights and a wrong update changes every later gradient too."""
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) + 0.5 * p.detach()
        opt.step()
