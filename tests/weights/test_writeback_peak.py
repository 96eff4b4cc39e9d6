"""``optimizer.step()`` with int8 weights holds one fp32 working copy at a time: the peak of
the bytes it allocates does not grow with the number of weights, and the step's bits are
those of the step over every parameter at once (``galore2.core.stored.parts``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import galore2
from galore2.core import step as optimizer_module
from galore2.core import stored

SIDE = 64  # each weight SIDE × SIDE: its fp32 working copy is SIDE² · 4 bytes


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages ops allocate while it is active and the most alive
    at once (sampled after every op: deterministic, no timing). A storage an op received
    as input (a parameter, the state, an in-place result) is not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[StorageWeakRef, int] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        seen = {
            StorageWeakRef(t.untyped_storage())
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref not in seen and ref not in self.live:
                    self.live[ref] = t.untyped_storage().nbytes()
                    self.now += self.live[ref]
        self.peak = max(self.peak, self.now)
        for ref in [r for r in self.live if r.expired()]:
            self.now -= self.live.pop(ref)
        return out


def _model(layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(SIDE, SIDE, bias=False) for _ in range(layers)))
    galore2.quantize_weights(model, group_size=16)
    return model


PRESETS = {
    "adamw": (galore2.GaLoreAdamW, {}),
    "galore_adamw": (galore2.GaLoreAdamW, {"rank": 4}),
    "galore_adamw8bit": (galore2.GaLoreAdamW8bit, {"rank": 4}),
    "fira": (galore2.Fira, {"rank": 4}),
    "galore_muon": (galore2.GaLoreMuon, {"rank": 4}),
}


def _opt(model: nn.Module, name: str) -> torch.optim.Optimizer:
    cls, group = PRESETS[name]
    params = [p for p in model.parameters()]
    if "rank" in group:
        return cls([{"params": params, **group, "update_proj_gap": 50}], lr=1e-2)
    return cls(params, lr=1e-2)


def _grads(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def _peak(layers: int, name: str) -> int:
    """The most bytes alive at once inside the third step (state made, no refresh)."""
    model = _model(layers)
    opt = _opt(model, name)
    for step in range(2):
        _grads(model, step)
        opt.step()
    _grads(model, 2)
    with LiveBytes() as count:
        opt.step()
    return count.peak


def _whole(groups, items, weight_modules, distributed):
    """The step before parts: every working copy alive at once."""
    stored.parts(groups, items, weight_modules, distributed)  # its refusals
    return [items]


@pytest.mark.parametrize("name", ["adamw", "galore_adamw", "fira"])
def test_the_step_holds_one_working_copy_at_a_time(name, monkeypatch):
    one, six = _peak(1, name), _peak(6, name)
    assert one >= SIDE * SIDE * 4  # the counter sees the working copy
    assert six <= one, (six, one)
    monkeypatch.setattr(optimizer_module, "parts", _whole)
    assert _peak(6, name) >= 6 * SIDE * SIDE * 4  # all at once: what the test catches


@pytest.mark.parametrize("name", list(PRESETS))
def test_the_parts_give_the_bits_of_one_step(name, monkeypatch):
    def run() -> tuple[dict, dict]:
        model = _model(4)
        model.append(nn.LayerNorm(SIDE))  # a plain parameter too
        opt = _opt(model, name)
        for step in range(6):
            _grads(model, step)
            opt.step()
        return model.state_dict(), opt.state_dict()["state"]

    (model_a, state_a) = run()
    monkeypatch.setattr(optimizer_module, "parts", _whole)
    (model_b, state_b) = run()
    assert model_a.keys() == model_b.keys()
    for k in model_a:
        assert torch.equal(model_a[k], model_b[k]), k
    assert state_a.keys() == state_b.keys()
    for i in state_a:
        for k, v in state_a[i].items():
            w = state_b[i][k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (i, k)
