"""Fira's grouped kernels: the back-projection with the scaled residual term
(``galore2.kernels.lowrank_list.addmm_scaled_list``) and the channel norms of the residuals
(``galore2.kernels.residual_list``), each one launch per list, against float64 math on the
same (rounded) operands.

Left bases (``P·X``, ``G − P·R``) and right ones (``X·Qᵀ``, ``G − R·Qᵀ``, Q stored n × r and
given as a transposed view); weights and gradients as views of a NaN-framed stack or as
separate tensors in a transposed layout (``tests/kernels/lists.py``). Without a GPU the
kernels run on CPU tensors under Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1``); on a CUDA machine on the GPU.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

if sys.platform != "linux":  # triton ships Linux wheels only
    pytest.skip("triton is only installed on Linux", allow_module_level=True)

from galore2.kernels import lowrank_list as L
from galore2.kernels import residual_list as RL

from . import lists
from .lists import U32, K, factors, fresh_tables, gen, matrices, unchanged_frame  # noqa: F401
from .test_triton_kernels import DEVICE, _Spy

#: one rounding to each dtype, relative (half an ulp: 2^-precision)
ROUND = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}
#: (side, m, n, r): tiles with remainders each way and a K loop of several steps; one tile
#: and a short rank; a single row
CASES = [("left", 100, 70, 24), ("right", 67, 45, 13), ("right", 1, 70, 3)]


@pytest.fixture
def launches(monkeypatch) -> list:
    """The grids of both kernels' launches, in order."""
    seen: list = []
    monkeypatch.setattr(L, "_lowrank_list_kernel", _Spy(L._lowrank_list_kernel, seen))
    monkeypatch.setattr(RL, "_residual_norms_kernel", _Spy(RL._residual_norms_kernel, seen))
    return seen


def _basis(rows: int, r: int, seed: int) -> torch.Tensor:
    """A float32 rows × r basis with orthonormal columns where rows ≥ r (random otherwise)."""
    x = torch.randn(rows, r, generator=gen(seed), dtype=torch.float64)
    return (torch.linalg.qr(x).Q if rows >= r else x).float()


def _operands(side: str, m: int, n: int, r: int, small: torch.Tensor | list, dtype, seed):
    """As and Bs of a list (K entries): ``P_i @ small_i`` (left: P m × r, small r × n) or
    ``small_i @ Q_iᵀ`` (right: small m × r, Q n × r stored as one stack, Qᵀ a strided
    view). Bases are float32 (rounded to bf16 by the kernels for bf16 outputs); ``small``
    is a list of tensors, or a K × · × · float64 stack cast to ``dtype``."""
    if isinstance(small, torch.Tensor):
        small = [s.to(DEVICE, dtype) for s in small]
    if side == "left":
        return [_basis(m, r, seed + i).to(DEVICE) for i in range(K)], small
    qs = torch.stack([_basis(n, r, seed + i) for i in range(K)]).to(DEVICE)
    return small, list(qs.mT.unbind(0))


def _rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in float64 after a rounding to ``dtype`` (what the kernels multiply)."""
    return t.to(dtype).double()


# ---- the back-projection with the scaled term -------------------------------------------
@pytest.mark.parametrize(
    "kind,beta",
    [("column", 0.9), ("row", 1.0), ("matrix", 0.0)],
    ids=["column_decay", "row_beta1", "matrix_beta0"],
)
@lists.WEIGHT_AND_GRADIENT_DTYPES
@pytest.mark.parametrize("side,m,n,r", CASES[:2], ids=["left", "right"])
def test_addmm_scaled_matches_float64(side, m, n, r, p_dtype, g_dtype, kind, beta, launches):
    """``p ← β·p + α·(A @ B) + γ·G ⊙ f`` in one launch: within one rounding to p's dtype of
    float64 math on the same operands (a float32 basis rounded to bf16 for bf16 weights),
    plus float32 errors of a few 2⁻²⁴ per product summed, of |β·p| + |α|·|A|@|B| + |γ·G·f|.
    With β = 0 the weights are NaN and not read. The NaN frame of stacked weights stays
    NaN (nothing written outside the matrices)."""
    p_layout, g_layout = ("stack", "separate_t") if side == "left" else ("separate_t", "stack")
    ps, pbuf = matrices(m, n, p_dtype, p_layout, seed=m + n)
    Gs, gbuf = matrices(m, n, g_dtype, g_layout, seed=m + n + 1)
    if beta == 0:
        for p in ps:
            p.fill_(math.nan)
    small_shape = (K, r, n) if side == "left" else (K, m, r)
    small = torch.randn(small_shape, generator=gen(m * n), dtype=torch.float64)
    As, Bs = _operands(side, m, n, r, small, p_dtype, seed=r)
    factor = factors(kind, m, n, seed=m + r)
    alpha, gamma = -0.3, 0.7
    rounded = [(_rounded(a, p_dtype), _rounded(b, p_dtype)) for a, b in zip(As, Bs, strict=True)]
    q = [beta * p.double() if beta != 0 else torch.zeros(m, n, dtype=torch.float64) for p in ps]
    gf = [gamma * g.double() * f.double() for g, f in zip(Gs, factor, strict=True)]
    refs = [x + alpha * (a @ b) + y for x, (a, b), y in zip(q, rounded, gf, strict=True)]
    mags = [x.abs() + abs(alpha) * (a.abs() @ b.abs()) + y.abs()
            for x, (a, b), y in zip(q, rounded, gf, strict=True)]  # fmt: skip

    assert L.supported_scaled_list(ps, As, Bs, Gs, factor)
    assert L.addmm_scaled_list(ps, As, Bs, Gs, factor, alpha=alpha, beta=beta, gamma=gamma)
    assert len(launches) == 1  # one launch for the list
    for got, ref, mag in zip(ps, refs, mags, strict=True):
        err = (r + 4) * U32 * mag  # the float32 sum before the rounding
        tol = err + ROUND[p_dtype] * (ref.abs() + err)
        assert bool(((got.double() - ref).abs() <= tol).all()), (got.double() - ref).abs().max()
    assert unchanged_frame(pbuf, m, n) and unchanged_frame(gbuf, m, n)


def test_gamma_zero_is_the_grouped_back_projection_bitwise(launches):
    """With γ = 0 the epilogue adds nothing: bitwise what ``lowrank_list`` writes (the same
    tile function, the same product)."""
    m, n, r = 67, 45, 13
    ps, _ = matrices(m, n, torch.float32, "separate_t", seed=11)
    Gs, _ = matrices(m, n, torch.float32, "stack", seed=12)
    small = torch.randn(K, r, n, generator=gen(13), dtype=torch.float64)
    As, Bs = _operands("left", m, n, r, small, torch.float32, seed=14)
    want = [p.clone() for p in ps]
    L.lowrank_list(want, want, As, Bs, alpha=-0.3, beta=0.9)
    factor = factors("row", m, n, seed=15)
    L.addmm_scaled_list(ps, As, Bs, Gs, factor, alpha=-0.3, beta=0.9, gamma=0.0)
    assert len(launches) == 2
    assert all(torch.equal(a, b) for a, b in zip(ps, want, strict=True))


def test_the_scaled_sum_is_rounded_once_to_nearest_even():
    """bf16 weights 1 + 2⁻⁷, no product, γ·g·f = 2⁻⁸: the float32 sum 1 + 2⁻⁷ + 2⁻⁸ is a tie,
    rounded to even 1 + 2⁻⁶ (the interpreter's cast would truncate to 1 + 2⁻⁷; rounding
    γ·g·f or the product to bf16 first changes nothing here: both are exact)."""
    ps = [torch.full((5, 70), 1 + 2**-7, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    Gs = [torch.full((5, 70), 2**-9, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    As = [torch.zeros(5, 2, device=DEVICE) for _ in range(2)]
    Bs = [torch.ones(2, 70, device=DEVICE) for _ in range(2)]
    factor = torch.full((2, 1, 1), 2.0, device=DEVICE)
    L.addmm_scaled_list(ps, As, Bs, Gs, factor, alpha=1.0, beta=1.0, gamma=1.0)
    for p in ps:
        assert torch.equal(p, torch.full_like(p, 1 + 2**-6))


def test_addmm_scaled_refuses_what_it_does_not_take():
    """Each unsupported input: ``supported_scaled_list`` is False and ``addmm_scaled_list``
    raises a ValueError naming what it takes, before any weight is written."""
    m, n, r = 20, 12, 4
    ps, _ = matrices(m, n, torch.float32, "separate_t", seed=21)
    Gs, _ = matrices(m, n, torch.float32, "stack", seed=22)
    small = torch.randn(K, r, n, generator=gen(23), dtype=torch.float64)
    As, Bs = _operands("left", m, n, r, small, torch.float32, seed=24)
    f = factors("column", m, n, seed=25)
    half = [p.half() for p in ps]
    bad = [
        ((ps[:1], As[:1], Bs[:1], Gs[:1], f[:1]), "lists of one length"),
        (([ps[0], ps[0], ps[1]], As, Bs, Gs, f), "distinct"),
        ((ps, As, Bs, Gs[:2], f), f"list of {K} tensors"),
        ((ps, As, Bs, [g[:, :-1] for g in Gs], f), "of ps' shape"),
        ((ps, As, Bs, [g.double() for g in Gs], f), "of one dtype among"),
        ((ps, As, Bs, [Gs[0], Gs[1].contiguous(), Gs[2]], f), "one strides"),
        ((ps, As, Bs, Gs, f.double()), "factor must be a float32 tensor"),
        ((ps, As, Bs, Gs, torch.ones(K, m, n, device=DEVICE)), r"shape \(3, 1, 12\)"),
        ((half, As, [b.half() for b in Bs], [g.half() for g in Gs], f), "float32 for bf16"),
    ]
    for args, match in bad:
        assert not L.supported_scaled_list(*args)
        before = [p.clone() for p in args[0]]
        with pytest.raises(ValueError, match=f"addmm_scaled_list: .*{match}"):
            L.addmm_scaled_list(*args, alpha=1.0, beta=1.0, gamma=1.0)
        assert all(torch.equal(p, x) for p, x in zip(args[0], before, strict=True))


# ---- the residuals' channel norms --------------------------------------------------------
@pytest.mark.parametrize("dim", [0, 1], ids=["per_column", "per_row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("side,m,n,r", CASES, ids=["left", "right", "right_one_row"])
def test_residual_norms_match_float64(side, m, n, r, dtype, dim, launches):
    """``‖G − P·R‖`` (left, R = PᵀG: the true residual outside the subspace) and
    ``‖G − ¼·R·Qᵀ‖`` (right, R random: fira_reference's c = −α) per column or per row, in
    one launch, written through ``out``'s strides (a permuted view interleaved with NaN that
    must stay NaN): within the float32 error of each element (a sum of r products and G,
    (r + 2)·2⁻²⁴ of |G| + |c|·|A|@|B|, its norm over the reduced elements) plus that of the
    sum of squares and the square root ((R + 2)·2⁻²⁴ relative). Operands are float32 bases
    and R in G's dtype (rounded to bf16 for a bf16 G)."""
    layout = "stack" if side == "left" else "separate_t"
    Gs, gbuf = matrices(m, n, dtype, layout, seed=m * 7 + n + dim)
    c = -1.0 if side == "left" else -0.25
    if side == "left":  # R = PᵀG, float32 (the basis against the gradient)
        small = [(_basis(m, r, r + i).double().T @ g.double()).float() for i, g in enumerate(Gs)]
    else:
        small = torch.randn(K, m, r, generator=gen(m + r), dtype=torch.float64)
    As, Bs = _operands(side, m, n, r, small, dtype, seed=r)
    shape = (K, 1, n) if dim == 0 else (K, m, 1)
    buf = torch.full((shape[2], shape[1], K, 2), math.nan, device=DEVICE)
    out = buf[..., 0].permute(2, 1, 0)  # shape (K, ·, ·), no unit stride
    assert RL.supported_residual(Gs, As, Bs, dim, out)
    assert RL.residual_norms_list(Gs, As, Bs, c, dim, out) is True
    assert launches == [(K * -(-(n if dim == 0 else m) // RL.config(dtype, None)["BLOCK_C"]),)]

    reduced = m if dim == 0 else n
    for i, (g, a, b) in enumerate(zip(Gs, As, Bs, strict=True)):
        a64, b64 = _rounded(a, dtype), _rounded(b, dtype)
        ref = torch.linalg.vector_norm(g.double() + c * (a64 @ b64), dim=dim, keepdim=True)
        elem = (r + 2) * U32 * (g.double().abs() + abs(c) * (a64.abs() @ b64.abs()))
        spread = torch.linalg.vector_norm(elem, dim=dim, keepdim=True)
        tol = spread + (reduced + 2) * U32 * (ref + spread)
        got = out[i].double()
        assert bool(((got - ref).abs() <= tol).all()), (got - ref).abs().max()
    assert bool(buf[..., 1].isnan().all())
    assert unchanged_frame(gbuf, m, n)


def test_residual_norms_refuse_what_they_do_not_take():
    """Each unsupported input: ``supported_residual`` is False and ``residual_norms_list``
    raises a ValueError naming what it takes, before ``out`` is written."""
    m, n, r = 20, 12, 4
    Gs, _ = matrices(m, n, torch.float32, "stack", seed=31)
    small = torch.randn(K, r, n, generator=gen(32), dtype=torch.float64)
    As, Bs = _operands("left", m, n, r, small, torch.float32, seed=33)
    out = torch.full((K, 1, n), math.nan, device=DEVICE)
    g16 = [g.half() for g in Gs]
    bad = [
        ((Gs[:1], As[:1], Bs[:1], 0, out[:1]), "lists of one length"),
        ((Gs, [a[:, :0] for a in As], [b[:0] for b in Bs], 0, out), "rank of 1 or more"),
        ((Gs, As, [b[:, :-1] for b in Bs], 0, out), "A @ B of G's shape"),
        ((g16, As, [b.half() for b in Bs], 0, out), "float32 for a bf16 G"),
        ((Gs, As, Bs, 2, out), "dim must be 0"),
        ((Gs, As, Bs, True, out), "dim must be 0"),
        ((Gs, As, Bs, 1, out), r"shape \(3, 20, 1\)"),
        ((Gs, As, Bs, 0, out.double()), "out must be a float32 tensor"),
    ]
    for args, match in bad:
        assert not RL.supported_residual(*args)
        with pytest.raises(ValueError, match=f"residual_norms_list: .*{match}"):
            RL.residual_norms_list(args[0], args[1], args[2], -1.0, args[3], args[4])
        assert bool(out.isnan().all())


def test_fp16_gradients(launches):
    """fp16 gradients: upcast in the scaled term of float32 weights, and the residual's
    operands in fp16 (its products exact in float32), within the bounds above."""
    m, n, r = 67, 45, 13
    ps, _ = matrices(m, n, torch.float32, "stack", seed=41)
    Gs, _ = matrices(m, n, torch.float16, "separate_t", seed=42)
    small = torch.randn(K, r, n, generator=gen(43), dtype=torch.float64)
    As, Bs = _operands("left", m, n, r, small, torch.float32, seed=44)
    factor = factors("column", m, n, seed=45)
    terms = [(p.double(), -0.5 * (a.double() @ b.double()), 0.25 * g.double() * f.double())
             for p, a, b, g, f in zip(ps, As, Bs, Gs, factor, strict=True)]  # fmt: skip
    mags = [p.abs() + 0.5 * (a.double().abs() @ b.double().abs()) + y.abs()
            for (p, _, y), a, b in zip(terms, As, Bs, strict=True)]  # fmt: skip
    L.addmm_scaled_list(ps, As, Bs, Gs, factor, alpha=-0.5, beta=1.0, gamma=0.25)
    for got, (p, x, y), mag in zip(ps, terms, mags, strict=True):
        ref = p + x + y
        err = (r + 4) * U32 * mag
        assert bool(((got.double() - ref).abs() <= err + U32 * (ref.abs() + err)).all())

    As16, Bs16 = [a.half() for a in As], [b.half() for b in Bs]
    out = torch.empty(K, m, 1, device=DEVICE)
    RL.residual_norms_list(Gs, As16, Bs16, -1.0, 1, out)
    assert len(launches) == 2
    for g, a, b, got in zip(Gs, As16, Bs16, out, strict=True):
        a64, b64 = a.double(), b.double()
        ref = torch.linalg.vector_norm(g.double() - a64 @ b64, dim=1, keepdim=True)
        elem = (r + 2) * U32 * (g.double().abs() + a64.abs() @ b64.abs())
        spread = torch.linalg.vector_norm(elem, dim=1, keepdim=True)
        tol = spread + (n + 2) * U32 * (ref + spread)
        assert bool(((got.double() - ref).abs() <= tol).all())
