"""A shape batch's projections with the channel norms of their residuals and of themselves
(``galore2.kernels.project_norms_list``), one launch, against float64 math on the same
(rounded) operands.

Left bases (``R = PᵀG``, norms per column) and right ones (``R = GQ``, per row); gradients
and projections as views of a NaN-framed stack or as separate tensors in a transposed
layout (``tests/kernels/lists.py``), bases as views of one stack (strided) or separate
tensors, orthonormal or not. The projection is not compared bitwise with
``lowrank_list``'s: the same K loop (``tile_product``, the same K steps) on tiles of other
shapes, whose ``tl.dot`` may sum a step's products in another order (it does under the
interpreter: numpy's matmul; on a GPU other MMA shapes), so both are bounded against float64
instead. Without a GPU the kernel runs on CPU tensors under Triton's interpreter
(tests/conftest.py sets ``TRITON_INTERPRET=1``); on a CUDA machine on the GPU.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

if sys.platform != "linux":  # triton ships Linux wheels only
    pytest.skip("triton is only installed on Linux", allow_module_level=True)

from galore2.kernels import project_norms_list as PN

from .lists import U32, K, fresh_tables, gen, matrices, unchanged_frame  # noqa: F401
from .test_triton_kernels import DEVICE, _Spy

#: one rounding to each dtype, relative (half an ulp: 2^-precision), and absolute below its
#: normal range (half the subnormal spacing)
ROUND = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
TINY = {torch.float32: 2.0**-150, torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25}
#: (m, n, r, c, layout, orthonormal): tiles with remainders and a K loop of several steps;
#: one tile, a short rank and a random basis; a single row (a random basis: r > 1 row for a
#: left one); a rank of 129–256 (R's 256-row tile, its 32 channels) at a small m × n; c = 0
CASES = {
    "100x70_r24": (100, 70, 24, -1.0, "stack", True),
    "67x45_r13_random": (67, 45, 13, -0.25, "separate_t", False),
    "1x70_r3": (1, 70, 3, -1.0, "stack", True),
    "24x40_r150": (24, 40, 150, -0.25, "separate_t", True),
    # c = 0: G's own channel norms (APOLLO's limiter), a random basis as APOLLO's
    "70x45_r13_c0": (70, 45, 13, 0.0, "stack", False),
}


@pytest.fixture
def launches(monkeypatch) -> list:
    """The grids of the kernel's launches, in order."""
    seen: list = []
    monkeypatch.setattr(PN, "_project_norms_kernel", _Spy(PN._project_norms_kernel, seen))
    return seen


def _bases(rows: int, r: int, dtype, layout: str, orthonormal: bool, seed: int) -> list:
    """K rows × r bases in ``dtype``: orthonormal columns where asked and rows ≥ r (random
    otherwise); ``stack`` — views of one stack stored transposed (strides (1, rows)),
    ``separate_t`` — separate contiguous tensors."""
    g = gen(seed)
    xs = [torch.randn(rows, r, generator=g, dtype=torch.float64) for _ in range(K)]
    if orthonormal and rows >= r:
        xs = [torch.linalg.qr(x).Q for x in xs]
    if layout == "stack":
        return list(torch.stack([x.T for x in xs]).to(DEVICE, dtype).mT.unbind(0))
    return [x.to(DEVICE, dtype).contiguous() for x in xs]


def _norms_out(shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A (K, ·, ·) float32 output written through a permuted view (no unit stride)
    interleaved with NaN, and its buffer."""
    buf = torch.full((shape[2], shape[1], shape[0], 2), math.nan, device=DEVICE)
    return buf[..., 0].permute(2, 1, 0), buf


def _run(dim: int, dtype, m: int, n: int, r: int, c: float, layout: str, orthonormal: bool,
         basis_dtype, launches: list) -> None:  # fmt: skip
    """One launch for K entries, checked against float64 math: the projection within its
    float32 sum and one rounding to G's dtype, the residual's norms (on the kernel's own
    rounded R) within the float32 error of each element and of the sum of squares, R's norms
    within that of the sum of squares."""
    Gs, gbuf = matrices(m, n, dtype, layout, seed=m * 7 + n + r + dim)
    g_before = [g.clone() for g in Gs]
    Bs = _bases(m if dim == 0 else n, r, basis_dtype, layout, orthonormal, seed=r + dim)
    o_shape = (r, n) if dim == 0 else (m, r)
    o_layout = "separate_t" if layout == "stack" else "stack"
    outs, obuf = matrices(*o_shape, dtype, o_layout, seed=r)
    for o in outs:
        o.fill_(math.nan)
    shape = (K, 1, n) if dim == 0 else (K, m, 1)
    (norms, nbuf), (r_norms, rbuf) = _norms_out(shape), _norms_out(shape)

    assert PN.supported_project_norms(Gs, Bs, outs, dim, norms, r_norms)
    assert PN.project_norms_list(Gs, Bs, outs, c, dim, norms, r_norms) is True
    channels = n if dim == 0 else m
    assert launches == [(K * -(-channels // PN.config(dtype, None, r)["BLOCK_C"]),)]

    reduced = m if dim == 0 else n  # the projection's sum, and the residual's norm's
    for i, (g, b, o) in enumerate(zip(Gs, Bs, outs, strict=True)):
        g64, b64, o64 = g.double(), b.to(dtype).double(), o.double()
        # the projection: float32 sums of `reduced` products, one rounding to G's dtype
        ref = b64.T @ g64 if dim == 0 else g64 @ b64
        mag = b64.abs().T @ g64.abs() if dim == 0 else g64.abs() @ b64.abs()
        err = (reduced + 2) * U32 * mag
        tol = err + ROUND[dtype] * (ref.abs() + err) + TINY[dtype]
        assert bool(((o64 - ref).abs() <= tol).all()), (o64 - ref).abs().max()
        # the residual G + c·B·R on the R stored: each element a float32 sum of r products
        # and G, then the sum of `reduced` squares and the square root
        back = b64 @ o64 if dim == 0 else o64 @ b64.T
        back_mag = b64.abs() @ o64.abs() if dim == 0 else o64.abs() @ b64.abs().T
        ref = torch.linalg.vector_norm(g64 + c * back, dim=dim, keepdim=True)
        elem = (r + 2) * U32 * (g64.abs() + abs(c) * back_mag)
        spread = torch.linalg.vector_norm(elem, dim=dim, keepdim=True)
        tol = spread + (reduced + 2) * U32 * (ref + spread)
        got = norms[i].double()
        assert bool(((got - ref).abs() <= tol).all()), (got - ref).abs().max()
        # R's norms: r exact squares (R's values are float32's), summed, the square root
        ref = torch.linalg.vector_norm(o64, dim=dim, keepdim=True)
        got = r_norms[i].double()
        assert bool(((got - ref).abs() <= (r + 2) * U32 * ref).all()), (got - ref).abs().max()
    assert bool(nbuf[..., 1].isnan().all()) and bool(rbuf[..., 1].isnan().all())
    assert unchanged_frame(gbuf, m, n) and unchanged_frame(obuf, *o_shape)
    assert all(torch.equal(g, x) for g, x in zip(Gs, g_before, strict=True))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", [0, 1], ids=["left", "right"])
def test_project_norms_match_float64(dim, dtype, case, launches):
    """float32 and bf16 gradients with float32 bases (rounded to bf16 as the kernel loads
    them for a bf16 G), per column with a left basis and per row with a right one."""
    _run(dim, dtype, *CASES[case], torch.float32, launches)


@pytest.mark.parametrize("dim", [0, 1], ids=["left", "right"])
def test_fp16_gradients(dim, launches):
    """fp16 gradients and bases (products exact in float32; R rounded to fp16)."""
    _run(dim, torch.float16, *CASES["67x45_r13_random"], torch.float16, launches)


def test_project_norms_refuse_what_they_do_not_take():
    """Each unsupported input: ``supported_project_norms`` is False and
    ``project_norms_list`` raises a ValueError naming what it takes, before outs, norms or
    r_norms is written."""
    m, n, r = 20, 12, 4
    Gs, _ = matrices(m, n, torch.float32, "stack", seed=51)
    Bs = _bases(m, r, torch.float32, "separate_t", True, seed=52)
    outs = [torch.full((r, n), math.nan, device=DEVICE) for _ in range(K)]
    norms = torch.full((K, 1, n), math.nan, device=DEVICE)
    r_norms = torch.full((K, 1, n), math.nan, device=DEVICE)
    g16 = [g.half() for g in Gs]
    gbf = [g.bfloat16() for g in Gs]
    wide = _bases(m, 257, torch.float32, "separate_t", False, seed=53)
    wide_outs = [torch.full((257, n), math.nan, device=DEVICE) for _ in range(K)]
    mixed = [Bs[0], Bs[1].mT.contiguous().mT, Bs[2]]
    lists = "lists of one length"
    bad = [
        ((Gs[:1], Bs[:1], outs[:1], 0, norms[:1], r_norms[:1]), lists),
        ((Gs, Bs[:2], outs, 0, norms, r_norms), lists),
        ((Gs, [b[:, :0] for b in Bs], [o[:0] for o in outs], 0, norms, r_norms), "rank of 1"),
        ((Gs, Bs, [o[:, :-1] for o in outs], 0, norms, r_norms), "P m × r and outs r × n"),
        ((Gs, Bs, outs, 1, r_norms, r_norms), "Q n × r and outs m × r"),
        ((g16, Bs, [o.half() for o in outs], 0, norms, r_norms), "float32 for a bf16 G"),
        ((Gs, [b.bfloat16() for b in Bs], outs, 0, norms, r_norms), "Bs of G's dtype"),
        (([g.double() for g in Gs], Bs, outs, 0, norms, r_norms), "of one dtype among"),
        ((Gs, mixed, outs, 0, norms, r_norms), "one shape and strides"),
        ((gbf, Bs, outs, 0, norms, r_norms), "outs must be of G's dtype"),
        ((Gs, Bs, [outs[0], outs[0], outs[1]], 0, norms, r_norms), "distinct"),
        ((Gs, wide, wide_outs, 0, norms, r_norms), "a rank above 256"),
        ((Gs, Bs, outs, 2, norms, r_norms), "dim must be 0"),
        ((Gs, Bs, outs, True, norms, r_norms), "dim must be 0"),
        ((Gs, Bs, outs, 0, norms.mT, r_norms), r"norms must be a float32 .*\(3, 1, 12\)"),
        ((Gs, Bs, outs, 0, norms, r_norms.double()), "r_norms must be a float32 tensor"),
    ]
    keep = [*outs, *wide_outs, norms, r_norms]
    for args, match in bad:
        assert not PN.supported_project_norms(*args), match
        Gs_, Bs_, outs_, dim, n_, rn_ = args
        with pytest.raises(ValueError, match=f"project_norms_list: .*{match}"):
            PN.project_norms_list(Gs_, Bs_, outs_, -1.0, dim, n_, rn_)
        assert all(bool(t.isnan().all()) for t in keep)


def test_rank_strides_must_fit_int32_offsets():
    """A 256-row tile of R: strides along the rank of 2**23 elements (below 2**24, but ×256
    past int32) are refused (meta tensors: nothing allocated, nothing launched)."""
    m, n, r = 20, 12, 200
    Gs = [torch.empty(m, n, device="meta") for _ in range(K)]
    Bs = [torch.empty_strided((m, r), (1, 2**23), device="meta") for _ in range(K)]
    outs = [torch.empty(r, n, device="meta") for _ in range(K)]
    norms = torch.empty(K, 1, n, device="meta")
    assert not PN.supported_project_norms(Gs, Bs, outs, 0, norms, norms)
    with pytest.raises(ValueError, match=r"project_norms_list: strides along the rank of 2\*\*23 "):
        PN.project_norms_list(Gs, Bs, outs, -1.0, 0, norms, norms)
