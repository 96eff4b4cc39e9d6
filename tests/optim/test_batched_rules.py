"""Every update rule's batched path (``foreach=True``: Fira's residual, APOLLO's scaling and
the norm-growth limiter, Muon's stacked Newton–Schulz and polar factor, Adafactor's factored
statistics, 8-bit moments concatenated per block layout) gives the per-tensor path's weights
(``foreach=False``) over 12 steps with three refreshes, on matrices of both orientations with
same-shape repeats (``tools.batch_reference``'s configs): within float32's rounding of the
reordered arithmetic (``tests.helpers.f32_bound``: 2 ulps of the weights' magnitude per
step, ≈ 1.3e-5 here, where every rule moves the weights by > 1e-2), with 8-bit moments' rare
one-code flips allowed for ≤ 1% of the elements (``quantizer_flip_bound``)."""

from __future__ import annotations

import pytest
import torch

from galore2.optim.muon import NS_COEFFICIENTS, newton_schulz, polar
from tests.helpers import assert_f32_close, quantizer_flip_bound
from tools.batch_reference import COMMON, CONFIGS, STEPS, params, run

# the default run: one config per batched rule; the variants under -m slow
FAST = ("fira", "fira_reference", "apollo", "apollo_mini", "galore_muon", "galore_muon_polar",
        "galore_adamw8bit", "galore_adafactor_8bit", "galore_adafactor_beta1",
        "galore_adafactor_relative")  # fmt: skip
CASES = [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in sorted(CONFIGS)]


@pytest.fixture
def one_thread():
    """Both paths on one thread: tiny matrices, and no OpenMP spinning on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", CASES)
def test_batched_path_equals_per_tensor_path(name, one_thread):
    looped = run(CONFIGS[name], foreach=False)
    batched = run(CONFIGS[name], foreach=True)
    start = params()
    assert max(float((a - p).abs().max()) for a, p in zip(looped, start, strict=True)) > 1e-2
    flips = quantizer_flip_bound(COMMON["lr"], STEPS) if "8bit" in name else None
    for k, (b, l_) in enumerate(zip(batched, looped, strict=True)):
        assert_f32_close(b, l_, steps=STEPS, flips=flips, what=f"{name} parameter {k}")


@pytest.mark.parametrize("fn", [newton_schulz, polar], ids=["newton_schulz", "polar"])
def test_orthogonalization_of_a_stack_is_each_matrix_s(fn):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(3, 4, 9, generator=g)
    if fn is polar:
        X[1, 3] = X[1, 0]  # rank deficient: a zero singular value gives zero
    stacked = fn(X)
    # Newton–Schulz: five float32 iterations (bmm and mm round differently), each a polynomial
    # whose coefficients amplify the last iteration's rounding by Σ|c| ≈ 10.3 (measured: 4 to
    # 11 ulps of the result's magnitude in all); polar: float64, rounded once to float32
    if fn is newton_schulz:
        steps, ulps = 5, sum(abs(c) for c in NS_COEFFICIENTS)
    else:
        steps, ulps = 1, 2.0
    for k in range(3):
        assert_f32_close(stacked[k], fn(X[k]), steps=steps, ulps=ulps, what=f"matrix {k}")


#: the grouped ops a rule's batches take along the data: (module attribute, op) pairs
ALONG_OPS = {
    "apollo": (("galore2.optim.residual", "channel_norms_each"),
               ("galore2.core.apply", "scaled_add_each_")),
    "fira": (("galore2.optim.residual", "residual_norms_each"),
             ("galore2.core.apply", "addmm_scaled_each_")),
}  # fmt: skip


#: every Fira / APOLLO config; the default run takes the five above the line
ALONG_CASES = ["apollo", "apollo_tensor_limit", "apollo_mini", "fira", "fira_reference"] + [
    pytest.param(n, marks=pytest.mark.slow)
    for n in ("fira_scale", "fira_nolimit", "galore_adamw8bit_fira")
]


@pytest.mark.parametrize("name", ALONG_CASES)
def test_along_the_data_equals_per_tensor_path(name, one_thread, monkeypatch):
    """APOLLO and Fira along the data (every shape batch: ``MIN_ALONG_DATA_ELEMENTS`` 0; on
    a GPU, wherever the grouped kernels run): the gradients are never stacked and no m×n
    tensor is made — their channel norms (APOLLO) or their residuals' (Fira: G − P·R, never
    made) and their update into the weights (G ⊙ φ; Fira's with P·X in the same pass) go
    through galore2's grouped ops, once per shape batch and step — and the weights are the
    per-tensor path's, within float32's rounding of the reordered arithmetic, per channel
    and per matrix, limiter on."""
    import importlib

    from galore2.optim import lowrank_batch

    calls: dict[str, int] = {}
    for module, op in ALONG_OPS["apollo" if name.startswith("apollo") else "fira"]:
        mod = importlib.import_module(module)
        fn = getattr(mod, op)

        def call(*args, _fn=fn, _op=op):
            calls[_op] = calls.get(_op, 0) + 1
            return _fn(*args)

        monkeypatch.setattr(mod, op, call)
    monkeypatch.setattr(lowrank_batch, "MIN_ALONG_DATA_ELEMENTS", 0)
    along = run(CONFIGS[name], foreach=True)
    # the non-refresh steps' shape batches took the grouped ops (a refresh steps alone);
    # without a limiter no channel norms are taken
    norms, update = (op for _, op in ALONG_OPS["apollo" if name.startswith("apollo") else "fira"])
    assert calls.get(update, 0) > 0 and (calls.get(norms, 0) > 0) == ("nolimit" not in name), calls
    monkeypatch.undo()
    looped = run(CONFIGS[name], foreach=False)
    start = params()
    assert max(float((a - p).abs().max()) for a, p in zip(looped, start, strict=True)) > 1e-2
    flips = quantizer_flip_bound(COMMON["lr"], STEPS) if "8bit" in name else None
    for k, (b, l_) in enumerate(zip(along, looped, strict=True)):
        assert_f32_close(b, l_, steps=STEPS, flips=flips, what=f"{name} parameter {k}")


@pytest.mark.parametrize("name", ["fira", "fira_reference", "apollo"])
def test_norms_taken_with_the_projection(name, one_thread, monkeypatch):
    """Where one grouped launch takes the projection with the channel norms the limiter
    and φ need (a GPU's ``galore2::project_norms_each``; here its torch path, the grouped
    kernels said to run): Fira's residuals' (APOLLO's gradients') and R's norms come from
    that launch — ``residual_norms_each`` / ``channel_norms_each`` are never called — and
    the weights are the per-tensor path's within float32's rounding of the reordered
    arithmetic, limiter on."""
    from galore2.kernels import ops_lowrank
    from galore2.optim import lowrank_batch, projection, residual

    calls = {"project_norms_each": 0, "residual_norms_each": 0, "channel_norms_each": 0}

    def counted(module, op):
        fn = getattr(module, op)

        def call(*args):
            calls[op] += 1
            return fn(*args)

        monkeypatch.setattr(module, op, call)

    counted(projection, "project_norms_each")
    counted(residual, "residual_norms_each")
    counted(residual, "channel_norms_each")
    monkeypatch.setattr(lowrank_batch, "MIN_ALONG_DATA_ELEMENTS", 0)
    # the grouped kernels "run" (their ops take their torch paths on the CPU)
    monkeypatch.setattr(lowrank_batch, "grouped_would_run", lambda t, name="": True)
    monkeypatch.setattr(ops_lowrank, "grouped_would_run", lambda t, name="": True)
    fused = run(CONFIGS[name], foreach=True)
    others = calls["residual_norms_each"] + calls["channel_norms_each"]
    assert calls["project_norms_each"] > 0 and others == 0, calls
    monkeypatch.undo()
    looped = run(CONFIGS[name], foreach=False)
    for k, (b, l_) in enumerate(zip(fused, looped, strict=True)):
        assert_f32_close(b, l_, steps=STEPS, what=f"{name} parameter {k}")
