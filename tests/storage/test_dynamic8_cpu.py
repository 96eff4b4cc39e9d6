"""The dynamic 8-bit format's CPU path (galore2.storage.dynamic8): torch quantize / dequantize
bit-identical to bitsandbytes' CPU kernels — the same uint8 codes, the same fp32 absmax and
the same dequantized floats, compared as bits. The bitsandbytes side is the same function
with :func:`~galore2.storage.dynamic8.use_torch` patched to False."""

from __future__ import annotations

import math
import platform

import bitsandbytes  # the `test` extra: missing, it fails the run
import pytest
import torch

from galore2.storage import dynamic8 as D

MAPS = [True, False]  # signed (first moments), unsigned (second moments)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _run(x: torch.Tensor, dim: int, signed: bool, bnb: bool, monkeypatch) -> tuple:
    """(codes, absmax, dequantized) of ``x`` through quantize_ / dequantize, on the CPU path
    or (bnb=True) on bitsandbytes; outputs start poisoned."""
    shape = tuple(x.shape)
    codes = torch.full(shape, 0x5A, dtype=torch.uint8)
    absmax = torch.full(D.absmax_shape(shape, dim), math.nan)
    with monkeypatch.context() as m:
        if bnb:
            m.setattr(D, "use_torch", lambda t: False)
        D.quantize_(x, codes, absmax, dim, signed)
        out = D.dequantize(codes, absmax, dim, signed)
    return codes, absmax, out


def _assert_identical(x: torch.Tensor, dim: int, signed: bool, monkeypatch) -> None:
    got = _run(x, dim, signed, False, monkeypatch)
    want = _run(x, dim, signed, True, monkeypatch)
    assert torch.equal(got[0], want[0]), int((got[0] != want[0]).sum())
    assert torch.equal(_bits(got[1]), _bits(want[1]))
    assert torch.equal(_bits(got[2]), _bits(want[2]))


def _normalized(y: torch.Tensor) -> torch.Tensor:
    """Rows of 255 values of ``y`` (|y| ≤ 1) after a 1.0: blocks of absmax 1, in which each
    value is its own normalized value (x · fl(1 / 1) = x)."""
    y = torch.cat((y, y.new_zeros(-y.numel() % 255))).view(-1, 255)
    return torch.cat((torch.ones(y.shape[0], 1), y), 1)


@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"), reason="aarch64 rounds differently"
)
def test_cpu_path_reproduces_installed_bitsandbytes():
    """bitsandbytes ≥ 0.50 on x86-64 (its table quantizer): the CPU path is taken."""
    version = tuple(int(v) for v in bitsandbytes.__version__.split(".")[:2])
    if version < (0, 50):
        pytest.skip("bitsandbytes < 0.50 quantizes on the CPU by another rule")
    assert D._torch_matches_bnb()
    assert D.use_torch(torch.zeros(1))


@pytest.mark.parametrize("signed", MAPS)
def test_every_code_step_and_table_bin_edge(signed, monkeypatch):
    """Normalized values at and within 4 ulps of every step of the code function, both ends
    of every upper-16-bit bin in [−1, 1], the code midpoints and values, ±0 and ±1."""
    below = D._cpu_tables(signed)[0][::2]  # the last value before each bin's step
    code = D.dynamic_code(signed, torch.device("cpu"))
    steps = D._ordered(below[torch.isfinite(below)]) + 1
    near = D._unordered(torch.cat([steps + d for d in range(-4, 5)]))
    key = torch.arange(1 << 16, dtype=torch.int64)
    edges = torch.cat((key << 16, (key << 16) | 0xFFFF)).to(torch.int32).view(torch.float32)
    mid = (code[:-1] + code[1:]) / 2
    ulp = D._unordered(torch.cat([D._ordered(torch.cat((mid, code))) + d for d in (-1, 0, 1)]))
    y = torch.cat((near, edges, ulp, torch.tensor([0.0, -0.0, 1.0, -1.0])))
    y = y[y.abs() <= 1]
    assert steps.numel() > 200
    _assert_identical(_normalized(y), 1, signed, monkeypatch)


@pytest.mark.parametrize("signed", MAPS)
def test_dense_sweep_of_normalized_values(signed, monkeypatch):
    """2^21 fp32 values evenly spaced in their order over [−1, 1] (every ~1000th float) and
    2^20 uniform ones."""
    lo, hi = (int(D._ordered(torch.tensor([v]))[0]) for v in (-1.0, 1.0))
    o = torch.linspace(lo, hi, 1 << 21, dtype=torch.float64).round().long()
    g = torch.Generator().manual_seed(0)
    y = torch.cat((D._unordered(o), torch.rand(1 << 20, generator=g) * 2 - 1))
    _assert_identical(_normalized(y), 1, signed, monkeypatch)


# blocks along rows with a 256 + 44 tail, exact multiples, short rows (one block), a 3-D
# tensor; along columns with 300 = 256 + 44 rows, 513 = 2·256 + 1, 40 (one short block),
# and GaLore's 256×1024 / 1024×2736 moments
SHAPES = [
    ((40, 300), 1),
    ((6, 512), 1),
    ((33, 5, 7), 1),
    ((70, 5), 1),
    ((1, 4097), 1),
    ((7, 3), 1),
    ((300, 40), 0),
    ((513, 9), 0),
    ((40, 130), 0),
    ((257, 3), 0),
    ((256, 1024), 0),
    ((256, 1024), 1),
    ((1024, 2736), 1),
    ((1024, 2736), 0),
]


@pytest.mark.parametrize("signed", MAPS)
@pytest.mark.parametrize(("shape", "dim"), SHAPES)
def test_random_tensors(shape, dim, signed, monkeypatch):
    g = torch.Generator().manual_seed(hash((shape, dim, signed)) % 2**31)
    for scale in (1e-30, 1e-3, 1.0, 7.0, 1e30):
        x = torch.randn(shape, generator=g) * scale
        # heavy tails: some blocks dominated by one element, most values tiny against it
        x = x * torch.exp(3 * torch.randn(shape, generator=g))
        _assert_identical(x.abs() if not signed else x, dim, signed, monkeypatch)


@pytest.mark.parametrize("signed", MAPS)
@pytest.mark.parametrize("dim", [0, 1])
def test_edge_blocks(dim, signed, monkeypatch):
    """Blocks of all zeros, of −0, one nonzero element, ±absmax only, code values and code
    midpoints times the block's absmax, subnormal values in normal blocks, blocks whose
    absmax is subnormal (its reciprocal finite: 2^-127, or overflowing: 1e-40 and the
    smallest subnormal, which bitsandbytes quantizes), and NaN / ±inf elements (bitsandbytes
    too: it leaves NaN out of the absmax)."""
    code = D.dynamic_code(signed, torch.device("cpu"))
    mid = (code[:-1] + code[1:]) / 2
    sub = torch.tensor(2.0**-149)
    blocks = [
        torch.zeros(256),
        torch.full((256,), -0.0),
        torch.zeros(256).index_fill_(0, torch.tensor([17]), 3.5),
        torch.tensor([2.5, -2.5] * 128),
        torch.cat((code, torch.zeros(0))) * 0.37,
        torch.cat((mid, torch.ones(1))) * 1.3e-3,
        torch.cat((mid, torch.ones(1))),
        torch.cat((torch.ones(1), torch.arange(1, 256) * sub)),
        torch.arange(256) * sub,
        torch.arange(256) * 2.0**-127 / 255,
        torch.full((256,), 1e-40),
        torch.full((256,), 2.0**-128),
        torch.full((256,), 2.0**-126),
        torch.randn(256).index_fill_(0, torch.tensor([3]), math.nan),
        torch.randn(256).index_fill_(0, torch.tensor([9]), math.inf),
        torch.randn(256).index_fill_(0, torch.tensor([9]), -math.inf),
        torch.full((256,), math.nan),
        torch.randn(256) * torch.finfo(torch.float32).max / 4,
    ]
    for block in blocks:
        b = block if signed else block.abs()
        for rows in (256, 300):  # whole blocks; a 44-element tail (of the same values)
            if dim == 1:
                x = b[torch.arange(rows) % 256].view(1, rows).repeat(3, 1)
            else:
                x = b[torch.arange(rows) % 256].view(rows, 1).repeat(1, 3)
            _assert_identical(x, dim, signed, monkeypatch)


@pytest.mark.parametrize("signed", MAPS)
def test_dequantize_any_codes_and_absmax(signed, monkeypatch):
    """Every code under absmax 0, subnormal, ordinary, huge, inf and NaN; odd sizes and a
    codes view at an odd byte offset (one code per gather there)."""
    g = torch.Generator().manual_seed(1)
    absmax = torch.tensor([0.0, 2.0**-140, 1e-3, 1.0, 3e37, math.inf, math.nan, 0.5])
    q = torch.arange(8 * 256).remainder(256).to(torch.uint8).view(8, 256)
    storage = torch.randint(0, 256, (1 + 37 * 301,), dtype=torch.uint8, generator=g)
    odd = storage[1:].view(37, 301)  # storage offset 1
    scale = torch.rand(37, 2, generator=g)
    runs = {}
    for bnb in (False, True):
        with monkeypatch.context() as m:
            if bnb:
                m.setattr(D, "use_torch", lambda t: False)
            runs[bnb] = [
                D.dequantize(q, absmax.view(8, 1), 1, signed),
                D.dequantize(q.mT, absmax.view(1, 8), 0, signed),
            ]
            runs[bnb] += [
                D.dequantize(odd, scale, 1, signed),
                D.dequantize(odd.T, scale.T, 0, signed),
                D.dequantize(odd[:, :255], scale[:, :1], 1, signed),
            ]
    for got, want in zip(runs[False], runs[True], strict=True):
        assert torch.equal(_bits(got), _bits(want))


def test_non_contiguous_input_and_outputs(monkeypatch):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 520, generator=g).T  # a transposed view: 520×300
    _assert_identical(x, 1, True, monkeypatch)
    _assert_identical(x, 0, False, monkeypatch)
    codes = torch.zeros(300, 520, dtype=torch.uint8).T  # outputs as transposed views
    absmax = torch.zeros(2, 520).T
    D.quantize_(x, codes, absmax, 1, True)
    want = _run(x, 1, True, True, monkeypatch)
    assert torch.equal(codes, want[0]) and torch.equal(_bits(absmax), _bits(want[1]))


def test_cpu_path_does_not_call_bitsandbytes_for_finite_input(monkeypatch):
    """Once the code maps and tables are cached, finite input never reaches bitsandbytes;
    non-finite input does (and matches it, above)."""
    x = torch.randn(64, 300)
    codes, absmax = torch.zeros(64, 300, dtype=torch.uint8), torch.zeros(64, 2)
    D.quantize_(x, codes, absmax, 1, True)  # caches maps, tables and the check

    def refuse():
        raise AssertionError("bitsandbytes called")

    monkeypatch.setattr(D, "bnb_functional", refuse)
    for dim, signed in ((1, True), (0, False)):
        shape = (64, 300)
        codes, absmax = (
            torch.zeros(shape, dtype=torch.uint8),
            torch.zeros(D.absmax_shape(shape, dim)),
        )
        D.quantize_(x.abs(), codes, absmax, dim, signed)
        D.dequantize(codes, absmax, dim, signed)
    x[3, 5] = math.nan
    with pytest.raises(AssertionError, match="bitsandbytes called"):
        D.quantize_(x, codes, absmax, 0, False)


@pytest.mark.parametrize("chunk", [1, 999, 70_000])
def test_chunk_boundaries(chunk, monkeypatch):
    """The CPU path works in chunks of whole rows (blocks along rows) or of 256 rows
    (down columns): tiny and odd chunk sizes, odd row lengths (two codes per gather except
    a chunk's odd last one) give the same bits."""
    monkeypatch.setattr(D, "_CHUNK", chunk)
    g = torch.Generator().manual_seed(chunk)
    for shape in ((301, 257), (513, 99), (97, 1031)):
        for dim in (0, 1):
            x = torch.randn(shape, generator=g) * torch.exp(2 * torch.randn(shape, generator=g))
            _assert_identical(x, dim, True, monkeypatch)
            _assert_identical(x.abs(), dim, False, monkeypatch)
