"""``keep`` flags of galore2's ops (a deferred step's usable-gradient flags, read on the
device): a tensor flagged False is not written at all — its weight, its moments, its
``out`` — and every other tensor gets the bits it gets without flags. Checked for the
Triton kernels (under the interpreter without a GPU: tests/conftest.py) and for the torch
paths, which pick the kept tensors on the host.
"""

from __future__ import annotations

import sys

import pytest
import torch

if sys.platform != "linux":  # triton ships Linux wheels only
    pytest.skip("triton is only installed on Linux", allow_module_level=True)

from galore2.kernels import dispatch, ops, ops_lowrank, ops_scaled, tables
from galore2.optim.adam8bit import adam8bit_stack_
from galore2.optim.adamw8bit_step import adamw8bit_
from galore2.storage import dynamic8

from .test_triton_kernels import DEVICE

HYPER = {"step": 3, "lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "decay": 0.99}
MODES = ["triton", "torch"]


@pytest.fixture(params=MODES)
def mode(request, monkeypatch) -> str:
    monkeypatch.setenv(dispatch.ENV_VAR, request.param)
    tables.clear()
    return request.param


def _weights(shapes, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in shapes:
        p = torch.randn(shape, generator=g).to(DEVICE, torch.bfloat16)
        grad = torch.randn(shape, generator=g).to(DEVICE, torch.bfloat16)
        m = torch.randn(shape, generator=g).to(DEVICE) * 0.1
        v = torch.rand(shape, generator=g).to(DEVICE) * 0.01
        out.append((p, grad, m, v))
    return out


def _clone(tensors):
    return [tuple(t.clone() for t in ts) for ts in tensors]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN included)."""
    ints = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
    return a.dtype == b.dtype and torch.equal(a.view(ints[a.dtype]), b.view(ints[b.dtype]))


def _flags(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bool, device=DEVICE)


@pytest.mark.parametrize("count", [1, 3])
def test_adamw_writes_only_the_kept_weights(mode, count):
    """The list launch (3 weights) and the per-weight launch (1): flagged-out weights and
    moments keep their bits (a NaN gradient there never reaches them); the others are the
    bits of a call without them."""
    shapes = [(37, 70), (5,), (1030,)][:count]
    given = _weights(shapes, 0)
    keep = [True, False, True][:count] if count > 1 else [False]
    for i, k in enumerate(keep):
        if not k:
            given[i][1][0] = float("nan")
    flagged, alone = _clone(given), _clone(given)
    ops.adamw_(*map(list, zip(*flagged, strict=True)), *HYPER.values(), _flags(keep))
    taken = [i for i, k in enumerate(keep) if k]
    if taken:
        ops.adamw_(*map(list, zip(*(alone[i] for i in taken), strict=True)), *HYPER.values())
    for i, k in enumerate(keep):
        want = alone[i] if k else given[i]
        for got, ref in zip(flagged[i], want, strict=True):
            assert _same(got, ref)


@pytest.mark.parametrize("at", [False, True], ids=["flags", "keep_at"])
def test_directions_write_only_the_kept_members(mode, at):
    """A stacked entry (4 members of 6×40, float32 moments, bf16 directions): members 1 and
    3 flagged out keep their moments and ``out`` (NaN directions there never reach them);
    the others are the bits of a call on them alone. Their flags given in order, or at
    positions of a longer tensor (``keep_at``)."""
    g = torch.Generator().manual_seed(1)
    u = torch.randn(4, 6, 40, generator=g).to(DEVICE, torch.bfloat16)
    u[1, 2, 3] = float("inf")
    u[3] = float("nan")
    m = torch.randn(4, 6, 40, generator=g).to(DEVICE) * 0.1
    v = torch.rand(4, 6, 40, generator=g).to(DEVICE) * 0.01
    out = torch.full((4, 6, 40), 7.0, dtype=torch.bfloat16, device=DEVICE)
    m0, v0, out0 = m.clone(), v.clone(), out.clone()
    if at:  # the members' flags at positions of a longer tensor (a group's flags)
        flags, keep_at = _flags([False, True, True, False, False, False]), [1, 3, 2, 0]
    else:
        flags, keep_at = _flags([True, False, True, False]), None
    ops.adam_directions_([u], [m], [v], [out], 3, 0.9, 0.999, 1e-8, flags, keep_at)
    for j in (0, 2):
        mj, vj, oj = m0[j].clone(), v0[j].clone(), out0[j].clone()
        ops.adam_directions_([u[j].contiguous()], [mj], [vj], [oj], 3, 0.9, 0.999, 1e-8)
        assert _same(m[j], mj) and _same(v[j], vj) and _same(out[j], oj)
    for j in (1, 3):
        assert _same(m[j], m0[j]) and _same(v[j], v0[j]) and _same(out[j], out0[j])


@pytest.mark.parametrize("at", [False, True], ids=["flags", "keep_at"])
def test_addmm_each_writes_only_the_kept_weights(mode, at):
    """Three weights, the middle one flagged out with a NaN factor: it keeps its bits; the
    others are the bits of a call on them alone (flags in order, or at positions)."""
    g = torch.Generator().manual_seed(2)
    ps = [torch.randn(33, 20, generator=g).to(DEVICE, torch.bfloat16) for _ in range(3)]
    As = [torch.randn(33, 4, generator=g).to(DEVICE, torch.bfloat16) for _ in range(3)]
    Bs = [torch.randn(4, 20, generator=g).to(DEVICE, torch.bfloat16) for _ in range(3)]
    As[1][0, 0] = float("nan")
    before = [p.clone() for p in ps]
    alone = [ps[i].clone() for i in (0, 2)]
    if at:
        ops_lowrank.addmm_each_(ps, As, Bs, -0.5, 0.99, _flags([False, True, False, True]),
                                [3, 0, 1])  # fmt: skip
    else:
        ops_lowrank.addmm_each_(ps, As, Bs, -0.5, 0.99, _flags([True, False, True]))
    ops_lowrank.addmm_each_(alone, [As[0], As[2]], [Bs[0], Bs[2]], -0.5, 0.99)
    assert _same(ps[0], alone[0]) and _same(ps[2], alone[1]) and _same(ps[1], before[1])


@pytest.mark.parametrize(
    "keep",
    [
        torch.ones(2, dtype=torch.uint8),  # not bool
        torch.ones(3, dtype=torch.bool),  # not one per weight
    ],
    ids=["dtype", "count"],
)
def test_flags_the_ops_do_not_take_are_named(keep):
    ps = [torch.zeros(4, 4, dtype=torch.bfloat16) for _ in range(2)]
    factors = [torch.zeros(4, 2, dtype=torch.bfloat16) for _ in range(2)]
    rows = [torch.zeros(2, 4, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(ValueError, match=r"addmm_each_: keep must be a contiguous 1-D bool"):
        ops_lowrank.addmm_each_(ps, factors, rows, 1.0, 1.0, keep)
    with pytest.raises(ValueError, match=r"addmm_each_: keep must .* keep_at: their positions"):
        at = [0, 2]  # a position past the flags
        ops_lowrank.addmm_each_(ps, factors, rows, 1.0, 1.0, torch.ones(2, dtype=torch.bool), at)
    with pytest.raises(ValueError, match="adam_directions_: keep and steps take one direction"):
        ops.adam_directions_(ps, ps, ps, ps, 1, 0.9, 0.999, 1e-8, torch.ones(1, dtype=torch.bool))


def test_directions_at_each_members_own_step(mode):
    """A stacked entry whose members count different steps (one was skipped once): each
    member's moments and direction are those of a call at its own count, bit for bit."""
    g = torch.Generator().manual_seed(3)
    u = torch.randn(3, 5, 40, generator=g).to(DEVICE, torch.bfloat16)
    m = torch.randn(3, 5, 40, generator=g).to(DEVICE) * 0.1
    v = torch.rand(3, 5, 40, generator=g).to(DEVICE) * 0.01
    out = torch.empty(3, 5, 40, dtype=torch.bfloat16, device=DEVICE)
    steps = [7, 6, 7]
    alone = [(m[j].clone(), v[j].clone(), out[j].clone()) for j in range(3)]
    ops.adam_directions_([u], [m], [v], [out], 7, 0.9, 0.999, 1e-8, None, None, steps)
    for j, (mj, vj, oj) in enumerate(alone):
        ops.adam_directions_([u[j].contiguous()], [mj], [vj], [oj], steps[j], 0.9, 0.999, 1e-8)
        assert _same(m[j], mj) and _same(v[j], vj) and _same(out[j], oj), j


def _codes(k: int, shape: tuple[int, int], dim: int, seed: int) -> list[torch.Tensor]:
    """Random 8-bit moments of ``k`` matrices: codes and absmax stacks (m, ma, v, va)."""
    g = torch.Generator().manual_seed(seed)
    scales = dynamic8.absmax_shape(shape, dim)
    return [
        torch.randint(0, 256, (k, *shape), generator=g, dtype=torch.uint8).to(DEVICE),
        ((torch.rand((k, *scales), generator=g) + 0.5) * 0.1).to(DEVICE),
        torch.randint(0, 256, (k, *shape), generator=g, dtype=torch.uint8).to(DEVICE),
        ((torch.rand((k, *scales), generator=g) + 0.5) * 0.01).to(DEVICE),
    ]


@pytest.mark.parametrize("at", [False, True], ids=["flags", "keep_at"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_adam8bit_stack_writes_only_the_kept_members(mode, at, bf16):
    """A shape stack's 8-bit Adam (galore2::adam8bit_stack_, three 8 x 300 members blocked
    along rows): member 1, flagged out with a NaN direction, keeps its codes and absmax;
    the others are the bits of a call on each alone, their directions too (in bf16: the
    float32 ones rounded). Its flags in order, or at positions of a longer tensor."""
    g = torch.Generator().manual_seed(4)
    u = torch.randn(3, 8, 300, generator=g).to(DEVICE, torch.bfloat16)
    u[1, 2, 3] = float("nan")
    state = _codes(3, (8, 300), 1, 5)
    before = [t.clone() for t in state]
    if at:
        flags, keep_at = _flags([False, True, False, True]), [1, 2, 3]
    else:
        flags, keep_at = _flags([True, False, True]), None
    out = adam8bit_stack_(u, *state, 1, 0.9, 0.999, 1e-8, 3, flags, keep_at, bf16)
    assert out.dtype == (torch.bfloat16 if bf16 else torch.float32)
    for j in (0, 2):
        alone = [t[j : j + 1].clone() for t in before]
        want = adam8bit_stack_(u[j : j + 1].contiguous(), *alone, 1, 0.9, 0.999, 1e-8, 3)
        assert _same(out[j], want[0].to(out.dtype))
        assert all(torch.equal(t[j], a[0]) for t, a in zip(state, alone, strict=True)), j
    assert all(torch.equal(t[1], b[1]) for t, b in zip(state, before, strict=True))


@pytest.mark.parametrize("at", [False, True], ids=["flag", "keep_at"])
def test_adamw8bit_writes_nothing_flagged_out(mode, at):
    """A plain group's tensor with 8-bit moments (galore2::adamw8bit_, 64 x 64): flagged
    out (a NaN gradient), its weight and moments keep their bits; flagged in, the bits of
    a call without flags, which are the 8-bit step's direction (the op of a one-matrix
    stack, same codes and absmax) followed by the decay and the update of the weight —
    within one bf16 rounding of that pass's result (the kernel's fused multiply-add may
    round where torch's CPU add does not)."""
    g = torch.Generator().manual_seed(6)
    p = torch.randn(64, 64, generator=g).to(DEVICE, torch.bfloat16)
    grad = torch.randn(64, 64, generator=g).to(DEVICE, torch.bfloat16)
    state = [t[0] for t in _codes(1, (64, 64), 1, 7)]
    hyper = (1, 0.9, 0.999, 1e-8, 3, 1e-2, 0.99)
    flag, keep_at = (_flags([True, False]), [1]) if at else (_flags([False]), None)
    bad, bad_state = p.clone(), [t.clone() for t in state]
    nan_grad = grad.clone()
    nan_grad[5, 5] = float("nan")
    adamw8bit_(bad, nan_grad, *bad_state, *hyper, flag, keep_at)
    assert _same(bad, p) and all(map(torch.equal, bad_state, state))
    kept_p, kept_state = p.clone(), [t.clone() for t in state]
    adamw8bit_(kept_p, grad, *kept_state, *hyper, _flags([True]))
    plain_p, plain_state = p.clone(), [t.clone() for t in state]
    adamw8bit_(plain_p, grad, *plain_state, *hyper)
    assert _same(kept_p, plain_p) and all(map(torch.equal, kept_state, plain_state))
    passes = [t.unsqueeze(0).clone() for t in state]
    d = adam8bit_stack_(grad.unsqueeze(0), *passes, *hyper[:5])[0]
    assert all(torch.equal(a[0], b) for a, b in zip(passes, plain_state, strict=True))
    want = p.clone()
    want.mul_(0.99)
    want.add_(d, alpha=-1e-2)
    ulp = 2.0 ** (torch.floor(torch.log2(want.float().abs().clamp_min(2.0**-126))) - 7)
    assert bool(((plain_p.float() - want.float()).abs() <= ulp).all())


@pytest.mark.parametrize("at", [False, True], ids=["flags", "keep_at"])
def test_scaled_updates_write_only_the_kept_weights(mode, at):
    """APOLLO's and Fira's grouped updates along the data (galore2::scaled_add_each_:
    G ⊙ f into each weight; galore2::addmm_scaled_each_: A·B + G ⊙ f): three weights, the
    middle one flagged out with a NaN gradient and factor, keeps its bits; the others are
    the bits of a call on them alone (flags in order, or at positions)."""
    g = torch.Generator().manual_seed(8)
    ps = [torch.randn(33, 20, generator=g).to(DEVICE, torch.bfloat16) for _ in range(3)]
    Gs = [torch.randn(33, 20, generator=g).to(DEVICE, torch.bfloat16) for _ in range(3)]
    As = [torch.randn(33, 4, generator=g).to(DEVICE, torch.bfloat16) for _ in range(3)]
    Bs = [torch.randn(4, 20, generator=g).to(DEVICE, torch.bfloat16) for _ in range(3)]
    factor = torch.rand(3, 1, 20, generator=g).to(DEVICE)
    Gs[1][2, 3] = float("nan")
    factor[1, 0, 0] = float("inf")
    if at:
        flags, keep_at = _flags([False, True, False, True]), [3, 0, 1]
    else:
        flags, keep_at = _flags([True, False, True]), None
    for fused in (False, True):
        given = [p.clone() for p in ps]
        alone = [ps[i].clone() for i in (0, 2)]
        if fused:
            ops_lowrank.addmm_scaled_each_(given, As, Bs, Gs, factor, -0.5, 0.99, -0.1,
                                           flags, keep_at)  # fmt: skip
            ops_lowrank.addmm_scaled_each_(alone, [As[0], As[2]], [Bs[0], Bs[2]],
                                           [Gs[0], Gs[2]], factor[0::2], -0.5, 0.99, -0.1)  # fmt: skip
        else:
            ops_scaled.scaled_add_each_(given, Gs, factor, -0.1, 0.99, flags, keep_at)
            ops_scaled.scaled_add_each_(alone, [Gs[0], Gs[2]], factor[0::2], -0.1, 0.99)
        assert _same(given[0], alone[0]) and _same(given[2], alone[1]), fused
        assert _same(given[1], ps[1]), fused
