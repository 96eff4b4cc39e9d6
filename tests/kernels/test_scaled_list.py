"""APOLLO's grouped kernels (``galore2.kernels.scaled_list``): a list's channel norms and its
scaled update, each in one launch, against float64 math on the same inputs and against
torch's ``p.mul_(β); p.addcmul_(G, f, value=α)``.

Without a GPU the kernels run on CPU tensors under Triton's interpreter (tests/conftest.py
sets ``TRITON_INTERPRET=1``); on a CUDA machine on the GPU. Sizes are not multiples of the
64 × 64 tiles; strided entries sit inside NaN-filled buffers, so an element read or written
outside its matrix shows up.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

if sys.platform != "linux":  # triton ships Linux wheels only
    pytest.skip("triton is only installed on Linux", allow_module_level=True)

from galore2.kernels import scaled_list as S
from galore2.kernels import tables

from . import lists
from .lists import U32, K, factors, fresh_tables, gen, matrices, unchanged_frame  # noqa: F401
from .test_triton_kernels import DEVICE, _Spy

# (m, n): a partial tile each way; 3 × 2 tiles with remainders; a single row
SHAPES = [(67, 45), (130, 70), (1, 70)]
# mantissa bits of each dtype: one rounding to it is within 2**-bits relative
BITS = {torch.float32: 23, torch.bfloat16: 7}


@pytest.fixture
def launches(monkeypatch) -> list:
    """The grids of both kernels' launches, in order."""
    seen: list = []
    for name in ("_norms_kernel", "_scaled_kernel"):
        monkeypatch.setattr(S, name, _Spy(getattr(S, name), seen))
    return seen


def _tiles(size: int) -> int:
    return -(-size // S.BLOCK)


# ---- channel norms -------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["stack", "separate_t"])
@pytest.mark.parametrize("dim", [0, 1], ids=["per_column", "per_row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,n", SHAPES)
def test_channel_norms_match_float64(m, n, dtype, dim, layout, launches):
    """Every entry's norms per column (dim 0) or per row (dim 1), written through ``out``'s
    strides (a permuted view interleaved with NaN that must stay NaN), within the float32
    bound of a sum of R non-negative squares and a square root: (R + 2)·2⁻²⁴ relative."""
    Gs, gbuf = matrices(m, n, dtype, layout, seed=m * 1000 + n + dim)
    shape = (K, 1, n) if dim == 0 else (K, m, 1)
    buf = torch.full((shape[2], shape[1], K, 2), math.nan, device=DEVICE)
    out = buf[..., 0].permute(2, 1, 0)  # shape (K, ·, ·), no unit stride
    assert S.supported_norms(Gs, dim, out)
    assert S.channel_norms_list(Gs, dim, out) is True
    assert launches == [(K * _tiles(n if dim == 0 else m),)]  # one launch for the list
    ref = torch.stack([torch.linalg.vector_norm(g.double(), dim=dim, keepdim=True) for g in Gs])
    reduced = m if dim == 0 else n
    tol = (reduced + 2) * U32 * ref
    assert bool(((out.double() - ref).abs() <= tol).all()), (out.double() - ref).abs().max()
    assert bool(buf[..., 1].isnan().all())
    assert unchanged_frame(gbuf, m, n)


# ---- scaled update -------------------------------------------------------------------
@pytest.mark.parametrize("beta", [1.0, 0.9])
@pytest.mark.parametrize("kind", ["column", "row", "matrix"])
@lists.WEIGHT_AND_GRADIENT_DTYPES
def test_scaled_add_matches_torch_and_float64(p_dtype, g_dtype, kind, beta, launches):
    """``p ← round(q + α·g·f)`` with q = p (β = 1) or torch's ``p.mul_(β)``: within one
    rounding of p's dtype of torch's ``mul_`` + ``addcmul_`` and of float64 math on the same
    q, plus the float32 roundings before it (α, α·g, the sum: a few 2⁻²⁴ of |q| + |α·g·f|,
    which may cancel). The weights and the gradients take both layouts (a NaN-framed stack,
    separate transposed tensors)."""
    m, n = 130, 70
    p_layout, g_layout = ("separate_t", "stack") if beta == 1 else ("stack", "separate_t")
    ps, pbuf = matrices(m, n, p_dtype, p_layout, seed=1)
    Gs, gbuf = matrices(m, n, g_dtype, g_layout, seed=2)
    factor = factors(kind, m, n, seed=3)
    alpha = -0.37
    qs = [p.clone() if beta == 1 else p.clone().mul_(beta) for p in ps]
    expected = [
        q.clone().addcmul_(g, f, value=alpha) for q, g, f in zip(qs, Gs, factor, strict=True)
    ]
    assert S.supported_scaled(ps, Gs, factor)
    assert S.scaled_add_list(ps, Gs, factor, alpha=alpha, beta=beta) is True
    assert launches == [(K * _tiles(m) * _tiles(n),)]  # one launch for the list
    rel = 2.0 ** -BITS[p_dtype]
    for got, want, q, g, f in zip(ps, expected, qs, Gs, factor, strict=True):
        agf = alpha * g.double() * f.double()
        exact = q.double() + agf
        both = torch.maximum(got.double().abs(), want.double().abs())
        assert bool(((got.double() - want.double()).abs()
                     <= rel * both + 8 * U32 * (q.double().abs() + agf.abs())).all())  # fmt: skip
        assert bool(((got.double() - exact).abs() <= rel * exact.abs() + 4 * U32 * agf.abs()).all())
    assert unchanged_frame(pbuf, m, n) and unchanged_frame(gbuf, m, n)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_alpha_zero_is_torch_mul_bitwise(dtype):
    """With α = 0 the result is q: bitwise torch's ``p.mul_(β)`` (β·p in float32, rounded to
    p's dtype to nearest even; the interpreter's own bf16 cast would truncate)."""
    ps, _ = matrices(67, 45, dtype, "separate_t", seed=4)
    Gs, _ = matrices(67, 45, dtype, "stack", seed=5)
    want = [p.clone().mul_(0.9) for p in ps]
    S.scaled_add_list(ps, Gs, factors("column", 67, 45, seed=6), alpha=0.0, beta=0.9)
    assert all(torch.equal(a, b) for a, b in zip(ps, want, strict=True))


@pytest.mark.parametrize(
    "dtype,p,beta,g,want",
    [
        # bf16: β·p = 1 + 2⁻⁹ rounds to 1, then 1 + 1.5·2⁻⁹ rounds to 1 (rounding the exact
        # 1 + 2⁻⁸ + 2⁻¹⁰ once would give 1 + 2⁻⁷)
        (torch.bfloat16, 1.0, 1 + 2**-9, 1.5 * 2**-9, 1.0),
        # bf16, β = 1: 1 + 2⁻⁷ + 2⁻⁸ is a tie, rounded to even 1 + 2⁻⁶ (truncation: 1 + 2⁻⁷)
        (torch.bfloat16, 1 + 2**-7, 1.0, 2**-8, 1 + 2**-6),
        # bf16: β·p = 1.5 + 2⁻⁷ + 2⁻⁸, a tie, rounded to even 1.5 + 2⁻⁶; + 0
        (torch.bfloat16, 1 + 2**-7, 1.5, 0.0, 1.5 + 2**-6),
        # fp32: β·p = 1 + 2⁻²² + 2⁻⁴⁶ rounds to 1 + 2⁻²², + 2⁻²⁴ is a tie → 1 + 2⁻²² (an FMA
        # of β·p with the sum would see past the tie: 1 + 2⁻²² + 2⁻²³)
        (torch.float32, 1 + 2**-23, 1 + 2**-23, 2**-24, 1 + 2**-22),
    ],
    ids=["bf16_q_rounded", "bf16_tie_to_even", "bf16_beta_tie", "fp32_q_rounded"],
)
def test_planted_roundings_are_torch_two_steps(dtype, p, beta, g, want):
    """β·p is rounded to p's dtype before the sum (what ``p.mul_(β)`` does), and both
    roundings go to nearest even: bitwise the planted value and torch's two steps."""
    ps = [torch.full((5, 70), p, dtype=dtype, device=DEVICE) for _ in range(2)]
    Gs = [torch.full((5, 70), g, dtype=dtype, device=DEVICE) for _ in range(2)]
    factor = torch.ones(2, 1, 1, device=DEVICE)
    torch_ = [x.clone().mul_(beta) if beta != 1 else x.clone() for x in ps]
    for x, G in zip(torch_, Gs, strict=True):
        x.addcmul_(G, factor[0], value=1.0)
    S.scaled_add_list(ps, Gs, factor, alpha=1.0, beta=beta)
    for got, ref in zip(ps, torch_, strict=True):
        assert torch.equal(ref, torch.full_like(ref, want))
        assert torch.equal(got, ref)


def _check_scaled(ps, Gs, factor) -> None:
    """``scaled_add_list`` with α = −0.5, β = 1 is each entry's torch ``addcmul_`` within one
    rounding of p's dtype plus float32 ones (as in the test above)."""
    qs = [p.clone() for p in ps]
    S.scaled_add_list(ps, Gs, factor, alpha=-0.5, beta=1.0)
    rel = 2.0 ** -BITS[ps[0].dtype]
    for got, q, g, f in zip(ps, qs, Gs, factor, strict=True):
        want = q.clone().addcmul_(g, f, value=-0.5).double()
        agf = 0.5 * (g.double() * f).abs()
        both = torch.maximum(got.double().abs(), want.abs())
        assert bool(((got.double() - want).abs() <= rel * both + 8 * U32 * (q.abs() + agf)).all())


def test_tables_follow_the_tensors(launches):
    """The offsets table is kept by the tensors' addresses and element sizes: a list elsewhere
    (new gradients) gets its own, the first list again reuses its table, and the same bytes
    read as another dtype (offsets in other units) get their own."""
    factor = factors("row", 20, 30, seed=8)
    first = (
        matrices(20, 30, torch.float32, "stack", 9)[0],
        matrices(20, 30, torch.bfloat16, "separate_t", 10)[0],
    )
    second = (
        matrices(20, 30, torch.float32, "stack", 11)[0],
        matrices(20, 30, torch.bfloat16, "separate_t", 12)[0],
    )
    for ps, Gs in (first, second, first):
        _check_scaled(ps, Gs, factor)
    assert len(launches) == 3 and len(tables._TABLES) == 2
    g = gen(13)  # bf16 pairs read as float32: finite values (a bf16 number's high bits)
    pb = torch.randn(K, 20, 60, generator=g).to(DEVICE, torch.bfloat16)
    gb = torch.randn(K, 20, 60, generator=g).to(DEVICE, torch.bfloat16)
    as_fp32 = [list(t.view(torch.float32).unbind(0)) for t in (pb, gb)]
    _check_scaled(*as_fp32, factor)
    pb.copy_(torch.randn(K, 20, 60, generator=g))
    _check_scaled(list(pb.unbind(0)), list(gb.unbind(0)), factors("row", 20, 60, seed=14))
    assert len(launches) == 5 and len(tables._TABLES) == 4


# ---- what the kernels do not take ----------------------------------------------------
def _t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(7)).to(DEVICE, dtype)


def _norms_cases():
    G = [_t(4, 5) for _ in range(K)]
    out0 = torch.full((K, 1, 5), math.nan, device=DEVICE)
    return [
        ("k1", [G[0]], 0, out0[:1], "Gs must be a list of 2 or more"),
        ("mixed_shapes", [G[0], _t(4, 6), G[2]], 0, out0, "Gs must share one shape"),
        (
            "mixed_strides",
            [G[0], G[1].T.contiguous().T, G[2]],
            0,
            out0,
            "Gs must share one shape, strides",
        ),
        ("empty", [_t(0, 5) for _ in range(K)], 0, out0, "Gs must hold non-empty 2-D"),
        (
            "int_dtype",
            [torch.ones(4, 5, dtype=torch.int32, device=DEVICE)] * K,
            0,
            out0,
            "Gs must be of one dtype among",
        ),
        ("dim2", G, 2, out0, "dim must be 0"),
        (
            "out_rows_for_columns",
            G,
            0,
            torch.full((K, 4, 1), math.nan, device=DEVICE),
            r"out must be a float32 tensor of shape \(3, 1, 5\)",
        ),
        ("out_k", G, 1, torch.full((K - 1, 4, 1), math.nan, device=DEVICE), r"shape \(3, 4, 1\)"),
        ("out_bf16", G, 0, out0.bfloat16(), "out must be a float32"),
    ]


@pytest.mark.parametrize("case", _norms_cases(), ids=lambda c: c[0])
def test_norms_refuse_what_they_do_not_take(case):
    """Each unsupported input: ``supported_norms`` False, and a ValueError naming it before
    anything is written."""
    _, Gs, dim, out, match = case
    before = out.clone()
    assert not S.supported_norms(Gs, dim, out)
    with pytest.raises(ValueError, match=match) as err:
        S.channel_norms_list(Gs, dim, out)
    assert str(err.value).startswith("channel_norms_list: ")
    assert torch.equal(out.isnan(), before.isnan())


def _scaled_cases():
    ps = [_t(4, 5, dtype=torch.bfloat16) for _ in range(K)]
    Gs = [_t(4, 5, dtype=torch.bfloat16) for _ in range(K)]
    f = torch.ones(K, 1, 5, device=DEVICE)
    return [
        ("k1", ps[:1], Gs[:1], f[:1], "ps must be a list of 2 or more"),
        (
            "mixed_shapes",
            [ps[0], _t(5, 4, dtype=torch.bfloat16), ps[2]],
            Gs,
            f,
            "ps must share one shape",
        ),
        ("mixed_grad_dtypes", ps, [Gs[0], Gs[1].float(), Gs[2]], f, "Gs must share"),
        ("grads_other_shape", ps, [_t(5, 4) for _ in range(K)], f, r"Gs must be 3 tensors of"),
        ("grads_fewer", ps, Gs[:2], f, "Gs must be 3 tensors"),
        ("repeated_weight", [ps[0], ps[0], ps[1]], Gs, f, "ps must be distinct"),
        ("factor_full", ps, Gs, torch.ones(K, 4, 5, device=DEVICE), "factor must be a float32"),
        ("factor_k", ps, Gs, f[:2], r"\(3, 1, 5\), \(3, 4, 1\) or \(3, 1, 1\)"),
        ("factor_2d", ps, Gs, f[:, 0], "factor must be"),
        ("factor_bf16", ps, Gs, f.bfloat16(), "factor must be a float32"),
    ]


@pytest.mark.parametrize("case", _scaled_cases(), ids=lambda c: c[0])
def test_scaled_refuses_what_it_does_not_take(case):
    """Each unsupported input: ``supported_scaled`` False, and a ValueError naming it before
    any weight is written."""
    _, ps, Gs, factor, match = case
    before = [p.clone() for p in ps]
    assert not S.supported_scaled(ps, Gs, factor)
    with pytest.raises(ValueError, match=match) as err:
        S.scaled_add_list(ps, Gs, factor, alpha=-0.1, beta=0.9)
    assert str(err.value).startswith("scaled_add_list: ")
    assert all(torch.equal(p, b) for p, b in zip(ps, before, strict=True))


def _run(steps: int, monkeypatch, mode: str, preset: str, **group) -> list[torch.Tensor]:
    """APOLLO or Fira (limiter on) on two shape batches of both orientations,
    ``foreach=True``."""
    import warnings

    import galore2
    from galore2.kernels import dispatch

    monkeypatch.setenv(dispatch.ENV_VAR, mode)
    g = torch.Generator().manual_seed(5)
    shapes = [(40, 24), (40, 24), (24, 56), (24, 56)]
    ws = [torch.nn.Parameter(torch.randn(s, generator=g).to(DEVICE)) for s in shapes]
    opt = getattr(galore2, preset)(
        [{"params": ws, "rank": 4, "update_proj_gap": 100, **group}],
        lr=5e-2, weight_decay=0.1, foreach=True,
    )  # fmt: skip
    gg = torch.Generator().manual_seed(6)
    for _ in range(steps):
        for w in ws:
            w.grad = torch.randn(w.shape, generator=gg).to(DEVICE)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
    return [w.detach() for w in ws]


#: (preset, group options, the kernel functions its batches launch along the data: the
#: limiter's norms — APOLLO's per-channel φ and Fira's with the projection — and the update)
_WITH_PROJECTION = ("project_norms_list", "project_norms_list")
ALONG = {
    "apollo_channel": ("APOLLO", {"scale_type": "channel"},
                       (_WITH_PROJECTION, ("scaled_list", "scaled_add_list"))),
    "apollo_tensor": ("APOLLO", {"scale_type": "tensor"},
                      (("scaled_list", "channel_norms_list"), ("scaled_list", "scaled_add_list"))),
    "fira": ("Fira", {}, (_WITH_PROJECTION, ("lowrank_list", "addmm_scaled_list"))),
    "fira_reference": ("Fira", {"residual": "fira_reference", "scale": 0.5},
                       (_WITH_PROJECTION, ("lowrank_list", "addmm_scaled_list"))),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ALONG))
def test_along_the_data_on_the_grouped_kernels(case, monkeypatch):
    """Where the grouped kernels run, APOLLO's and Fira's shape batches go along the data:
    at each non-refresh step each batch's channel norms (of the gradients; Fira: of the
    residuals, never made; with the projection where φ is per channel) and its update are
    one launch each (2 batches × 3 steps after
    the refresh; APOLLO's refresh step applies its stacked updates per shape by one launch
    too), and the weights match the torch path along the data (per matrix norms, ``mul_``
    and ``addcmul_``, ``addmm_``) within float32's rounding of the reordered sums (4 steps
    of lr 5e-2 on weights of magnitude ~3)."""
    import importlib

    from galore2.optim import lowrank_batch

    preset, group, kernels = ALONG[case]
    calls = {name: 0 for _, name in kernels}
    for module, name in kernels:
        mod = importlib.import_module(f"galore2.kernels.{module}")
        fn = getattr(mod, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(mod, name, counted)
    grouped = _run(4, monkeypatch, "triton", preset, **group)
    refresh = 2 if preset == "APOLLO" else 0
    norms, update = (name for _, name in kernels)
    assert calls == {norms: 6, update: refresh + 6}, calls
    monkeypatch.setattr(lowrank_batch, "MIN_ALONG_DATA_ELEMENTS", 0)
    along = _run(4, monkeypatch, "torch", preset, **group)
    start = _run(0, monkeypatch, "torch", preset, **group)
    moved = max(float((a - s).abs().max()) for a, s in zip(along, start, strict=True))
    assert moved > 1e-2
    for a, b in zip(grouped, along, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
