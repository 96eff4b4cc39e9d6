"""Triton kernels (galore2.kernels) against the torch path they replace.

Without a GPU the kernels run on CPU tensors under Triton's interpreter (tests/conftest.py
sets ``TRITON_INTERPRET=1`` before triton is imported); on a CUDA machine they run on the
GPU. Each test draws fresh seeded inputs, includes sizes that are not multiples of the
kernels' tiles, and pre-fills output buffers with NaN or a sentinel so that an element a
kernel fails to write shows up. Tolerances are stated (and explained) where they are used.

triton is a test dependency on Linux (pyproject's ``test`` extra): a missing triton fails
this module there instead of skipping it.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from ..helpers import run_python

if (
    sys.platform != "linux"
):  # triton ships Linux wheels only (pyproject: platform_system == 'Linux')
    pytest.skip("triton is only installed on Linux", allow_module_level=True)

import triton  # noqa: F401  (an ImportError here fails the run: CI installs triton)

from galore2.core.apply import apply_update
from galore2.core.transform import LowRankUpdate
from galore2.kernels import dispatch
from galore2.kernels.adam8bit import adam8bit_step, adam8bit_step_stack
from galore2.kernels import ops, tables
from galore2.kernels.adamw import adamw_step
from galore2.kernels.hadamard import blockwise_fwht
from galore2.kernels.lowrank import lowrank_update
from galore2.optim.adam import ScaleByAdam, ScaleByAdam8bit
from galore2.storage import dynamic8 as A8
from galore2.storage import hadamard as H

# Where the kernels run here: CPU tensors under the interpreter, else the GPU.
DEVICE = "cpu" if dispatch.interpreter_enabled() else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.fail("neither Triton's interpreter nor a CUDA device is available", pytrace=False)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- dispatch ------------------------------------------------------------------------
def test_kernel_mode_reads_the_environment_at_call_time(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert dispatch.kernel_mode() == "auto"
    for raw, mode in (("torch", "torch"), (" Triton ", "triton"), ("AUTO", "auto"), ("", "auto")):
        monkeypatch.setenv(dispatch.ENV_VAR, raw)
        assert dispatch.kernel_mode() == mode
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
    with pytest.raises(
        ValueError, match=r"GALORE2_KERNELS='cuda' is not one of auto, torch, triton"
    ):
        dispatch.kernel_mode()
    with pytest.raises(ValueError, match="GALORE2_KERNELS"):
        dispatch.use_triton(torch.zeros(2))


def test_kernel_auto_selection_never_picks_triton_for_cpu_tensors(monkeypatch):
    x = torch.zeros(4, 4)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # even under the interpreter
    for mode in ("auto", "torch"):
        monkeypatch.setenv(dispatch.ENV_VAR, mode)
        assert not dispatch.use_triton(x)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")  # explicit: CPU tensors, interpreted
    assert dispatch.use_triton(x)


def test_kernel_triton_mode_that_cannot_run_is_a_clear_error(monkeypatch):
    x = torch.zeros(4, 4)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"GALORE2_KERNELS=triton but the tensors are on cpu"):
        dispatch.use_triton(x)
    monkeypatch.setattr(dispatch, "triton_import_error", lambda: "ImportError: no triton")
    with pytest.raises(RuntimeError, match=r"triton cannot be imported \(ImportError: no triton\)"):
        dispatch.use_triton(x)
    monkeypatch.setenv(dispatch.ENV_VAR, "auto")
    assert not dispatch.use_triton(x)


# ---- 8-bit Adam ----------------------------------------------------------------------
BETAS, EPS = (0.9, 0.999), 1e-8
# The largest gap between consecutive values of bitsandbytes' dynamic maps (signed 0.0141,
# unsigned 0.0070): the most a nearest-code choice can move a value, in units of absmax.
MAX_GAP = 0.0141


def _random_state(shape, dim, g: torch.Generator, zero_blocks: bool):
    """Random 8-bit moments (codes uniform over 0..255, absmax in (0.5, 1.5)·scale) with the
    first block of the first two rows (dim 1) / columns (dim 0) all zero when asked."""
    scales = A8.absmax_shape(shape, dim)
    state = {
        "m": torch.randint(0, 256, shape, generator=g, dtype=torch.uint8),
        "v": torch.randint(0, 256, shape, generator=g, dtype=torch.uint8),
        "ma": (torch.rand(scales, generator=g) + 0.5) * 0.1,
        "va": (torch.rand(scales, generator=g) + 0.5) * 0.01,
    }
    if zero_blocks:
        for key in ("ma", "va"):
            if dim == 1:
                state[key][:2, 0] = 0
            else:
                state[key][0, :2] = 0
    return {k: t.to(DEVICE) for k, t in state.items()}


def _zero_block_mask(shape, dim) -> torch.Tensor:
    mask = torch.zeros(shape[0], math.prod(shape) // shape[0], dtype=torch.bool)
    if dim == 1:
        mask[:2, : A8.BLOCK] = True
    else:
        mask[: A8.BLOCK, :2] = True
    return mask.view(shape)


def _torch_step(grad, state, dim, step):
    """The torch path of ScaleByAdam8bit.update: (direction, fp32 m, fp32 v, new state)."""
    fp32 = {
        "adam.exp_avg": A8.dequantize(state["m"], state["ma"], dim, signed=True),
        "adam.exp_avg_sq": A8.dequantize(state["v"], state["va"], dim, signed=False),
        "adam.step": torch.tensor(step - 1),
    }
    direction = ScaleByAdam().update(grad, fp32, {"betas": BETAS, "eps": EPS}, None)
    new = {k: t.clone() for k, t in state.items()}
    A8.quantize_(fp32["adam.exp_avg"], new["m"], new["ma"], dim, signed=True)
    A8.quantize_(fp32["adam.exp_avg_sq"], new["v"], new["va"], dim, signed=False)
    return direction, fp32["adam.exp_avg"], fp32["adam.exp_avg_sq"], new


def _nearest_codes(x: torch.Tensor, dim: int, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact quantize_blockwise semantics, in torch: (codes, absmax) with absmax = max |x|
    per block and the nearest code to x / absmax (ties to the lower), code 0 in zero blocks."""
    v = A8._blocked(x.float(), dim)
    rows, length = v.shape
    blocks = -(-length // A8.BLOCK)
    v = torch.nn.functional.pad(v, (0, blocks * A8.BLOCK - length)).view(rows, blocks, A8.BLOCK)
    absmax = v.abs().amax(dim=-1, keepdim=True)
    live = absmax > 0
    y = v / torch.where(live, absmax, torch.ones_like(absmax))
    code = A8.dynamic_code(signed, x.device)
    q = torch.where(live, torch.bucketize(y, (code[:-1] + code[1:]) / 2), 0)
    q = q.view(rows, -1)[:, :length]
    absmax = absmax.view(rows, blocks)
    if dim == 0:
        q, absmax = q.mT, absmax.mT
    return q.reshape(x.shape).to(torch.uint8), absmax


# (shape, dim): blocks along rows with a 256 + 44 tail, an exact multiple, a 3-D direction
# (35-element rows: one short block) and a single short row block of 5; along columns with
# 300 = 256 + 44 rows, 513 = 2·256 + 1 rows, 40 rows (one short block).
ADAM_CASES = [
    ((40, 300), 1),
    ((6, 512), 1),
    ((33, 5, 7), 1),
    ((70, 5), 1),
    ((300, 40), 0),
    ((513, 9), 0),
    ((40, 130), 0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,dim", ADAM_CASES)
def test_triton_adam8bit_matches_torch_path(shape, dim, dtype, monkeypatch):
    g = _gen(math.prod(shape) * 2 + dim)
    state = _random_state(shape, dim, g, zero_blocks=True)
    grad = torch.randn(shape, generator=g).to(DEVICE, dtype)
    grad[_zero_block_mask(shape, dim).to(DEVICE)] = 0  # zero moments there: absmax 0, code 0
    step = 7
    direction, m32, v32, ref = _torch_step(grad, state, dim, step)

    # the kernel into poisoned buffers: NaN direction / absmax, sentinel codes
    out = torch.full(shape, math.nan, device=DEVICE)
    into = {
        "m": torch.full(shape, 0x5A, dtype=torch.uint8, device=DEVICE),
        "ma": torch.full_like(state["ma"], math.nan),
        "v": torch.full(shape, 0xA5, dtype=torch.uint8, device=DEVICE),
        "va": torch.full_like(state["va"], math.nan),
    }
    before = {k: t.clone() for k, t in state.items()}
    adam8bit_step(
        grad,
        state["m"],
        state["ma"],
        state["v"],
        state["va"],
        dim=dim,
        code_m=A8.dynamic_code(True, grad.device),
        code_v=A8.dynamic_code(False, grad.device),
        bounds_m=A8.code_bounds(True, grad.device),
        bounds_v=A8.code_bounds(False, grad.device),
        beta1=BETAS[0],
        beta2=BETAS[1],
        eps=EPS,
        step=step,
        out=out,
        into=(into["m"], into["ma"], into["v"], into["va"]),
    )
    assert all(torch.equal(state[k], before[k]) for k in state)  # inputs only read

    # Direction: both paths round the same fp32 operations (the kernel's sqrt and division
    # are correctly rounded, like torch's); only FMA contraction and lerp's internal order
    # may differ — a few ulps (2^-23 ≈ 1.2e-7) of O(1) values.
    torch.testing.assert_close(out, direction, rtol=1e-5, atol=1e-6)
    # absmax: the max |moment| of each block, of moments equal to within those ulps.
    torch.testing.assert_close(into["ma"], ref["ma"], rtol=2e-6, atol=0.0)
    torch.testing.assert_close(into["va"], ref["va"], rtol=2e-6, atol=0.0)
    for key, x, signed in (("m", m32, True), ("v", v32, False)):
        # Codes against the exact semantics (nearest code of the torch path's own fp32
        # moments): equal, but for a moment within an ulp of a midpoint between two codes
        # (at most 0.1% of elements, one code apart).
        exact, _ = _nearest_codes(x, dim, signed)
        diff = (into[key].int() - exact.int()).abs()
        assert int(diff.max()) <= 1 and int((diff > 0).sum()) <= 1e-3 * diff.numel()
        # ...and against the codes the torch path stores. bitsandbytes' CPU quantizer is not
        # exactly nearest (its search misses by a code or more on ~3% of elements of the
        # unsigned map): the dequantized values stay within 2 code gaps of each other.
        scale_key = key + "a"
        got = A8.dequantize(into[key], into[scale_key], dim, signed)
        want = A8.dequantize(ref[key], ref[scale_key], dim, signed)
        block_max = A8.dequantize(
            torch.full_like(ref[key], 255), ref[scale_key], dim, signed
        )  # code 255 is +1.0: each element's block absmax
        assert bool(((got - want).abs() <= 2 * MAX_GAP * block_max + 1e-30).all())
        assert int((into[key] != ref[key]).sum()) <= 0.05 * into[key].numel()
    zero = _zero_block_mask(shape, dim).to(DEVICE)
    assert bool((into["m"][zero] == 0).all() and (into["v"][zero] == 0).all())

    # Through the call site (ScaleByAdam.update with 8-bit moments, GALORE2_KERNELS=triton): in place,
    # bit-identical to the direct launch.
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    s = {
        "adam.exp_avg": before["m"].clone(),
        "adam.exp_avg.absmax": before["ma"].clone(),
        "adam.exp_avg_sq": before["v"].clone(),
        "adam.exp_avg_sq.absmax": before["va"].clone(),
        "adam.block_dim": torch.tensor(dim),
        "adam.step": torch.tensor(step - 1),
    }
    u = ScaleByAdam8bit().update(grad, s, {"betas": BETAS, "eps": EPS}, None)
    assert torch.equal(u, out) and int(s["adam.step"]) == step
    assert torch.equal(s["adam.exp_avg"], into["m"]) and torch.equal(
        s["adam.exp_avg_sq"], into["v"]
    )
    assert torch.equal(s["adam.exp_avg.absmax"], into["ma"])
    assert torch.equal(s["adam.exp_avg_sq.absmax"], into["va"])


def _kernel_maps(device) -> dict:
    return {
        "code_m": A8.dynamic_code(True, device), "code_v": A8.dynamic_code(False, device),
        "bounds_m": A8.code_bounds(True, device), "bounds_v": A8.code_bounds(False, device),
        "beta1": BETAS[0], "beta2": BETAS[1], "eps": EPS,
    }  # fmt: skip


@pytest.mark.parametrize("shape,dim", ADAM_CASES)
def test_triton_adam8bit_stack_is_bitwise_one_launch_per_matrix(shape, dim):
    """A stack of three directions in one launch (adam8bit_step_stack, the 8-bit moments of
    a GaLore shape batch): every matrix blocked on its own, the same bits as three
    adam8bit_step calls — direction, codes and absmax (bf16 directions, as projected)."""
    g = _gen(math.prod(shape) + 7 * dim)
    states = [_random_state(shape, dim, g, zero_blocks=j == 1) for j in range(3)]
    grads = torch.randn((3, *shape), generator=g).to(DEVICE, torch.bfloat16)
    stacks = {k: torch.stack([s[k] for s in states]) for k in ("m", "ma", "v", "va")}
    maps = _kernel_maps(grads.device)
    out = adam8bit_step_stack(grads, stacks["m"], stacks["ma"], stacks["v"], stacks["va"],
                              dim=dim, step=5, **maps)  # fmt: skip
    for j, s in enumerate(states):
        one = adam8bit_step(grads[j], s["m"], s["ma"], s["v"], s["va"], dim=dim, step=5, **maps)
        assert torch.equal(out[j], one)
        for k in ("m", "ma", "v", "va"):
            assert torch.equal(stacks[k][j], s[k]), k


# ---- back-projection epilogue ----------------------------------------------------------
# (M, N, K): a single partial tile, several tiles in both dims with K over the K-step and a
# remainder, a single row, a single column, rank 1.
LOWRANK_SHAPES = [(67, 45, 13), (130, 257, 40), (1, 300, 3), (150, 1, 17), (33, 70, 1)]


def _lowrank_tolerance(p, A, B, alpha, beta, dtype) -> torch.Tensor:
    """Elementwise bound on |kernel − torch|: a small multiple of the magnitude of the terms
    summed, |β·p| + |α|·(|A| @ |B|). fp32: both accumulate K ≤ 40 products in fp32 in different
    orders (≤ K·2^-24 ≈ 2.4e-6 of that magnitude). bf16/fp16: the kernel rounds once to the
    output dtype, torch's CPU addmm may round the product first — up to ~3 half-ulps (2^-8 for
    bf16) of the magnitude."""
    mag = (beta * p.double()).abs() + abs(alpha) * (A.double().abs() @ B.double().abs())
    rel = 1e-5 if dtype == torch.float32 else 2.0**-6
    return rel * mag + 1e-30


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", LOWRANK_SHAPES)
def test_triton_lowrank_epilogue_matches_addmm(M, N, K, dtype):
    g = _gen(M * 1000 + N * 10 + K)
    p = torch.randn(M, N, generator=g).to(DEVICE, dtype)
    A = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    B = torch.randn(N, K, generator=g).to(DEVICE, dtype).T  # a transposed (strided) B
    alpha, beta = -0.3, 0.97  # −lr·scale and decay = 1 − lr·λ, exaggerated
    ref = p.clone().addmm_(A, B, beta=beta, alpha=alpha)
    tol = _lowrank_tolerance(p, A, B, alpha, beta, dtype)

    out = torch.full_like(p, math.nan)  # out of place into a poisoned buffer
    lowrank_update(p, A, B, alpha=alpha, beta=beta, out=out)
    assert bool(((out.double() - ref.double()).abs() <= tol).all())
    inplace = p.clone()  # in place, as the optimizer applies it
    lowrank_update(inplace, A, B, alpha=alpha, beta=beta)
    assert torch.equal(inplace, out)

    # β = 0: p is not read (addmm ignores its input then), so a NaN p must not leak
    nan_p = torch.full_like(p, math.nan)
    lowrank_update(nan_p, A, B, alpha=alpha, beta=0.0)
    ref0 = torch.addmm(torch.zeros_like(p), A, B, beta=0.0, alpha=alpha)
    assert bool(((nan_p.double() - ref0.double()).abs() <= tol).all())


def test_triton_lowrank_through_apply_update(monkeypatch):
    """apply_update with GALORE2_KERNELS=triton: a non-contiguous A, a 3-D weight viewed 2-D."""
    g = _gen(3)
    p = torch.randn(6, 5, 7, generator=g).to(DEVICE)
    A = torch.randn(9, 6, generator=g).to(DEVICE).T
    B = torch.randn(9, 35, generator=g).to(DEVICE)
    u = LowRankUpdate(A, B, p.shape, scale=0.5)
    ref = p.clone()
    apply_update(ref, u, lr=0.1, decay=0.99)  # auto: CPU → torch (on CUDA, also triton)
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    torch_ref = p.clone()
    apply_update(torch_ref, u, lr=0.1, decay=0.99)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    got = p.clone()
    apply_update(got, u, lr=0.1, decay=0.99)
    tol = _lowrank_tolerance(p.view(6, 35), A, B, -0.05, 0.99, torch.float32).view(p.shape)
    assert bool(((got.double() - torch_ref.double()).abs() <= tol).all())
    assert bool(((ref.double() - torch_ref.double()).abs() <= tol).all())


# ---- Hadamard rotation -----------------------------------------------------------------
# (rows, r, block): full blocks only; blocks + a padded tail (r = 100 → 96 + 4; 37 → 32 + 8);
# a tail of 1 (33 = 32 + 1); one block; r below the block (tail only); r = 1; odd row counts.
HADAMARD_CASES = [
    (5, 64, 16),
    (7, 100, 32),
    (3, 37, 8),
    (9, 33, 32),
    (4, 256, 256),
    (3, 5, 8),
    (6, 1, 4),
]


@pytest.mark.parametrize("rows,r,block", HADAMARD_CASES)
def test_triton_hadamard_is_bitwise_the_torch_transform(rows, r, block, monkeypatch):
    g = _gen(rows * 100 + r)
    L = H.padded_length(r, block)
    wide = torch.randn(rows, L + 3, generator=g).to(DEVICE)
    x = wide[:, 1 : L + 1]  # a strided view
    signs = H.random_signs(rows + r, L, DEVICE)
    # Exact: the kernel's butterflies add the same operands in the same order as the torch
    # path (see galore2/kernels/hadamard.py); ±1 and 1/√n products round once in both.
    y = blockwise_fwht(
        x, block, signs, signs_first=True, out=torch.full((rows, L), math.nan, device=DEVICE)
    )
    assert torch.equal(y, H._blockwise_fwht(x * signs, block))
    z = blockwise_fwht(y, block, signs, signs_first=False, out=torch.full_like(y, math.nan))
    assert torch.equal(z, H._blockwise_fwht(y, block) * signs)
    torch.testing.assert_close(z, x, rtol=0, atol=1e-5)  # and it inverts rotate
    # through rotate / unrotate (the call sites)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    assert torch.equal(H.rotate(x, block, signs), y) and torch.equal(H.unrotate(y, block, signs), z)


# ---- the whole optimizer ---------------------------------------------------------------
def _exact_quantize_(x, codes, absmax, dim, signed):
    """A8.quantize_ with the exact nearest-code semantics (see _nearest_codes)."""
    q, scale = _nearest_codes(x, dim, signed)
    codes.copy_(q)
    absmax.copy_(scale)


def _galore_adamw8bit_run(
    monkeypatch, mode: str, device: str, dtype=torch.float32, sizes=(64, 160), rank=32
):
    """Three steps of GaLoreAdamW8bit (int8 Hadamard-rotated bases, weight decay) on a left-
    and a right-side weight (8-bit blocks along dim 0 and dim 1) with GALORE2_KERNELS=mode."""
    import galore2

    monkeypatch.setenv(dispatch.ENV_VAR, mode)
    g = _gen(11)
    m, n = sizes
    params = [
        torch.nn.Parameter((torch.randn(shape, generator=g) * 0.1).to(device, dtype))
        for shape in ((m, n), (n, m))
    ]
    opt = galore2.GaLoreAdamW8bit(
        [{"params": params, "rank": rank, "basis_dtype": "int8", "basis_hadamard": True}],
        lr=1e-2,
        weight_decay=0.1,
    )
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(device, dtype)
        opt.step()
    assert sorted(int(opt.state[p]["adam.block_dim"]) for p in params) == [0, 1]
    return [p.detach().float().cpu() for p in params]


def test_triton_kernels_in_a_galore_adamw8bit_run(monkeypatch):
    """Every kernel in the optimizer (GALORE2_KERNELS=triton) against the torch path.
    Parameters move by ~3·lr = 3e-2 in three steps. With the torch path's quantizer made
    exactly nearest the runs agree to fp32 rounding (interpreter: measured 3e-8, bound 1e-6,
    ulps of the direction times lr and of the parameters; on a GPU 2e-5, room for a rare
    code flip where the two paths' moments differ by an ulp next to a midpoint); with
    bitsandbytes' own quantizer (on the CPU a few % of second-moment codes off by up to 2
    gaps) to 5e-4 (5% of lr; measured 1.4e-4)."""
    got = _galore_adamw8bit_run(monkeypatch, "triton", DEVICE)
    loose = _galore_adamw8bit_run(monkeypatch, "torch", DEVICE)
    monkeypatch.setattr(A8, "quantize_", _exact_quantize_)
    exact = _galore_adamw8bit_run(monkeypatch, "torch", DEVICE)
    atol = 1e-6 if DEVICE == "cpu" else 2e-5
    for a, b, c in zip(got, exact, loose, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)
        torch.testing.assert_close(a, c, rtol=0, atol=5e-4)


# ---- AdamW of bf16 weights with fp32 moments ------------------------------------------
ADAMW_CASES = [(1,), (1000,), (3, 1111), (2 * 1024 + 5,)]  # not multiples of its block


@pytest.mark.parametrize("shape", ADAMW_CASES)
@pytest.mark.parametrize("step,decay", [(1, 1.0), (7, 1 - 1e-2 * 0.1)])
def test_triton_adamw_matches_the_torch_passes(shape, step, decay, monkeypatch):
    """galore2::adamw_'s kernel against the arithmetic it implements and the torch passes
    it replaces (the gradient cast to fp32, torch's fused Adam on the moments into a
    zeroed direction, the decay and the update of the bf16 weight).

    The moments against torch's CUDA formula in float64 (β's in float32, ``fma(β, x,
    fma(−β, y, y))``: weights β_f and 1 − β_f): within two roundings of the terms'
    magnitude, 2·2⁻²³·(β|x| + (1−β)|y|), since the sum may cancel. (torch's CPU kernel,
    the torch path here, weighs y by (1 − β) rounded from double: 1.3e-5 relative apart
    for β₂ = 0.999 — a CPU/GPU difference of torch's own.) The weights against the torch
    path: directions that far apart may round to a neighbouring bf16 value, so within one
    bf16 ulp (2⁻⁷ relative) — and almost all equal."""
    g = _gen(sum(shape) + step)
    p = (torch.randn(shape, generator=g) * 0.5).to(torch.bfloat16)
    grad = torch.randn(shape, generator=g).to(torch.bfloat16)
    m = torch.randn(shape, generator=g) * 0.1
    v = torch.rand(shape, generator=g) * 0.01
    args = (step, 1e-2, 0.9, 0.999, 1e-8, decay)
    ours = [t.clone().to(DEVICE) for t in (p, m, v)]
    ref = [t.clone() for t in (p, m, v)]
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    ops.adamw_([ours[0]], [grad.to(DEVICE)], [ours[1]], [ours[2]], *args)
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    ops.adamw_([ref[0]], [grad], [ref[1]], [ref[2]], *args)
    ours = [t.cpu() for t in ours]
    y = grad.double()
    for name, x, beta, got, sq in (("exp_avg", m, 0.9, ours[1], False),
                                   ("exp_avg_sq", v, 0.999, ours[2], True)):  # fmt: skip
        b = float(torch.tensor(beta, dtype=torch.float32))
        yy = y * y if sq else y
        exact = b * x.double() + (1 - b) * yy
        bound = 2 * 2**-23 * (b * x.double().abs() + (1 - b) * yy.abs())
        assert ((got.double() - exact).abs() <= bound).all(), name
    diff = (ours[0].float() - ref[0].float()).abs()
    assert (diff <= 2**-7 * ref[0].float().abs()).all()
    assert (diff > 0).float().mean() < 0.01
    assert not torch.equal(ours[0], p)  # it stepped


@pytest.mark.parametrize("shape", ADAMW_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_adam_directions_match_the_torch_passes(shape, dtype, monkeypatch):
    """galore2::adam_directions_'s kernel (moments, and the direction rounded to bf16)
    against the torch passes (the direction cast to fp32, torch's fused Adam into a zeroed
    buffer, the result cast to bf16): the moments within two roundings of their terms (see
    test_triton_adamw_matches_the_torch_passes), the bf16 directions within one bf16 ulp
    and almost all equal; every element of the out buffer (NaN-filled) written."""
    g = _gen(sum(shape) + 3)
    u = torch.randn(shape, generator=g).to(dtype)
    m = torch.randn(shape, generator=g) * 0.1
    v = torch.rand(shape, generator=g) * 0.01
    args = (3, 0.9, 0.999, 1e-8)
    ours = [t.clone().to(DEVICE) for t in (m, v)]
    out = torch.full(shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)
    ref = [t.clone() for t in (m, v)]
    ref_out = torch.full(shape, float("nan"), dtype=torch.bfloat16)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    ops.adam_directions_([u.to(DEVICE)], [ours[0]], [ours[1]], [out], *args)
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    ops.adam_directions_([u], [ref[0]], [ref[1]], [ref_out], *args)
    y = u.double()
    for name, x, beta, got, sq in (("exp_avg", m, 0.9, ours[0].cpu(), False),
                                   ("exp_avg_sq", v, 0.999, ours[1].cpu(), True)):  # fmt: skip
        b = float(torch.tensor(beta, dtype=torch.float32))
        yy = y * y if sq else y
        exact = b * x.double() + (1 - b) * yy
        bound = 2 * 2**-23 * (b * x.double().abs() + (1 - b) * yy.abs())
        assert ((got.double() - exact).abs() <= bound).all(), name
    out = out.cpu().float()
    assert out.isfinite().all()
    diff = (out - ref_out.float()).abs()
    assert (diff <= 2**-7 * ref_out.float().abs()).all()
    assert (diff > 0).float().mean() < 0.01


@pytest.mark.parametrize("decay", [1.0, 1 - 1e-2 * 0.1])
def test_triton_adamw_list_is_one_launch_with_the_bits_of_one_launch_a_weight(decay, monkeypatch):
    """galore2::adamw_ over a list (a plain group: sizes not multiples of the block, one
    weight smaller than a block, one of several blocks) runs ONE launch of the list kernel
    (a table of addresses read by each block), bit for bit what a launch per weight
    writes; a second step with the same tensors reuses the device table, and new
    gradients at other addresses build a new one."""
    from galore2.kernels import adamw as K

    g = _gen(11)
    shapes = [(3,), (1024,), (5, 333), (2 * 1024 + 5,)]
    ps = [(torch.randn(s, generator=g) * 0.5).to(torch.bfloat16) for s in shapes]
    grads = [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]
    ms = [torch.randn(s, generator=g) * 0.1 for s in shapes]
    vs = [torch.rand(s, generator=g) * 0.01 for s in shapes]
    args = (5, 1e-2, 0.9, 0.999, 1e-8, decay)
    listed = [[t.clone().to(DEVICE) for t in ts] for ts in (ps, grads, ms, vs)]
    each = [[t.clone().to(DEVICE) for t in ts] for ts in (ps, grads, ms, vs)]
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    tables.clear()
    launches = []
    real = K._adamw_list_kernel
    monkeypatch.setattr(K, "_adamw_list_kernel", _Spy(real, launches))
    ops.adamw_(*listed, *args)
    assert len(launches) == 1 and len(tables._TABLES) == 1
    for i in range(len(shapes)):
        ops.adamw_(*([ts[i]] for ts in each), *args)
    assert len(launches) == 1  # one weight: the kernel of one weight
    for a, b in zip(listed, each, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
    assert not torch.equal(listed[0][2], ps[2].to(DEVICE))  # it stepped
    ops.adamw_(*listed, *args)
    assert len(launches) == 2 and len(tables._TABLES) == 1  # the same addresses: kept
    listed[1] = [t.clone() for t in listed[1]]  # new gradients, elsewhere
    ops.adamw_(*listed, *args)
    assert len(launches) == 3 and len(tables._TABLES) == 2


class _Spy:
    """A Triton kernel whose launches (``kernel[grid](...)``) are recorded, then run."""

    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def run(*a, **k):
            self.launches.append(grid)
            return self.kernel[grid](*a, **k)

        return run


def test_triton_adamw_list_refuses_what_it_does_not_take():
    """A clear error before anything is written: lists of unequal lengths, a weight on
    another dtype; and the op falls back to a launch per weight for a list the list
    kernel does not take."""
    from galore2.kernels.adamw import adamw_list_step, supported_list

    p = torch.zeros(8, dtype=torch.bfloat16, device=DEVICE)
    m = torch.zeros(8, device=DEVICE)
    kw = {"step": 1, "lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "decay": 1.0}
    with pytest.raises(ValueError, match="lists of one length on one device"):
        adamw_list_step([p, p], [p], [m, m], [m, m], **kw)
    with pytest.raises(ValueError, match="lists of one length on one device"):
        adamw_list_step([p, p.half()], [p, p.half()], [m, m], [m, m], **kw)
    assert not supported_list([], [], [], [])
    assert not p.any() and not m.any()


def test_triton_adamw_refuses_what_it_does_not_take():
    """A clear error before anything is written: a fp16 weight, moments of another size."""
    p = torch.zeros(8, dtype=torch.bfloat16, device=DEVICE)
    m = torch.zeros(8, device=DEVICE)
    kw = {"step": 1, "lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "decay": 1.0}
    with pytest.raises(ValueError, match="a bf16 weight and gradient and float32 moments"):
        adamw_step(p.half(), p.half(), m, m, **kw)
    with pytest.raises(ValueError, match="of one size"):
        adamw_step(p, p, m[:4], m, **kw)
    with pytest.raises(ValueError, match=r"step counts this step \(>= 1\), got 0"):
        adamw_step(p, p, m, m, **{**kw, "step": 0})
    assert not p.any() and not m.any()


def test_kernel_failure_in_auto_mode_falls_back_to_torch_once(monkeypatch):
    """A kernel that fails to compile or launch (auto mode) is switched off with one warning
    per kernel and the torch path runs from untouched state: the run equals the torch
    path's bitwise. In triton mode the same failure propagates."""
    import warnings

    import galore2.kernels.adam8bit as k_adam
    import galore2.kernels.hadamard as k_had
    import galore2.kernels.lowrank as k_low

    def broken(*args, **kwargs):
        raise RuntimeError("PTX .version 9.9 does not support .target sm_xx")

    for module, name in ((k_adam, "adam8bit_step"), (k_had, "blockwise_fwht"),
                         (k_low, "lowrank_update")):  # fmt: skip
        monkeypatch.setattr(module, name, broken)
    # as if on a capable GPU: auto picks the kernels (every call site goes through
    # dispatch.run_kernel, which asks dispatch.use_triton)
    monkeypatch.setattr(dispatch, "use_triton", lambda *t: dispatch.kernel_mode() != "torch")
    monkeypatch.setattr(dispatch, "_DISABLED", {})
    ref = _galore_adamw8bit_run(monkeypatch, "torch", "cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _galore_adamw8bit_run(monkeypatch, "auto", "cpu")
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)
    named = sorted(str(w.message).split("'")[1] for w in caught if w.category is RuntimeWarning)
    # once each, not once per call; lowrank is not an auto kernel (AUTO = False): never tried
    assert named == ["adam8bit", "hadamard"]
    assert sorted(dispatch.disabled_kernels()) == ["adam8bit", "hadamard"]
    assert "sm_xx" in dispatch.disabled_kernels()["hadamard"]
    with pytest.raises(RuntimeError, match="sm_xx"):
        _galore_adamw8bit_run(monkeypatch, "triton", "cpu")


def test_auto_mode_leaves_out_kernels_measured_slower(monkeypatch):
    """``lowrank`` (AUTO = False: cuBLAS' addmm_ was faster on an H100) runs only when
    GALORE2_KERNELS=triton asks for it; auto takes the torch path even where Triton could run."""
    import galore2.kernels.lowrank as k_low

    calls = []
    monkeypatch.setattr(k_low, "lowrank_update", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(dispatch, "use_triton", lambda *t: dispatch.kernel_mode() != "torch")
    p, A, B = torch.zeros(4, 6), torch.ones(4, 2), torch.ones(2, 6)
    monkeypatch.setenv(dispatch.ENV_VAR, "auto")
    apply_update(p, LowRankUpdate(A, B, p.shape), lr=1.0, decay=1.0)
    assert calls == [] and torch.equal(p, torch.full((4, 6), -2.0))  # the torch path ran
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    apply_update(p, LowRankUpdate(A, B, p.shape), lr=1.0, decay=1.0)
    assert calls == [1]


# ---- GPU: automatic selection ----------------------------------------------------------
@pytest.mark.gpu
def test_triton_kernels_selected_automatically_on_cuda(monkeypatch):
    """On CUDA, GALORE2_KERNELS=auto picks the kernels: a GaLoreAdamW8bit run at larger
    sizes (rank 256: full 256-element blocks) against the torch path with an exactly
    nearest quantizer, in fp32 and bf16."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("automatic selection needs compute capability 8.0 or newer")
    if dispatch.interpreter_enabled():
        pytest.skip("TRITON_INTERPRET is set: kernels would be interpreted")
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert dispatch.use_triton(torch.zeros(1, device="cuda"))
    monkeypatch.setattr(A8, "quantize_", _exact_quantize_)  # the torch path, exactly nearest
    # fp32: rare code flips where the paths' moments differ by an ulp next to a midpoint
    # (each moves a row of p by ≲ 1e-5); bf16: 2 bf16 ulps (2^-7 relative spacing) of the
    # largest weights (|p| < 0.5: 2·2^-9 ≈ 4e-3), the two paths round p independently.
    for dtype, atol in ((torch.float32, 5e-5), (torch.bfloat16, 4e-3)):
        kw = {"device": "cuda", "dtype": dtype, "sizes": (512, 1280), "rank": 256}
        want = _galore_adamw8bit_run(monkeypatch, "torch", **kw)
        got = _galore_adamw8bit_run(monkeypatch, "auto", **kw)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=atol)


def test_kernel_modules_import_triton_lazily():
    """``import galore2`` does not import triton (installed here), and a CPU step loads none of
    the kernel modules (torch.optim itself may import triton, through torch._dynamo)."""
    kernels = ("galore2.kernels.adam8bit", "galore2.kernels.lowrank", "galore2.kernels.hadamard",
               "galore2.kernels.adamw")  # fmt: skip
    code = (
        "import sys, torch, galore2\n"
        "assert 'triton' not in sys.modules, 'import galore2 imported triton'\n"
        "p = torch.nn.Parameter(torch.randn(8, 12))\n"
        "opt = galore2.GaLoreAdamW([{'params': [p], 'rank': 2, 'basis_dtype': 'int8',"
        " 'basis_hadamard': True}])\n"
        "p.grad = torch.randn_like(p)\n"
        "opt.step()\n"
        f"assert not [m for m in {kernels!r} if m in sys.modules], 'a kernel module was loaded'\n"
        "print('ok')\n"
    )
    assert run_python(code).strip().endswith("ok")
