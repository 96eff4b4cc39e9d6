"""The 8-bit Adam kernel's keep flags, bf16 directions and fused AdamW step
(galore2.kernels.adam8bit: ``adam8bit_step_stack(..., out=, keep=, keep_at=)`` and
``adamw8bit_step``), against ``adam8bit_step`` (the same kernel without them, tested
against the torch path in test_triton_kernels.py) and the torch passes they replace.

Where the arithmetic is the same the results are compared bit for bit; the weight is also
bounded against float64 math by its two bf16 roundings. Flagged-out matrices get NaN / Inf
gradients and sentinel-filled ``out`` entries, so that anything written there shows up.
Without a GPU the kernels run under Triton's interpreter (tests/conftest.py).
"""

from __future__ import annotations

import math
import sys
from fractions import Fraction

import pytest
import torch

if sys.platform != "linux":  # triton ships Linux wheels only
    pytest.skip("triton is only installed on Linux", allow_module_level=True)

from galore2.kernels.adam8bit import adam8bit_step, adam8bit_step_stack, adamw8bit_step

from .test_keep_flags import _flags, _same
from .test_triton_kernels import ADAM_CASES, DEVICE, _kernel_maps, _random_state, _zero_block_mask

STEP, LR = 5, 1e-2
# Exaggerated decay: 1 − lr·λ ≈ 0.999 moves no bf16 weight once p·decay is rounded to bf16
# (half a bf16 ulp is ≥ 2⁻⁹ relative), so a kernel that skipped the decay would pass.
DECAY = 0.97
SENTINEL = 7.0
STATE = ("m", "ma", "v", "va")  # codes and absmax of both moments, adam8bit_step's order
# (shape, dim) with a short last block: 300 = 256 + 44 along the rows / columns
ROWS, COLS = ((40, 300), 1), ((300, 40), 0)
assert ROWS in ADAM_CASES and COLS in ADAM_CASES


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit: codes (uint8) or floats (NaN included)."""
    return torch.equal(a, b) if a.dtype == torch.uint8 else _same(a, b)


def _stack(shape, dim, seed: int, zero_member: int | None = None):
    """Three members' states (``zero_member``: an all-zero block, as test_triton_kernels
    makes them, with a zero gradient there) and their bf16 gradients (k, *shape)."""
    g = _gen(seed)
    states = [_random_state(shape, dim, g, zero_blocks=j == zero_member) for j in range(3)]
    grads = torch.randn((3, *shape), generator=g).to(DEVICE, torch.bfloat16)
    if zero_member is not None:
        grads[zero_member][_zero_block_mask(shape, dim).to(DEVICE)] = 0
    return states, grads


def _stacked(states):
    return {k: torch.stack([s[k] for s in states]) for k in STATE}


# ---- adam8bit_step_stack: keep flags ---------------------------------------------------
@pytest.mark.parametrize(
    "case,at,out_dtype",
    [
        (ROWS, False, torch.float32),
        (ROWS, True, torch.bfloat16),
        (COLS, False, torch.bfloat16),
        (COLS, True, torch.float32),
    ],
    ids=["dim1-flags-fp32", "dim1-keep_at-bf16", "dim0-flags-bf16", "dim0-keep_at-fp32"],
)
def test_stack_writes_only_the_kept_members(case, at, out_dtype):
    """A stack of three (member 0 with an all-zero block): the flagged-out member (a NaN
    and an Inf in its gradient) keeps its codes, absmax and ``out`` entry (a sentinel) bit
    for bit; each kept member has the bits of ``adam8bit_step`` on it alone (codes,
    absmax, and its fp32 direction, rounded by ``.to(bf16)`` for a bf16 ``out``: nearest,
    ties to even, on the CPU and on CUDA). Flags in order (member 1 out), or at positions
    of a longer flag tensor (``keep_at`` = [3, 4, 1]: member 0 out)."""
    shape, dim = case
    states, grads = _stack(shape, dim, math.prod(shape) + dim, zero_member=0)
    if at:
        flags, keep_at, out_member = _flags([False, True, False, False, True]), [3, 4, 1], 0
    else:
        flags, keep_at, out_member = _flags([True, False, True]), None, 1
    grads[out_member].view(-1)[0] = math.nan
    grads[out_member].view(-1)[-1] = math.inf
    stack = _stacked(states)
    before = {k: t.clone() for k, t in stack.items()}
    out = torch.full((3, *shape), SENTINEL, dtype=out_dtype, device=DEVICE)
    maps = _kernel_maps(DEVICE)
    res = adam8bit_step_stack(grads, *(stack[k] for k in STATE), dim=dim, step=STEP, out=out,
                              keep=flags, keep_at=keep_at, **maps)  # fmt: skip
    assert res is out
    for j, s in enumerate(states):
        if j == out_member:
            assert all(_bits(stack[k][j], before[k][j]) for k in STATE)
            assert bool((out[j] == SENTINEL).all())
            continue
        one = adam8bit_step(grads[j], *(s[k] for k in STATE), dim=dim, step=STEP, **maps)
        assert _bits(out[j], one.to(out_dtype)), j
        for k in STATE:
            assert _bits(stack[k][j], s[k]), (j, k)
            assert not _bits(stack[k][j], before[k][j]), (j, k)  # it stepped
    zero = _zero_block_mask(shape, dim).to(DEVICE)  # member 0's zero block, when kept
    if out_member != 0:
        assert bool((stack["m"][0][zero] == 0).all() and (stack["v"][0][zero] == 0).all())


def test_stack_all_flags_true_is_the_call_without_flags():
    """Every member flagged True (in order, and at positions): the bits of the call
    without flags: codes, absmax and direction."""
    shape, dim = (33, 5, 7), 1
    states, grads = _stack(shape, dim, 3)
    maps = _kernel_maps(DEVICE)
    plain = _stacked(states)
    want = adam8bit_step_stack(grads, *(plain[k] for k in STATE), dim=dim, step=STEP, **maps)
    for flags, keep_at in ((_flags([True] * 3), None), (_flags([False, True, True]), [2, 1, 2])):
        got = _stacked(states)
        out = adam8bit_step_stack(grads, *(got[k] for k in STATE), dim=dim, step=STEP,
                                  keep=flags, keep_at=keep_at, **maps)  # fmt: skip
        assert _bits(out, want)
        assert all(_bits(got[k], plain[k]) for k in STATE)


def test_stack_keep_leaves_a_strided_out_entry_unwritten():
    """The contract holds for any ``out`` the call takes: a non-contiguous fp32 ``out``
    (a transposed view) keeps a flagged-out member's sentinel entries. (A sentinel and
    size no other test allocates: freed memory reused for the buffer cannot hold it.)"""
    shape, dim, sentinel = (5, 40), 1, -1234.5
    states, grads = _stack(shape, dim, 4)
    grads[1, 0, 0] = math.nan
    stack = _stacked(states)
    out = torch.full((3, shape[1], shape[0]), sentinel, device=DEVICE).transpose(1, 2)
    assert not out.is_contiguous()
    adam8bit_step_stack(grads, *(stack[k] for k in STATE), dim=dim, step=STEP, out=out,
                        keep=_flags([True, False, True]), **_kernel_maps(DEVICE))  # fmt: skip
    assert bool((out[1] == sentinel).all())


# ---- adam8bit_step_stack: bf16 directions ----------------------------------------------
@pytest.mark.parametrize("shape,dim", [((6, 512), 1), ((513, 9), 0)])
def test_stack_bf16_out_is_the_fp32_direction_rounded_to_nearest_even(shape, dim):
    """A bf16 ``out`` (NaN-filled: every entry must be written) holds the fp32 ``out`` of
    the same call rounded by ``.to(torch.bfloat16)`` (nearest, ties to even; the
    interpreter's own store would truncate), bit for bit; the codes and absmax are those
    of the fp32 call. A float16 ``out`` is refused before anything is written."""
    states, grads = _stack(shape, dim, 5 + dim, zero_member=2)
    maps = _kernel_maps(DEVICE)
    s32, s16 = _stacked(states), _stacked(states)
    out32 = torch.full((3, *shape), math.nan, device=DEVICE)
    out16 = torch.full((3, *shape), math.nan, dtype=torch.bfloat16, device=DEVICE)
    adam8bit_step_stack(grads, *(s32[k] for k in STATE), dim=dim, step=STEP, out=out32, **maps)
    adam8bit_step_stack(grads, *(s16[k] for k in STATE), dim=dim, step=STEP, out=out16, **maps)
    assert bool(out32.isfinite().all())
    assert _bits(out16, out32.to(torch.bfloat16))
    # not vacuous: some directions are not bf16 values (their rounding is exercised)
    assert not torch.equal(out32, out16.float())
    for k in STATE:
        assert _bits(s16[k], s32[k]), k

    fresh = _stacked(states)
    half = torch.full((3, *shape), SENTINEL, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="out must be float32 or bfloat16"):
        adam8bit_step_stack(grads, *(fresh[k] for k in STATE), dim=dim, step=STEP, out=half,
                            **maps)  # fmt: skip
    assert bool((half == SENTINEL).all())
    assert all(_bits(fresh[k], torch.stack([s[k] for s in states])) for k in STATE)


# ---- adamw8bit_step --------------------------------------------------------------------
def _adamw_inputs(shape, dim, seed: int):
    """A bf16 weight (randn · 0.5), its bf16 gradient (zero over the all-zero block) and a
    state with an all-zero block."""
    g = _gen(seed)
    state = _random_state(shape, dim, g, zero_blocks=True)
    p = (torch.randn(shape, generator=g) * 0.5).to(DEVICE, torch.bfloat16)
    grad = torch.randn(shape, generator=g).to(DEVICE, torch.bfloat16)
    grad[_zero_block_mask(shape, dim).to(DEVICE)] = 0
    return p, grad, state


def _adamw(p, grad, state, dim, decay, **kw):
    return adamw8bit_step(p, grad, *(state[k] for k in STATE), dim=dim, step=STEP, lr=LR,
                          decay=decay, **_kernel_maps(DEVICE), **kw)  # fmt: skip


@pytest.mark.parametrize("decay", [1.0, DECAY], ids=["no-decay", "decay"])
@pytest.mark.parametrize("shape,dim", [ROWS, ((40, 130), 0)])
def test_adamw8bit_step_is_adam8bit_step_then_the_torch_passes(shape, dim, decay):
    """The fused step against ``adam8bit_step`` on the same inputs followed by the bf16
    torch passes ``p.mul_(decay); p.add_(d, alpha=-lr)`` (d its fp32 direction):

    * the codes and absmax, bit for bit;
    * the weight, bit for bit: both round ``p·decay`` to bf16 (a fp32 product, rounded to
      nearest even), then ``p − lr·d`` as one fma rounded to bf16. That torch's add
      contracts to an fma holds for its CUDA kernels (nvcc) and, checked when this test
      was written, for its CPU kernel here (x86-64, torch 2.13, vectorised and scalar);
      a CPU build that rounds the product first would differ by one bf16 ulp on about one
      element in 10^6;
    * the weight against float64 math, e = p·decay − lr·d: within the two bf16 roundings,
      a half ulp (≤ 2⁻⁸ relative) of ``rb(p·decay)`` (only when decay ≠ 1) and of the
      result, plus fp32 ulps (2⁻²²) of the terms for the fp32 product, fma and scalars."""
    p, grad, state = _adamw_inputs(shape, dim, math.prod(shape) + dim)
    ref_state = {k: t.clone() for k, t in state.items()}
    d = adam8bit_step(grad, *(ref_state[k] for k in STATE), dim=dim, step=STEP,
                      **_kernel_maps(DEVICE))  # fmt: skip
    ref = p.clone()
    if decay != 1:
        ref.mul_(decay)
    ref.add_(d, alpha=-LR)
    got = p.clone()
    assert _adamw(got, grad, state, dim, decay) is True
    for k in STATE:
        assert _bits(state[k], ref_state[k]), k
    assert _bits(got, ref)
    assert (got != p).float().mean() > 0.5  # it stepped

    exact = p.double() * decay - LR * d.double()
    decayed = (p.float() * decay).to(torch.bfloat16).double().abs() if decay != 1 else 0.0
    bound = 2.0**-8 * (decayed + got.double().abs())
    bound = bound + 2.0**-22 * (p.double().abs() + LR * d.double().abs()) + 1e-30
    assert bool(((got.double() - exact).abs() <= bound).all())


def _round(x: Fraction, bits: int) -> Fraction:
    """``x`` rounded to ``bits`` significant bits, to nearest, ties to even (normal
    range): fp32 is 24 bits, bf16 8."""
    if x == 0:
        return x
    mag = abs(x)
    e = mag.numerator.bit_length() - mag.denominator.bit_length()
    e += 1 if Fraction(2) ** (e + 1) <= mag else -1 if Fraction(2) ** e > mag else 0
    unit = Fraction(2) ** (e - bits + 1)
    n, rest = divmod(mag, unit)
    n += rest > unit / 2 or (rest == unit / 2 and n % 2 == 1)
    return (1 if x > 0 else -1) * n * unit


def _tie_case(d: torch.Tensor):
    """(element, weight, −lr, fma result, two-rounding result) for the first element of the
    direction ``d`` where a weight of ±1 and an fp32 −lr make ``p + (−lr)·d`` round
    differently as one fma than with the product rounded first (see below), else None."""
    for j, value in enumerate(d.view(-1).tolist()):
        dj = Fraction(value)
        if dj == 0:
            continue
        # p0 + x just beyond a bf16 midpoint plus half an fp32 ulp (an fp32 tie, whose even
        # neighbour is the midpoint: a bf16 tie, to 1.0): above 1 + 2⁻⁸, below 1 − 2⁻⁹
        for p0 in (1, -1):
            for target in (Fraction(1, 2**8) + Fraction(1, 2**24),
                           -Fraction(1, 2**9) - Fraction(1, 2**25)):  # fmt: skip
                a0 = _round(p0 * target / dj, 24)
                for i in range(-3, 4):
                    a = _round(a0 + i * abs(a0) / 2**23, 24)
                    fma = _round(_round(p0 + a * dj, 24), 8)
                    two = _round(_round(p0 + _round(a * dj, 24), 24), 8)
                    if a < 0 and fma != two:
                        return j, p0, a, fma, two
    return None


def test_adamw8bit_step_rounds_the_update_once():
    """``p − lr·d`` is one fma rounded to fp32, then to bf16 (not the product rounded to
    fp32 first): at an element whose weight (±1) and lr are chosen from adam8bit_step's d
    there so that the product rounded first makes the sum an fp32 tie that rounds to a
    bf16 tie (to even, 1.0), while the exact sum lies just beyond it (to the other bf16
    neighbour): one bf16 ulp apart, in exact rational arithmetic. Every other element is
    checked against the same exact reference. (Not against torch's ``add_``: whether its CPU
    kernel contracts the product depends on the build's vector ISA, so a bound on it would
    hold on some x86-64 CPUs only.)"""
    shape, dim = (70, 5), 1
    p, grad, state = _adamw_inputs(shape, dim, 13)
    d = adam8bit_step(grad, *(t.clone() for t in (state[k] for k in STATE)), dim=dim,
                      step=STEP, **_kernel_maps(DEVICE))  # fmt: skip
    found = _tie_case(d.cpu())
    assert found, "no element to construct the case from"
    j, p0, a, fma, two = found
    p.view(-1)[j] = p0
    got = p.clone()
    adamw8bit_step(got, grad, *(state[k] for k in STATE), dim=dim, step=STEP, lr=float(-a),
                   decay=1.0, **_kernel_maps(DEVICE))  # fmt: skip
    assert Fraction(float(got.view(-1)[j])) == fma != two
    pairs = zip(p.view(-1).tolist(), d.cpu().view(-1).tolist(), strict=True)
    exact = [_round(_round(Fraction(w) + a * Fraction(x), 24), 8) for w, x in pairs]
    assert list(map(Fraction, got.view(-1).tolist())) == exact


@pytest.mark.parametrize(
    "case,at,flag",
    [(((70, 5), 1), False, False), (((40, 130), 0), True, False),
     (((70, 5), 1), False, True), (((40, 130), 0), True, True)],
    ids=["flags-false", "keep_at-false", "flags-true", "keep_at-true"],
)  # fmt: skip
def test_adamw8bit_step_keep(case, at, flag):
    """A one-entry flag (or ``keep_at`` = [2], a position of a longer flag tensor):
    False leaves the weight and all four state tensors bit for bit (a NaN and an Inf in
    the gradient never reach them); True is the call without flags, bit for bit."""
    shape, dim = case
    p, grad, state = _adamw_inputs(shape, dim, 9 + dim)
    if at:
        keep, keep_at = _flags([not flag, not flag, flag, not flag]), [2]
    else:
        keep, keep_at = _flags([flag]), None
    if not flag:
        grad.view(-1)[0] = math.nan
        grad.view(-1)[-1] = -math.inf
    before = {k: t.clone() for k, t in state.items()}
    got = p.clone()
    assert _adamw(got, grad, state, dim, DECAY, keep=keep, keep_at=keep_at) is True
    if not flag:
        assert _bits(got, p)
        assert all(_bits(state[k], before[k]) for k in STATE)
        return
    want = p.clone()
    _adamw(want, grad, before, dim, DECAY)
    assert _bits(got, want) and not _bits(got, p)
    assert all(_bits(state[k], before[k]) for k in STATE)


# ---- refusals --------------------------------------------------------------------------
def _refused(call, match: str, *tensors: torch.Tensor) -> None:
    """``call`` raises a ValueError matching ``match`` and leaves ``tensors`` bit for bit."""
    before = [t.clone() for t in tensors]
    with pytest.raises(ValueError, match=match):
        call()
    for t, b in zip(tensors, before, strict=True):
        assert _bits(t, b)


def test_adamw8bit_step_refuses_what_it_does_not_take():
    """Before anything is written: a float32, wrongly shaped or non-contiguous weight;
    flags of another dtype, count or rank, ``keep_at`` out of range, of another count or
    without flags; step 0."""
    shape, dim = (8, 12), 1
    p, grad, state = _adamw_inputs(shape, dim, 11)
    tensors = (p, *(state[k] for k in STATE))

    def call(weight=p, **kw):
        return lambda: _adamw(weight, grad, state, dim, DECAY, **kw)

    weight = "adamw8bit_step takes a contiguous bf16 weight"
    strided = torch.zeros(shape[::-1], dtype=torch.bfloat16, device=DEVICE).T
    assert not strided.is_contiguous()
    for bad in (p.float(), p.view(-1), p[:4], strided):
        _refused(call(bad), weight, bad, *tensors)
    flags = r"adamw8bit_step: keep must be a contiguous 1-D bool tensor"
    ones = torch.ones(4, dtype=torch.bool, device=DEVICE)
    for kw in (
        {"keep": torch.ones(1, dtype=torch.uint8, device=DEVICE)},  # not bool
        {"keep": ones[:2]},  # two flags for one weight
        {"keep": ones[:1].view(1, 1)},  # not 1-D
        {"keep": ones, "keep_at": [4]},  # a position past the flags
        {"keep": ones, "keep_at": [-1]},
        {"keep": ones, "keep_at": [0, 1]},  # two positions for one weight
        {"keep_at": [0]},  # positions without flags
    ):
        _refused(call(**kw), flags, *tensors)
    _refused(lambda: adamw8bit_step(p, grad, *(state[k] for k in STATE), dim=dim, step=0,
                                    lr=LR, decay=DECAY, **_kernel_maps(DEVICE)),
             r"step counts this step \(>= 1\), got 0", *tensors)  # fmt: skip
    maps = _kernel_maps(DEVICE)
    for kw in ({k: v for k, v in maps.items() if k != "eps"}, {**maps, "beta3": 0.5}):
        before = [t.clone() for t in tensors]
        with pytest.raises(TypeError, match=r"adamw8bit_step: missing keywords .* unknown"):
            adamw8bit_step(p, grad, *(state[k] for k in STATE), dim=dim, step=3, lr=LR,
                           decay=DECAY, **kw)  # fmt: skip
        assert all(_bits(t, b) for t, b in zip(tensors, before, strict=True))


def test_stack_refuses_bad_flags_and_step_zero():
    """``adam8bit_step_stack`` (and ``adam8bit_step``: step 0) refuse, naming the op,
    before anything is written: flags of another dtype, count or layout (strided),
    ``keep_at`` out of range or of another count; step 0."""
    shape, dim = (6, 40), 1
    states, grads = _stack(shape, dim, 12)
    stack = _stacked(states)
    out = torch.full((3, *shape), SENTINEL, device=DEVICE)
    tensors = (out, *(stack[k] for k in STATE))
    maps = _kernel_maps(DEVICE)

    def call(step=STEP, **kw):
        return lambda: adam8bit_step_stack(grads, *(stack[k] for k in STATE), dim=dim,
                                           step=step, out=out, **kw, **maps)  # fmt: skip

    flags = r"adam8bit_step_stack: keep must be a contiguous 1-D bool tensor"
    ones = torch.ones(5, dtype=torch.bool, device=DEVICE)
    for kw in (
        {"keep": torch.ones(3, dtype=torch.uint8, device=DEVICE)},  # not bool
        {"keep": ones[:2]},  # two flags for three members
        {"keep": ones},  # five flags for three members
        {"keep": ones[:3], "keep_at": [0, 1, 3]},  # a position past the flags
        {"keep": ones, "keep_at": [0, 1]},  # two positions for three members
        {"keep": torch.ones(6, dtype=torch.bool, device=DEVICE)[::2]},  # strided
    ):
        _refused(call(**kw), flags, *tensors)
    step0 = r"step counts this step \(>= 1\), got 0"
    _refused(call(step=0), step0, *tensors)
    _refused(call(step=0, keep=ones[:3]), step0, *tensors)
    s = states[0]
    _refused(lambda: adam8bit_step(grads[0], *(s[k] for k in STATE), dim=dim, step=0,
                                   **_kernel_maps(DEVICE)),
             step0, *(s[k] for k in STATE))  # fmt: skip
