"""The grouped matmuls (``galore2.kernels.lowrank_list``) and their ops
(``galore2::mm_each_`` / ``addmm_each_``): one launch for a shape batch, each entry the
bits of the single-matrix kernel (the same tile function), within float32 / bf16 rounding
of float64 math, and GaLore's step along the data on them.

Without a GPU the kernels run on CPU tensors under Triton's interpreter (tests/conftest.py
sets ``TRITON_INTERPRET=1``); on a CUDA machine on the GPU.
"""

from __future__ import annotations

import math
import sys
import warnings

import pytest
import torch

if sys.platform != "linux":  # triton ships Linux wheels only
    pytest.skip("triton is only installed on Linux", allow_module_level=True)

import galore2
from galore2.kernels import dispatch, ops_lowrank, tables
from galore2.kernels import lowrank_list as L
from galore2.kernels.lowrank import lowrank_update
from galore2.optim import lowrank_batch

from .test_triton_kernels import DEVICE, _lowrank_tolerance, _Spy

# (M, N, K): partial tiles, several tiles with a K remainder, one row, rank 1
SHAPES = [(67, 45, 13), (130, 150, 40), (1, 70, 3), (33, 70, 1)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _entries(M: int, N: int, K: int, dtype: torch.dtype, k: int, seed: int):
    """k weights (separate tensors), their factors A as views of one stack transposed (a
    left basis stack's Pᵀ: strided) and B as separate tensors (gradients)."""
    g = _gen(seed)
    ps = [torch.randn(M, N, generator=g).to(DEVICE, dtype) for _ in range(k)]
    stack = torch.randn(k, K, M, generator=g).to(DEVICE, dtype)
    As = list(stack.mT.unbind(0))
    Bs = [torch.randn(K, N, generator=g).to(DEVICE, dtype) for _ in range(k)]
    return ps, As, Bs


@pytest.fixture
def triton_mode(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    tables.clear()


@pytest.fixture
def launches(monkeypatch) -> list:
    seen: list = []
    monkeypatch.setattr(L, "_lowrank_list_kernel", _Spy(L._lowrank_list_kernel, seen))
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_each_entry_is_the_single_matrix_kernel(M, N, K, dtype, triton_mode, launches):
    """In place with a decay (the back-projection), and out of place with β = 0 into
    NaN-poisoned outputs (the projection: p not read): every entry bitwise what
    ``lowrank_update`` gives it alone, and within rounding of the float64 product."""
    ps, As, Bs = _entries(M, N, K, dtype, 3, M * 100 + N + K)
    alpha, beta = -0.3, 0.97
    alone = [p.clone() for p in ps]
    for p, a, b in zip(alone, As, Bs, strict=True):
        lowrank_update(p, a, b, alpha=alpha, beta=beta)
    operands = list(zip(ps, As, Bs, strict=True))
    refs = [p.double() * beta + alpha * (a.double() @ b.double()) for p, a, b in operands]
    tols = [_lowrank_tolerance(p, a, b, alpha, beta, dtype) for p, a, b in operands]
    grouped = [p.clone() for p in ps]
    ops_lowrank.addmm_each_(grouped, As, Bs, alpha, beta)
    assert len(launches) == 1
    for got, one, ref, tol in zip(grouped, alone, refs, tols, strict=True):
        assert torch.equal(got, one)
        assert bool(((got.double() - ref).abs() <= tol).all())

    outs = [torch.full((M, N), math.nan, dtype=dtype, device=DEVICE) for _ in ps]
    ops_lowrank.mm_each_(As, Bs, outs)
    assert len(launches) == 2
    for out, a, b in zip(outs, As, Bs, strict=True):
        one = torch.full_like(out, math.nan)
        lowrank_update(one, a, b, alpha=1.0, beta=0.0)
        assert torch.equal(out, one)
        tol = _lowrank_tolerance(torch.zeros_like(out), a, b, 1.0, 0.0, dtype)
        assert bool(((out.double() - a.double() @ b.double()).abs() <= tol).all())


@pytest.mark.parametrize("side", ["A", "B"])
def test_a_float32_operand_is_rounded_as_it_is_read(side, triton_mode, launches):
    """A float32 operand of a bf16 product (a stored fp32 basis against bf16 gradients or
    weights) is rounded to bf16 by the kernel as it loads its tiles: bitwise the result of
    casting it first (round to nearest, ties to even, as torch's cast), in one launch and
    no cast launched; the torch path casts it and gives the same within a bf16 rounding."""
    ps, As, Bs = _entries(67, 45, 13, torch.bfloat16, 3, 21)
    g = _gen(22)
    if side == "A":  # fp32 values with bits below bf16's, ties included
        As = [torch.randn(a.shape, generator=g).to(DEVICE) for a in As]
        As[0][0, :4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-9])
    else:
        Bs = [torch.randn(b.shape, generator=g).to(DEVICE) for b in Bs]
    cast = [a.to(torch.bfloat16) for a in As], [b.to(torch.bfloat16) for b in Bs]
    mixed = [p.clone() for p in ps]
    ops_lowrank.addmm_each_(mixed, As, Bs, -0.3, 0.97)
    rounded = [p.clone() for p in ps]
    ops_lowrank.addmm_each_(rounded, *cast, -0.3, 0.97)
    assert len(launches) == 2
    assert all(torch.equal(x, y) for x, y in zip(mixed, rounded, strict=True))
    outs = [torch.full((67, 45), math.nan, dtype=torch.bfloat16, device=DEVICE) for _ in ps]
    ops_lowrank.mm_each_(As, Bs, outs)
    ref = [torch.empty_like(o) for o in outs]
    ops_lowrank.mm_each_(*cast, ref)
    assert all(torch.equal(x, y) for x, y in zip(outs, ref, strict=True))


def test_operands_the_ops_do_not_take_are_named(monkeypatch):
    """Only the output's dtype, or float32 for a bf16 output: a float32 operand of a fp16
    product is an error naming the dtypes (the op's check, on meta tensors as anywhere)."""
    assert ops_lowrank.operand_dtypes(torch.bfloat16, torch.float32, torch.bfloat16)
    assert ops_lowrank.operand_dtypes(torch.float16, torch.float32, torch.float16) is None
    a = torch.empty(4, 3, device="meta")
    b = torch.empty(3, 5, dtype=torch.float16, device="meta")
    o = torch.empty(4, 5, dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match=r"mm_each_: operands of torch.float32 and "
                       r"torch.float16 for an output in torch.float16"):  # fmt: skip
        ops_lowrank.mm_each_([a, a], [b, b], [o, o])


def test_a_moved_list_gets_a_new_table(triton_mode, launches):
    """The table of offsets is kept for tensors at the same addresses and made again when
    one moved (new gradients elsewhere): each result is still its own entry's."""
    ps, As, Bs = _entries(40, 30, 5, torch.float32, 3, 7)
    outs = [torch.empty(40, 30, device=DEVICE) for _ in ps]
    ops_lowrank.mm_each_(As, Bs, outs)
    ops_lowrank.mm_each_(As, Bs, outs)
    assert len(tables._TABLES) == 1
    # the others elsewhere with other values, the first where it was (a stale table would
    # then read the old, still alive, tensors: wrong values, not freed memory)
    moved = [Bs[0], *(b.clone() * (i + 2) for i, b in enumerate(Bs[1:]))]
    ops_lowrank.mm_each_(As, moved, outs)
    assert len(tables._TABLES) == 2 and len(launches) == 3
    for out, a, b in zip(outs, As, moved, strict=True):
        tol = _lowrank_tolerance(torch.zeros_like(out), a, b, 1.0, 0.0, torch.float32)
        assert bool(((out.double() - a.double() @ b.double()).abs() <= tol).all())


def test_a_new_stack_laid_out_alike_reuses_the_table(triton_mode, launches):
    """Each step's outputs are views of a stack allocated anew (R, N): the table holds the
    entries' offsets from the first, so a new stack at the same strides reuses it — no new
    table, no upload — and each result is still its own entry's."""
    ps, As, Bs = _entries(40, 30, 5, torch.float32, 3, 9)
    alive = []  # the earlier stacks kept: each new one lies elsewhere
    for step in range(3):
        stack = torch.full((3, 40, 30), float("nan"), device=DEVICE)
        alive.append(stack)
        outs = list(stack.unbind(0))
        ops_lowrank.mm_each_(As, Bs, outs)
        assert len(tables._TABLES) == 1, step
        for out, a, b in zip(outs, As, Bs, strict=True):
            tol = _lowrank_tolerance(torch.zeros_like(out), a, b, 1.0, 0.0, torch.float32)
            assert bool(((out.double() - a.double() @ b.double()).abs() <= tol).all())
    assert len(launches) == 3 and len({s.data_ptr() for s in alive}) == 3


def test_lists_it_does_not_take_run_the_torch_path(triton_mode, launches):
    """Mixed shapes, strides or dtypes, one entry, an empty rank: no grouped launch (the op
    takes an ``mm`` per entry); the kernel itself refuses them before writing anything."""
    ps, As, Bs = _entries(20, 12, 4, torch.float32, 2, 3)
    mixed = [
        (ps, As, [Bs[0], Bs[1].T.contiguous().T]),  # the same shape, other strides
        (ps, As, [Bs[0], Bs[1].double()]),
        (ps[:1], As[:1], Bs[:1]),
        ([p.clone() for p in ps], [a[:, :0] for a in As], [b[:0] for b in Bs]),
    ]
    for outs, a, b in mixed:
        assert not L.supported_list(outs, outs, a, b)
        before = [o.clone() for o in outs]
        with pytest.raises(ValueError, match="lowrank_list takes lists of one length"):
            L.lowrank_list(outs, outs, a, b, alpha=1.0, beta=0.0)
        assert all(torch.equal(o, x) for o, x in zip(outs, before, strict=True))
    outs = [torch.empty(20, 12, device=DEVICE) for _ in ps]
    ops_lowrank.mm_each_(As, [Bs[0], Bs[1].T.contiguous().T], outs)
    assert not launches
    for out, a, b in zip(outs, As, Bs, strict=True):
        assert torch.allclose(out, a @ b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"mm_each_: \(3, 3\) is not the product"):
        ops_lowrank.mm_each_op(As, Bs, [torch.empty(3, 3, device="meta")] * 2)


def test_the_torch_path_is_an_mm_and_an_addmm_per_entry(monkeypatch):
    """``GALORE2_KERNELS=torch``: the ops are exactly torch's per-entry products (a float32
    operand of a bf16 product cast first)."""
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    ps, As, Bs = _entries(24, 16, 5, torch.float32, 3, 11)
    ps, As, Bs = ([t.cpu() for t in ts] for ts in (ps, As, Bs))
    grouped = [p.clone() for p in ps]
    ops_lowrank.addmm_each_(grouped, As, Bs, -0.5, 0.9)
    outs = [torch.empty(24, 16) for _ in ps]
    ops_lowrank.mm_each_(As, Bs, outs)
    for p, a, b, got, out in zip(ps, As, Bs, grouped, outs, strict=True):
        assert torch.equal(got, p.clone().addmm_(a, b, beta=0.9, alpha=-0.5))
        assert torch.equal(out, torch.mm(a, b))
    # a float32 basis against bf16 factors: rounded to bf16 first, as the kernel does
    half = [t.to(torch.bfloat16) for t in ps]
    mixed = [t.clone() for t in half]
    ops_lowrank.addmm_each_(mixed, As, [b.to(torch.bfloat16) for b in Bs], -0.5, 0.9)
    for p, a, b, got in zip(half, As, Bs, mixed, strict=True):
        a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
        assert torch.equal(got, p.clone().addmm_(a16, b16, beta=0.9, alpha=-0.5))


# ---- GaLore's step on the grouped kernels ---------------------------------------------------
LAYERS = ((40, 24), (40, 24), (24, 56), (24, 56), (24, 56))  # a left and a right batch


def _galore_run(dtype: torch.dtype, steps: int, monkeypatch, mode: str):
    monkeypatch.setenv(dispatch.ENV_VAR, mode)
    g = _gen(5)
    ws = [torch.nn.Parameter(torch.randn(s, generator=g).to(DEVICE, dtype)) for s in LAYERS]
    opt = galore2.GaLoreAdamW(
        [{"params": ws, "rank": 4, "update_proj_gap": 100}], lr=5e-2, weight_decay=0.1,
        foreach=True,
    )  # fmt: skip
    gg = _gen(6)
    for _ in range(steps):
        for w in ws:
            w.grad = torch.randn(w.shape, generator=gg).to(DEVICE, dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
    return [w.detach() for w in ws]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_galore_goes_along_the_data_on_the_grouped_kernels(dtype, monkeypatch, launches):
    """Where the grouped kernels run, every shape batch goes along the data
    (``lowrank_batch.along_data``, whatever its size): each non-refresh step projects and
    writes back each batch by one launch each. The weights match the torch path along the
    data (an ``mm`` and an ``addmm_`` per matrix, fp32 accumulation too) within float32
    accumulation order, or a bf16 rounding of the one step compared."""
    u = torch.empty(40, 24, device=DEVICE)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    assert lowrank_batch.along_data(u)
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    assert not lowrank_batch.along_data(u.cpu())
    steps = 4 if dtype == torch.float32 else 2  # bf16: one step after the refresh
    tables.clear()
    grouped = _galore_run(dtype, steps, monkeypatch, "triton")
    # step 1 refreshes (each matrix projected by the per-tensor path), its updates written
    # back grouped (2 batches); then per step 2 batches × (a projection and a write-back)
    assert len(launches) == 2 + (steps - 1) * 2 * 2, launches
    monkeypatch.setattr(lowrank_batch, "MIN_ALONG_DATA_ELEMENTS", 0)
    along = _galore_run(dtype, steps, monkeypatch, "torch")
    start = _galore_run(dtype, 0, monkeypatch, "torch")
    moved = max(
        float((a.float() - s.float()).abs().max()) for a, s in zip(along, start, strict=True)
    )
    # bf16: each of the 2 write-backs may differ by 1.5 ulps (2**-8 relative): the kernel
    # rounds once, torch's CPU addmm_ may round the product first (_lowrank_tolerance)
    rel = 1e-5 if dtype == torch.float32 else 4 * 2.0**-8
    assert moved > 2 * rel  # more than the bound below
    for a, b in zip(grouped, along, strict=True):
        bound = rel * (b.double().abs() + 1e-2)
        assert bool(((a.double() - b.double()).abs() <= bound).all()), (a - b).abs().max()


def test_the_grouped_path_follows_the_kernel_switches(monkeypatch):
    """``auto`` mode: where the grouped kernel opted out (``AUTO = False``) or was switched
    off after a failure, shape batches are stacked again (``along_data``), not projected
    one launch per matrix; ``GALORE2_KERNELS=triton`` runs it whatever its ``AUTO``."""
    u = torch.empty(64, 64, device="meta")  # a step on meta stands for one on a GPU
    monkeypatch.setenv(dispatch.ENV_VAR, "auto")
    assert lowrank_batch.along_data(u)
    monkeypatch.setattr(L, "AUTO", False)
    assert not lowrank_batch.along_data(u)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    assert lowrank_batch.along_data(u)
    monkeypatch.setenv(dispatch.ENV_VAR, "auto")
    monkeypatch.setattr(L, "AUTO", True)
    monkeypatch.setitem(dispatch._DISABLED, "lowrank_list", "RuntimeError: planted")
    assert not lowrank_batch.along_data(u)
