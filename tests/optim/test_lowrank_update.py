"""The batched GaLore step along the data (``foreach=True``, unmasked, matrices of at least
``lowrank_batch.MIN_ALONG_DATA_ELEMENTS``: 0 here): each gradient is
read by its projection where it is (no stack, no copy), the low-rank Adam moments are
stepped by torch's fused Adam kernel, and each update goes into its weight by one
``addmm_`` (decay as its β; a shape batch's by one grouped op) — no tensor of a weight's size is made, and a bf16 weight's
update rounds once, as the per-tensor path's does."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import galore2
from galore2.optim import lowrank_batch
from galore2.optim.adam_paths import adam_fused, adam_single

SHAPES = ((48, 32), (48, 32), (32, 80), (32, 80), (80, 32), (80, 32), (32, 32), (32, 32))
RANK = 2  # a shape batch's r-sized stacks (2 × 2 × 80) are smaller than any weight


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    # small matrices here: every batch along the data (lowrank_batch.along_data)
    monkeypatch.setattr(lowrank_batch, "MIN_ALONG_DATA_ELEMENTS", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class _Made(TorchDispatchMode):
    """Each op's name and the sizes of the tensors it made (outputs not among its inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
               if isinstance(t, torch.Tensor)}  # fmt: skip
        made = [t.numel() for t in tree_flatten(out)[0]
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ins]  # fmt: skip
        self.ops.append((func.overloadpacket.__name__, made))
        return out


def _weights(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _run(dtype: torch.dtype, foreach: bool, steps: int, count_last: bool = False):
    ws = _weights(dtype)
    opt = galore2.GaLoreAdamW(
        [{"params": ws, "rank": RANK, "update_proj_gap": 100}], lr=1e-2, weight_decay=0.1,
        foreach=foreach,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    made = _Made()
    for step in range(steps):
        for w in ws:
            w.grad = torch.randn(w.shape, generator=g).to(dtype)
        if count_last and step == steps - 1:
            with made:
                opt.step()
        else:
            opt.step()
    return ws, made


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_batched_step_makes_no_weight_sized_tensor(dtype):
    """A non-refresh batched step: one grouped projection and one grouped ``addmm_`` per
    shape batch (``galore2::mm_each_`` / ``addmm_each_``: one launch each where Triton runs,
    an ``mm`` / ``addmm_`` per weight inside elsewhere), and no op makes a tensor as large
    as the smallest weight (projections, moments and factors are r-sized)."""
    _, made = _run(dtype, foreach=True, steps=3, count_last=True)
    names = [n for n, _ in made.ops]
    batches = len(set(SHAPES))
    assert names.count("addmm_each_") == names.count("mm_each_") == batches, names
    assert "addmm_" not in names and "mm" not in names, names
    smallest = min(math.prod(s) for s in SHAPES)
    big = [(n, sizes) for n, sizes in made.ops if max(sizes, default=0) >= smallest]
    assert not big, big
    assert "_fused_adam_" in names


def test_bf16_weights_batched_equal_per_tensor():
    """bf16 weights: the batched step rounds each weight once (``addmm_`` with the decay as
    β), as the per-tensor path does: the same weights within one bf16 rounding of each
    (the directions differ by the fused kernel's fp32 rounding only)."""
    batched, _ = _run(torch.bfloat16, foreach=True, steps=6)
    looped, _ = _run(torch.bfloat16, foreach=False, steps=6)
    start = _weights(torch.bfloat16)
    moved = max(float((a.float() - s.float()).abs().max()) for a, s in zip(looped, start))
    assert moved > 1e-2
    for b, l_ in zip(batched, looped, strict=True):
        # one bf16 ulp of the weight's magnitude (2**-8 relative), where a last-bit
        # difference of the fp32 update may round the other way
        ulp = l_.detach().float().abs() * 2.0**-8 + 1e-30
        assert bool(((b.detach().float() - l_.detach().float()).abs() <= ulp).all())


def test_fp32_weights_batched_equal_per_tensor():
    """fp32 weights: the batched step equals the per-tensor one within the fused Adam
    kernel's rounding of the direction (a few fp32 ulps of lr·scale·|P·N|, over 6 steps)."""
    batched, _ = _run(torch.float32, foreach=True, steps=6)
    looped, _ = _run(torch.float32, foreach=False, steps=6)
    for b, l_ in zip(batched, looped, strict=True):
        torch.testing.assert_close(b, l_, rtol=0, atol=1e-6)


def test_fused_directions_are_adam_arithmetic():
    """torch's fused kernel on a zeroed buffer with lr = −1 gives ``adam_single``'s moments and
    direction within a few fp32 ulps (the kernel may fuse a multiply-add; the order of the
    bias corrections' roundings), step after step."""
    g = torch.Generator().manual_seed(0)
    group = {"betas": (0.9, 0.999), "eps": 1e-8}
    us = [torch.randn(3, 8, 16, generator=g), torch.randn(5, 7, generator=g)]
    ms = [torch.randn(u.shape, generator=g) * 0.1 for u in us]
    vs = [torch.rand(u.shape, generator=g) * 0.01 for u in us]
    m2, v2 = [m.clone() for m in ms], [v.clone() for v in vs]
    for t in (1, 7, 1000):
        got = adam_fused(us, ms, vs, t, *group["betas"], group["eps"])
        for u, m, v, m_ref, v_ref, d in zip(us, ms, vs, m2, v2, got, strict=True):
            want = adam_single(u, m_ref, v_ref, t, group)
            # a few ulps of each tensor's largest magnitude (a lerp may cancel)
            for a, b in ((m, m_ref), (v, v_ref), (d, want)):
                atol = 8 * torch.finfo(torch.float32).eps * float(b.abs().max())
                torch.testing.assert_close(a, b, rtol=0, atol=atol)
        m2, v2 = [m.clone() for m in ms], [v.clone() for v in vs]


@pytest.mark.parametrize("mode", ["torch", "triton"])
def test_bf16_directions_op_along_the_data(mode, monkeypatch):
    """Where galore2::adam_directions_ runs (CUDA with the kernels on; allowed on the CPU
    here), a bf16 weights' batch gets its low-rank directions in bf16 from it, one call per
    shape stack: by the op's torch path the weights are bitwise those of the fp32
    directions cast by GaLore (the same arithmetic); by its Triton kernel (Triton's
    interpreter) within one bf16 ulp of them (the moments' last-bit differences, see
    tests/kernels: a direction may round to a neighbouring bf16 value)."""
    from galore2.kernels import dispatch, ops
    from galore2.optim import adam

    if mode == "triton" and not dispatch.interpreter_enabled():
        pytest.skip("the kernel runs on CPU tensors under Triton's interpreter only")
    monkeypatch.setenv(dispatch.ENV_VAR, mode)  # both runs (Triton: the lowrank kernel too)
    reference, _ = _run(torch.bfloat16, foreach=True, steps=4)
    monkeypatch.setattr(adam, "rounded_path", lambda us, states, rnd: rnd is torch.bfloat16)
    ws, made = _run(torch.bfloat16, foreach=True, steps=4, count_last=True)
    names = [n for n, _ in made.ops]
    assert names.count("adam_directions_") == len(set(SHAPES)), names  # a call per shape
    assert "_fused_adam_" not in names
    for w, r in zip(ws, reference, strict=True):
        if mode == "torch":
            assert torch.equal(w, r)
        else:
            assert ((w.float() - r.float()).abs() <= 2**-7 * r.float().abs()).all()
    assert ops.adam_directions_ is not None


def test_bases_cast_straight_from_the_state(monkeypatch):
    """Bases stacks not kept between steps (here: none is, MAX_CACHED_BYTES 0): along the
    data the fp32 bases are copied straight into one bf16 stack (one ``_foreach_copy_``, no
    fp32 stack, no second cast for the back-projection), the same values as the stack cast
    to bf16: the weights are bitwise those of that path."""
    monkeypatch.setattr(lowrank_batch, "MAX_CACHED_BYTES", 0)
    ws, made = _run(torch.bfloat16, foreach=True, steps=4, count_last=True)
    names = [n for n, _ in made.ops]
    assert names.count("_foreach_copy_") == len(set(SHAPES)), names
    monkeypatch.setattr(lowrank_batch.ShapeBatch, "_cast_each", lambda self, *a: None)
    reference, old = _run(torch.bfloat16, foreach=True, steps=4, count_last=True)
    assert "_foreach_copy_" not in [n for n, _ in old.ops]
    assert all(torch.equal(w, r) for w, r in zip(ws, reference, strict=True))
