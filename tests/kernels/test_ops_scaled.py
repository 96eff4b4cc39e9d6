"""galore2's ops for a shape batch's scaled gradients (:mod:`galore2.kernels.ops_scaled`):
their torch path against float64, their argument checks, and one dispatch per call."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from galore2.kernels.ops_scaled import channel_norms_each, project_norms_each, scaled_add_each_


def _mats(k: int, m: int, n: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(m, n, generator=g).to(dtype) for _ in range(k)]


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"]
)
def test_channel_norms_are_each_matrix_s(dim, dtype):
    """Each matrix's 2-norms over ``dim``, summed in float32 (float64 gradients: in float64,
    then rounded): within a few float32 roundings of the float64 norms of the same values."""
    Gs = _mats(3, 7, 5, dtype)
    out = channel_norms_each(Gs, dim)
    assert out.dtype == torch.float32
    assert out.shape == ((3, 1, 5) if dim == 0 else (3, 7, 1))
    for g, o in zip(Gs, out.unbind(0), strict=True):
        ref = torch.linalg.vector_norm(g.double(), dim=dim, keepdim=True)
        torch.testing.assert_close(o.double(), ref, rtol=8 * 2.0**-24, atol=0)


@pytest.mark.parametrize("shape", [(1, 5), (7, 1), (1, 1)], ids=["column", "row", "matrix"])
@pytest.mark.parametrize("beta", [1.0, 0.9])
def test_scaled_add_is_the_apply_of_each_scaled_update(shape, beta):
    """``p ← β·p + α·G ⊙ f`` into each weight: the bits of ``apply_update``'s ``mul_`` then
    ``addcmul_`` per weight (the torch path is those ops), and within one bf16 rounding of
    the float64 result."""
    ps = [w.requires_grad_(False) for w in _mats(3, 7, 5, torch.bfloat16)]
    Gs = _mats(3, 7, 5, torch.bfloat16, seed=1)
    f = torch.rand(3, *shape, generator=torch.Generator().manual_seed(2)) + 0.5
    want = []
    for p, g, fi in zip(ps, Gs, f.unbind(0), strict=True):
        q = p.clone()
        if beta != 1.0:
            q.mul_(beta)
        want.append(q.addcmul_(g, fi, value=-0.1))
    # float64, and the bound of its two bf16 roundings (β·p, then the sum: half an ulp,
    # 2**-9 relative, of each rounded value)
    terms = [(beta * p.double(), -0.1 * g.double() * fi.double())
             for p, g, fi in zip(ps, Gs, f.unbind(0), strict=True)]  # fmt: skip
    scaled_add_each_(ps, Gs, f, -0.1, beta)
    for p, w, (a, b) in zip(ps, want, terms, strict=True):
        assert torch.equal(p, w)
        bound = 2.0**-8 * (2 * a.abs() + b.abs())
        assert bool(((p.double() - (a + b)).abs() <= bound).all())


def test_bad_arguments_are_refused_before_anything_is_written():
    ps = _mats(2, 4, 3, torch.float32)
    before = [p.clone() for p in ps]
    Gs = _mats(2, 4, 3, torch.float32, seed=1)
    with pytest.raises(ValueError, match="factor"):
        scaled_add_each_(ps, Gs, torch.ones(2, 4, 3), 1.0, 1.0)  # not broadcast
    with pytest.raises(ValueError, match="float32"):
        scaled_add_each_(ps, Gs, torch.ones(2, 1, 3, dtype=torch.float64), 1.0, 1.0)
    with pytest.raises(ValueError, match="lists of one length"):
        scaled_add_each_(ps, Gs[:1], torch.ones(2, 1, 3), 1.0, 1.0)
    with pytest.raises(ValueError, match="dim"):
        channel_norms_each(Gs, 2)
    with pytest.raises(ValueError, match="one shape"):
        channel_norms_each([Gs[0], Gs[1].T], 0)
    assert all(torch.equal(a, b) for a, b in zip(ps, before, strict=True))


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_one_dispatch_per_call_on_meta():
    """On meta tensors (how ``benchmarks/roofline.py`` counts a step where the kernels run)
    each op is one dispatch for the whole list, with its output's shape."""
    ps = [torch.empty(6, 4, device="meta", dtype=torch.bfloat16) for _ in range(5)]
    f = torch.empty(5, 1, 4, device="meta")
    Ps = [torch.empty(6, 2, device="meta") for _ in range(5)]
    Rs = [torch.empty(2, 4, device="meta", dtype=torch.bfloat16) for _ in range(5)]
    with _Ops() as seen:
        out = channel_norms_each(ps, 0)
        scaled_add_each_(ps, ps, f, -1.0, 0.5)
        both = project_norms_each(ps, Ps, Rs, -1.0, 0)
    assert seen.names == ["channel_norms_each", "scaled_add_each_", "project_norms_each"]
    assert out.shape == (5, 1, 4) and out.dtype == torch.float32
    assert [(t.shape, t.dtype) for t in both] == [((5, 1, 4), torch.float32)] * 2


@pytest.mark.parametrize("c", [-0.5, 0.0], ids=["residual", "gradient"])
@pytest.mark.parametrize("dim", [0, 1], ids=["left", "right"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_project_norms_torch_path(dim, dtype, c):
    """``galore2::project_norms_each`` off the kernel: R = PᵀG (left) or G·Q (right) into
    the given outputs, the bits of ``torch.mm`` on the operands rounded to R's dtype; the
    norms per channel of G + c·P·R (G + c·R·Qᵀ) and of R, with R as rounded, within a few
    float32 roundings (relative to the summed magnitudes) of float64 math on those values;
    with c = 0, G's own norms (APOLLO's)."""
    m, n, r = 9, 7, 3
    Gs = _mats(3, m, n, dtype)
    g = torch.Generator().manual_seed(5)
    Bs = [torch.linalg.qr(torch.randn(m if dim == 0 else n, r, generator=g)).Q for _ in Gs]
    Rs = [torch.full((r, n) if dim == 0 else (m, r), float("nan"), dtype=dtype) for _ in Gs]
    norms, r_norms = project_norms_each(Gs, Bs, Rs, c, dim)
    assert norms.shape == r_norms.shape == ((3, 1, n) if dim == 0 else (3, m, 1))
    for G, B, R, nm, rn in zip(Gs, Bs, Rs, norms.unbind(0), r_norms.unbind(0), strict=True):
        b = B.to(dtype)
        assert torch.equal(R, b.T @ G if dim == 0 else G @ b)
        b64, R64 = b.double(), R.double()
        part = b64 @ R64 if dim == 0 else R64 @ b64.T
        ref = torch.linalg.vector_norm(G.double() + c * part, dim=dim, keepdim=True)
        spread = (r + 2) * 2.0**-24 * torch.linalg.vector_norm(
            G.double().abs() + abs(c) * ((b64.abs() @ R64.abs()) if dim == 0 else
                                         (R64.abs() @ b64.abs().T)), dim=dim, keepdim=True
        )  # fmt: skip
        reduced = G.shape[dim]
        assert bool(((nm.double() - ref).abs() <= spread + (reduced + 2) * 2.0**-24 * ref).all())
        ref_r = torch.linalg.vector_norm(R64, dim=dim, keepdim=True)
        torch.testing.assert_close(rn.double(), ref_r, rtol=(R.shape[dim] + 2) * 2.0**-24, atol=0)


def test_project_norms_refuses_before_writing():
    """Bad dims, list lengths and shapes: a ValueError naming what it takes, the outputs
    untouched."""
    Gs = _mats(2, 5, 4, torch.float32)
    Ps = [torch.ones(5, 2) for _ in Gs]
    Rs = [torch.full((2, 4), float("nan")) for _ in Gs]
    bad = [
        ((Gs, Ps, Rs, -1.0, 2), "dim must be 0"),
        ((Gs, Ps[:1], Rs, -1.0, 0), "one basis and one output per gradient"),
        ((Gs, Ps, Rs, -1.0, 1), r"Q \(n × r\)"),
        ((Gs, Ps, [x.T for x in Rs], -1.0, 0), r"P \(m × r\) and outputs r × n"),
        (([Gs[0], Gs[1].T], Ps, Rs, -1.0, 0), "2-D gradients of one shape"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=f"project_norms_each: .*{match}"):
            project_norms_each(*args)
        assert all(bool(x.isnan().all()) for x in Rs)
