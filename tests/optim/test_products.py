"""Float32 matmuls outside galore2's kernels in a step of 16-bit tensors
(:mod:`galore2.optim.products`): TF32 where galore2's ops run, torch's setting elsewhere.

Without a GPU, "where the ops run" is the CPU with ``FUSED_OP_DEVICES`` extended to it: TF32
then changes nothing numerically (the flag governs CUDA only), so the flag is read inside
each product, and the CPU's weights must be those of a step without the context."""

from __future__ import annotations

import pytest
import torch

import galore2
from galore2.kernels import ops
from galore2.optim import muon


def _spy(monkeypatch, preset: str, seen: list[bool]) -> None:
    """Record torch's TF32 flag inside each of the rule's float32 products: Fira's
    ``addmm`` / ``baddbmm`` (its residual and its update), Muon's Newton–Schulz."""

    def recording(real):
        def spy(*a, **k):
            seen.append(torch.backends.cuda.matmul.allow_tf32)
            return real(*a, **k)

        return spy

    if preset == "Fira":
        monkeypatch.setattr(torch, "addmm", recording(torch.addmm))
        monkeypatch.setattr(torch, "baddbmm", recording(torch.baddbmm))
        monkeypatch.setattr(torch.Tensor, "baddbmm_", recording(torch.Tensor.baddbmm_))
    else:
        monkeypatch.setattr(muon, "newton_schulz", recording(muon.newton_schulz))


def _run(preset: str, path: str, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shapes = [(24, 40), (24, 40), (40, 24)] if path == "stacked" else [(24, 40)]
    ws = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]
    opt = getattr(galore2, preset)([{"params": ws, "rank": 4, "update_proj_gap": 2}],
                                   lr=1e-2, foreach=path == "stacked")  # fmt: skip
    for _ in range(3):
        for w in ws:
            w.grad = torch.randn(w.shape, generator=g).to(dtype)
        opt.step()
    return [w.detach().clone() for w in ws]


@pytest.mark.parametrize("path", ["per_matrix", "stacked"])
@pytest.mark.parametrize("preset", ["Fira", "GaLoreMuon"])
def test_float32_products_run_as_tf32_where_the_ops_run(preset, path, monkeypatch):
    """Fira's residual and update outside the along-data kernels (per matrix: refresh
    steps, sharded matrices; stacked: matrices too large to batch, Llama-7B's) and Muon's
    Newton–Schulz run with TF32 allowed where galore2's ops run and the directions are
    16-bit, the flag put back after; with float32 tensors, or on the CPU, torch's setting
    is left alone; and the CPU's weights are the same bits either way."""
    seen: list[bool] = []
    _spy(monkeypatch, preset, seen)
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        plain = _run(preset, path, torch.bfloat16)
        assert seen and not any(seen)  # the CPU: torch's setting
        seen.clear()
        monkeypatch.setattr(ops, "FUSED_OP_DEVICES", ("cpu", "cuda", "meta"))
        fast = _run(preset, path, torch.bfloat16)
        assert seen and all(seen), seen  # TF32 inside every one of the rule's products
        assert torch.backends.cuda.matmul.allow_tf32 is False  # put back
        seen.clear()
        _run(preset, path, torch.float32)
        assert seen and not any(seen)  # float32 tensors: torch's setting
        assert all(torch.equal(a, b) for a, b in zip(fast, plain, strict=True))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
