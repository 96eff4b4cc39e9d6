"""On a CUDA device: the batched path (the default there) equals the per-tensor path to
rounding, and a step synchronizes the host with the device at most once, as
``torch.cuda.set_sync_debug_mode`` reports every synchronization torch performs."""

from __future__ import annotations

import warnings

import pytest
import torch

import galore2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PRESETS = ["GaLoreAdamW", "GaLoreAdamW8bit", "GaLoreAdafactor", "Fira", "APOLLO", "GaLoreMuon",
           "GaLoreRanger21"]  # fmt: skip


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.Linear(512, 256), torch.nn.Linear(256, 256),
        torch.nn.LayerNorm(256),
    ).cuda()  # fmt: skip


def _run(name: str, steps: int, **kw) -> tuple[list[torch.Tensor], list[int]]:
    model = _model()
    groups = galore2.param_groups(model, rank=32, update_proj_gap=3)
    if name == "GaLoreRanger21":
        kw["num_iterations"] = 100
    opt = getattr(galore2, name)(groups, **kw)
    gen = torch.Generator(device="cuda").manual_seed(1)
    syncs = []
    for step in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen, device="cuda") * 1e-2
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        if step % 3 != 0:  # non-refresh steps
            syncs.append(sum("synchroniz" in str(w.message) for w in caught))
    return [p.detach().clone() for p in model.parameters()], syncs


@pytest.mark.parametrize("name", PRESETS)
def test_batched_matches_per_tensor_and_syncs_once(name):
    batched, syncs = _run(name, 7)
    single, _ = _run(name, 7, foreach=False)
    assert max((a - b).abs().max().item() for a, b in zip(batched, single, strict=True)) < 1e-5
    assert syncs and max(syncs) <= 1, syncs
