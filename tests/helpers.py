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


# --- float32 comparisons between two kernel paths --------------------------------------------
#: float32's machine epsilon (2⁻²³ ≈ 1.19e-7): the spacing of float32 values in [1, 2)
F32_EPS = torch.finfo(torch.float32).eps


def f32_bound(expected: torch.Tensor, steps: int, ulps: float = 2.0) -> float:
    """The largest |difference| allowed between two float32 computations of ``expected`` that
    do the same arithmetic in a different order: batched vs per-tensor, foreach vs loop,
    stacked vs unstacked, sharded vs one process — or the same code on another CPU (AVX2 vs
    AVX-512 vector kernels, another BLAS kernel, another thread count split the reductions
    differently).

    Why this bound: a reordered reduction or a fused vs unfused kernel changes each rounded
    result by a few units in the last place of the values it combines, and the largest value
    of a tensor sets that scale for every element computed with it (small elements inherit
    the absolute error of the large ones they are computed from, so the bound is relative to
    ``max |expected|``, not element-wise). Dependent steps (optimizer steps, iterations) add
    their differences: per step the update's own rounding and the rounding of the value it
    is added to, ``ulps`` (2) units of ``F32_EPS · max |expected|``. So the bound is
    ``ulps · steps · F32_EPS · max |expected|`` — about 1.3e-5 for 12 steps on weights of
    magnitude 4.5, where a wrong coefficient moves them by ≥ 1e-3. Observed there (the
    batched rules of ``tools.batch_reference``): 2.4e-7 to 1.9e-6 on an AVX2 CPU (with ATen's
    AVX2 and scalar kernels, MKL's default and compatible paths, 1 and 2 threads) and on an
    AVX-512 CPU (issue 39).
    """
    return ulps * steps * F32_EPS * float(expected.detach().abs().max())


def assert_f32_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    steps: int,
    ulps: float = 2.0,
    flips: float | None = None,
    extra: float = 0.0,
    what: str = "",
) -> None:
    """``actual`` within :func:`f32_bound` of ``expected`` (same shape and dtype), plus
    ``extra``: a term the caller derives for rounding the bound above leaves out (e.g. the
    reordered sums inside each step's update, relative to the update's size, not the
    result's).

    ``flips``: for results that pass through a quantizer (8-bit moments), a float32
    difference of one ulp may move a value across a code boundary, a discrete change
    (one code gap of the block's absmax) that later steps carry on. Then at most 1% of the
    elements may exceed the float32 bound, and each by at most ``flips`` (the caller derives
    it: ``lr · steps ·`` the map's largest code gap). A wrong rule moves every element."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    bound = f32_bound(expected, steps, ulps) + extra
    diff = (actual.detach() - expected.detach()).abs()
    worst = float(diff.max())
    if flips is None or worst <= bound:
        assert worst <= bound, f"{what}: max |Δ| {worst:.2e} > {bound:.2e} (float32 bound)"
        return
    over = int((diff > bound).sum())
    assert over <= 0.01 * diff.numel() and worst <= flips, (
        f"{what}: {over} of {diff.numel()} elements beyond the float32 bound {bound:.2e}, "
        f"max |Δ| {worst:.2e} (quantizer flips allow ≤ 1% within {flips:.2e})"
    )


def quantizer_flip_bound(lr: float, steps: int) -> float:
    """``flips`` for :func:`assert_f32_close` on weights trained ``steps`` steps at ``lr`` with
    8-bit dynamic moments: a code flipped by one float32 ulp moves a moment by at most the
    dynamic map's largest code gap (1.4% of its block's absmax, signed map), which changes a
    normalised update by about that fraction of lr, for every later step at most."""
    from galore2.storage.dynamic8 import dynamic_code

    gap = max(float(dynamic_code(s, torch.device("cpu")).sort().values.diff().max())
              for s in (True, False))  # fmt: skip
    return lr * steps * gap
