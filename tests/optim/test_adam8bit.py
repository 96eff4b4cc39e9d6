"""GaLoreAdamW8bit / ScaleByAdam8bit: Adam moments stored 8-bit blockwise via bitsandbytes."""

from __future__ import annotations

import io
import sys

import bitsandbytes as bnb
import pytest
import torch
from torch import nn

import galore2
from galore2.core.transform import Context
from galore2.optim import adam8bit
from galore2.optim.adam import ScaleByAdam, ScaleByAdam8bit
from galore2.optim.adam8bit import dequantize, quantize_
from galore2.storage import dynamic8

from ..dist import spawn
from ..fsdp import adam8bit_fsdp_cases
from ..helpers import assert_f32_close
from ..missing_backends import assert_ok

# bitsandbytes' own tolerances for 8-bit blockwise Adam on fp32 tensors
# (github.com/bitsandbytes-foundation/bitsandbytes, tests/test_optim.py::test_optimizer8bit,
# gtype float32, 1024×{32, 1024, 4097}, 50 steps): dequantized states vs torch.optim.Adam's
# with atol=3e-3, rtol=1e-3 and fewer than 20 elements out of tolerance; parameters
# with patol=1e-5, prtol=1e-3 (no element out); per step err.mean() < 6e-5.
STATE_ATOL, STATE_RTOL, STATE_MAX_BAD = 3e-3, 1e-3, 20
PARAM_ATOL, PARAM_RTOL = 1e-5, 1e-3
ERR_MEAN = 6e-5


def _moments(opt: torch.optim.Optimizer, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = opt.state[p]
    dim = int(s["adam.block_dim"])
    m = dequantize(s["adam.exp_avg"], s["adam.exp_avg.absmax"], dim, signed=True)
    v = dequantize(s["adam.exp_avg_sq"], s["adam.exp_avg_sq.absmax"], dim, signed=False)
    return m, v


def _bnb_moments(opt: torch.optim.Optimizer, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = opt.state[p]
    F = bnb.functional
    m = F.dequantize_blockwise(s["state1"], absmax=s["absmax1"], code=s["qmap1"], blocksize=256)
    v = F.dequantize_blockwise(s["state2"], absmax=s["absmax2"], code=s["qmap2"], blocksize=256)
    return m, v


def _not_close(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((~torch.isclose(a, b, atol=STATE_ATOL, rtol=STATE_RTOL)).sum())


def _three(shape: tuple[int, int], seed: int = 0) -> list[nn.Parameter]:
    torch.manual_seed(seed)
    w = torch.randn(shape) * 0.1
    return [nn.Parameter(w.clone()) for _ in range(3)]


def _run_vs_bnb(shape: tuple[int, int], steps: int = 20):
    """Same init and gradients into GaLoreAdamW8bit (rank None), bnb's AdamW8bit and
    torch's fp32 AdamW; yields after every step."""
    ours, theirs, fp32 = _three(shape)
    kw = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
    opts = (
        galore2.GaLoreAdamW8bit([ours], **kw),
        bnb.optim.AdamW8bit([theirs], **kw),
        torch.optim.AdamW([fp32], **kw),
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        grad = torch.randn(shape, generator=g) * 0.01
        for p, opt in zip((ours, theirs, fp32), opts, strict=True):
            p.grad = grad.clone()
            opt.step()
        yield (ours, theirs, fp32), opts


def test_full_rank_matches_bitsandbytes_adamw8bit():
    """Rows of 1024 = 4 blocks of 256: our blocks coincide with bnb's flat ones."""
    shape = (64, 1024)
    for (ours, theirs, _), (o_ours, o_bnb, _) in _run_vs_bnb(shape):
        torch.testing.assert_close(ours, theirs, atol=PARAM_ATOL, rtol=PARAM_RTOL)
        for a, b in zip(_moments(o_ours, ours), _bnb_moments(o_bnb, theirs), strict=True):
            assert _not_close(a, b) < STATE_MAX_BAD
        s, t = o_ours.state[ours], o_bnb.state[theirs]
        assert s["adam.exp_avg"].dtype == torch.uint8 and s["adam.exp_avg"].shape == shape
        # Stricter than bnb's tolerance: the same quantizer on the same blocks. The fp32
        # arithmetic differs in the last bits (lerp vs mul/add), so absmax agrees to
        # ~ulps and a code on a rounding boundary may flip now and then.
        for ours_key, bnb_key in (("exp_avg", "1"), ("exp_avg_sq", "2")):
            flips = (s["adam." + ours_key] != t["state" + bnb_key]).sum().item()
            assert flips <= 1e-3 * ours.numel()
            torch.testing.assert_close(
                s[f"adam.{ours_key}.absmax"].flatten(), t["absmax" + bnb_key], rtol=1e-5, atol=0
            )
    assert (ours - _three(shape)[0]).abs().max() > 1e-2  # it did move


def test_full_rank_unaligned_rows_close_to_bitsandbytes():
    """Rows of 300: our blocks (256 + 44 per row) differ from bnb's flat blocks of 256 that
    straddle rows, so the two are different 8-bit roundings of the same fp32 moments.
    Tolerances: dequantized moments within bnb's 8-bit-vs-fp32 state tolerance of each
    other; parameters within twice bnb's per-step mean error (each side carries one 8-bit
    error); and our error against fp32 AdamW no larger than bnb's own (+10%)."""
    for params, (o_ours, o_bnb, _) in _run_vs_bnb((48, 300)):
        ours, theirs, fp32 = params
        for a, b in zip(_moments(o_ours, ours), _bnb_moments(o_bnb, theirs), strict=True):
            assert _not_close(a, b) < STATE_MAX_BAD
        assert (ours - theirs).abs().mean() < 2 * ERR_MEAN
    assert o_ours.state[ours]["adam.exp_avg.absmax"].shape == (48, 2)
    ours_err = (ours - fp32).abs().mean().item()
    bnb_err = (theirs - fp32).abs().mean().item()
    assert 0 < ours_err <= 1.1 * bnb_err


def test_small_tensors_keep_fp32_and_match_torch_adamw():
    torch.manual_seed(0)
    # 2048 and 4095 elements (< 4096), a bias, a 1-D and an (n, 1) tensor (nothing to
    # block along): fp32 moments. 64×64 = 4096 is the first 8-bit size.
    shapes = [(32, 64), (63, 65), (64,), (5000,), (4096, 1), (64, 64)]
    ours = [nn.Parameter(torch.randn(s)) for s in shapes]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    o = galore2.GaLoreAdamW8bit(ours, lr=1e-2, weight_decay=0.1)
    r = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    for _ in range(10):
        for p, q in zip(ours, ref, strict=True):
            q.grad = torch.randn_like(q)
            p.grad = q.grad.clone()
        o.step()
        r.step()
    for p, q in zip(ours[:-1], ref[:-1], strict=True):
        assert o.state[p]["adam.exp_avg"].dtype == torch.float32
        assert "adam.exp_avg.absmax" not in o.state[p]
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(o.state[p]["adam.exp_avg_sq"], r.state[q]["exp_avg_sq"])
    assert o.state[ours[-1]]["adam.exp_avg"].dtype == torch.uint8
    assert not torch.equal(ours[-1], ref[-1])  # the 8-bit one differs (tests above)


def _mlp() -> nn.Sequential:
    # 128×512 weight: LEFT (8×512 moments); 512×128: RIGHT (512×8) — both 4096 elements
    return nn.Sequential(nn.Linear(512, 128), nn.Tanh(), nn.Linear(128, 512))


def _train(cls: type, steps: int = 150, **settings) -> tuple[float, float, torch.optim.Optimizer]:
    torch.manual_seed(0)
    teacher = torch.randn(512, 16) @ torch.randn(16, 512) / 512**0.5 / 4
    model = _mlp()
    x = torch.randn(512, 512)
    y = torch.tanh(x @ teacher)
    w1, b1, w2, b2 = model.parameters()
    groups = [
        {"params": [w1, w2], "rank": 8, "update_proj_gap": 50, **settings},
        {"params": [b1, b2]},
    ]
    opt = cls(groups, lr=1e-2, weight_decay=0.0)
    with torch.no_grad():
        initial = nn.functional.mse_loss(model(x), y).item()
    for i in range(steps):
        batch = slice(i * 64 % 512, i * 64 % 512 + 64)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[batch]), y[batch]).backward()
        opt.step()
    with torch.no_grad():
        final = nn.functional.mse_loss(model(x), y).item()
    return initial, final, opt


def test_galore_training_loss_within_one_percent_of_fp32():
    initial, fp32_loss, _ = _train(galore2.GaLoreAdamW)
    _, q_loss, opt = _train(galore2.GaLoreAdamW8bit)
    assert fp32_loss < 0.5 * initial  # a task that trains
    shapes = sorted(
        tuple(s["adam.exp_avg"].shape) for s in opt.state.values() if "adam.exp_avg.absmax" in s
    )
    assert shapes == [(8, 512), (512, 8)]  # both sides held 8-bit
    assert abs(q_loss - fp32_loss) <= 0.01 * fp32_loss, (q_loss, fp32_loss)


def test_state_bytes_exact_and_quarter_of_fp32():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 10))
    groups = [
        # LEFT: 256×1024 moments, blocks of 256 down each column
        {"params": [model[0].weight], "rank": 256, "proj_type": "left"},
        {"params": [p for n, p in model.named_parameters() if n != "0.weight"]},
    ]
    sizes = {}
    for cls in (galore2.GaLoreAdamW, galore2.GaLoreAdamW8bit):
        opt = cls(groups)
        opt.init_state()
        got = opt.state_bytes()
        total = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
        assert got["total"] == total
        sizes[cls.__name__] = got["moments"]
        if cls is galore2.GaLoreAdamW8bit:
            s = opt.state[model[0].weight]
            expected = 2 * (256 * 1024 * 1 + 1 * 1024 * 4)  # codes + absmax (1, 1024)
            assert s["adam.exp_avg.absmax"].shape == (1, 1024)
            # + 1024×1024 full rank: codes + (1024, 4) absmax
            expected += 2 * (1024 * 1024 + 1024 * 4 * 4)
            expected += 2 * (10 * 1024 + 10 * 4 * 4)  # head 10×1024: 8-bit too
            expected += 2 * 4 * (1024 + 1024 + 10)  # biases: fp32
            assert got["moments"] == expected
    ratio = sizes["GaLoreAdamW8bit"] / sizes["GaLoreAdamW"]
    assert ratio <= 0.27, ratio


def _resume_model() -> nn.Module:
    torch.manual_seed(0)
    # LEFT 64×520 (8×520), full-rank 64×64 (4096: 8-bit), RIGHT 520×64 (520×8)
    return nn.Sequential(
        nn.Linear(520, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 520)
    )


def _resume_opt(model: nn.Module, **settings) -> galore2.GaLoreAdamW8bit:
    w1, b1, w2, b2, w3, b3 = model.parameters()
    settings = {"update_proj_gap": 4, "moments_on_refresh": "project", **settings}
    return galore2.GaLoreAdamW8bit(
        [{"params": [w1, w3], "rank": 8, **settings}, {"params": [w2, b1, b2, b3]}], lr=1e-2
    )


def _resume_steps(model: nn.Module, opt: torch.optim.Optimizer, start: int, stop: int) -> None:
    for step in range(start, stop):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 520, generator=g), torch.randn(16, 520, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def test_state_dict_round_trip_resumes_bit_identical():
    straight = _resume_model()
    straight_opt = _resume_opt(straight)
    _resume_steps(straight, straight_opt, 0, 10)

    first = _resume_model()
    first_opt = _resume_opt(first)
    _resume_steps(first, first_opt, 0, 5)
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": first_opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)

    resumed = _resume_model()
    resumed.load_state_dict(saved["model"])
    resumed_opt = _resume_opt(resumed)
    resumed_opt.load_state_dict(saved["opt"])
    for p, q in zip(resumed.parameters(), first.parameters(), strict=True):
        for key, value in first_opt.state[q].items():
            loaded = resumed_opt.state[p][key]
            assert loaded.dtype == value.dtype and torch.equal(loaded, value), key
    w1 = next(resumed.parameters())
    assert resumed_opt.state[w1]["adam.exp_avg"].dtype == torch.uint8
    _resume_steps(resumed, resumed_opt, 5, 10)  # refreshes at steps 8 (after the resume)

    for p, q in zip(resumed.parameters(), straight.parameters(), strict=True):
        assert torch.equal(p, q)
        assert sorted(resumed_opt.state[p]) == sorted(straight_opt.state[q])
        for key, value in straight_opt.state[q].items():
            assert torch.equal(resumed_opt.state[p][key], value), key
    n8 = sum("adam.exp_avg.absmax" in s for s in straight_opt.state.values())
    assert n8 == 3


def _cpu_run(steps: int = 7) -> tuple[list[nn.Parameter], galore2.GaLoreAdamW8bit]:
    """GaLoreAdamW8bit on the CPU with LEFT (280×700 moments, blocks of 256 + 24 down each
    column), RIGHT (700×280, along rows) and full-rank (96×520, rows of 256 + 256 + 8)
    8-bit moments, weight decay, and refreshes at steps 0, 3 and 6 that rotate the
    quantized moments."""
    g = torch.Generator().manual_seed(3)
    params = [
        nn.Parameter(torch.randn(shape, generator=g) * 0.1)
        for shape in ((300, 700), (700, 300), (96, 520))
    ]
    settings = {"rank": 280, "update_proj_gap": 3, "moments_on_refresh": "project"}
    opt = galore2.GaLoreAdamW8bit(
        [
            {"params": params[:1], "proj_type": "left", **settings},
            {"params": params[1:2], "proj_type": "right", **settings},
            {"params": params[2:]},
        ],
        lr=1e-2,
        weight_decay=0.1,
    )
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 0.01
        opt.step()
    return params, opt


def _assert_same_run(a, b) -> None:
    (ours, o_ours), (theirs, o_theirs) = a, b
    shapes = [tuple(o_ours.state[p]["adam.exp_avg"].shape) for p in ours]
    assert shapes == [(280, 700), (700, 280), (96, 520)]
    assert [int(o_ours.state[p]["adam.block_dim"]) for p in ours] == [0, 1, 1]
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
        s, t = o_ours.state[p], o_theirs.state[q]
        assert sorted(s) == sorted(t)
        for key, value in s.items():
            assert torch.equal(value, t[key]), key


def test_cpu_quantizer_run_bitwise_equals_bitsandbytes(monkeypatch):
    """On the CPU the 8-bit moments are quantized and dequantized in torch (the storage
    layer's CPU path) and stepped chunk by chunk; with bitsandbytes quantizing instead
    (use_torch patched to False: whole fp32 moments, bitsandbytes' kernels) the run is
    bitwise the same — parameters and every state tensor after 7 steps (_cpu_run)."""
    from galore2.storage import dynamic8

    assert dynamic8.use_torch(torch.zeros(1))  # bitsandbytes 0.50.2 on x86-64 here
    ours = _cpu_run()
    with monkeypatch.context() as m:
        m.setattr(dynamic8, "use_torch", lambda t: False)
        theirs = _cpu_run()
    _assert_same_run(ours, theirs)


def test_cpu_chunks_equal_one_chunk(monkeypatch):
    """The CPU path steps the 8-bit moments in chunks of whole blocks: chunks of 999
    elements (a few rows, or 256 rows down columns) give bitwise the run of one chunk per
    tensor — the arithmetic is elementwise."""
    from galore2.storage import dynamic8

    monkeypatch.setattr(dynamic8, "_CHUNK", 999)
    small = _cpu_run(4)
    monkeypatch.setattr(dynamic8, "_CHUNK", 1 << 40)
    _assert_same_run(small, _cpu_run(4))


def test_nonfinite_gradient_skips_and_leaves_state_unchanged():
    model = _resume_model()
    opt = _resume_opt(model)
    _resume_steps(model, opt, 0, 3)
    w1, _, w2, _, w3, _ = model.parameters()
    before = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in (w1, w2, w3)}
    weights = [p.detach().clone() for p in (w1, w2, w3)]
    for p in (w1, w2, w3):
        p.grad = torch.randn_like(p)
        p.grad[1, 2] = float("nan") if p is not w2 else float("inf")
    opt.step()
    assert opt.nonfinite_skips == 3
    for p, w in zip((w1, w2, w3), weights, strict=True):
        assert torch.equal(p, w)
        for k, v in before[p].items():
            if k != "nonfinite.skips":
                assert torch.equal(opt.state[p][k], v), k
        assert int(opt.state[p]["nonfinite.skips"]) == 1


@pytest.mark.parametrize("mode", ["project", "reset"])
def test_moments_on_refresh(mode):
    runs = {}
    for m in (mode, "keep"):
        model = _resume_model()
        opt = _resume_opt(model, update_proj_gap=3, moments_on_refresh=m)
        _resume_steps(model, opt, 0, 8)  # refreshes at steps 0, 3, 6
        runs[m] = (model, opt)
    model, opt = runs[mode]
    keep_model, keep_opt = runs["keep"]
    w1, _, _, _, w3, _ = model.parameters()
    k1, _, _, _, k3, _ = keep_model.parameters()
    for p, k in ((w1, k1), (w3, k3)):
        s = opt.state[p]
        assert int(s["galore.refreshes"]) == 3
        assert int(s["adam.step"]) == (2 if mode == "reset" else 8)  # reset at step 6
        m, v = _moments(opt, p)
        assert torch.isfinite(m).all() and (v >= 0).all() and v.sum() > 0
        assert not torch.equal(s["adam.exp_avg"], keep_opt.state[k]["adam.exp_avg"])
        assert torch.isfinite(p).all()


def _transform_state(layout: str, shape: tuple[int, int], steps: int = 3):
    """A ScaleByAdam8bit and a ScaleByAdam stepped on the same directions."""
    q, f = ScaleByAdam8bit(), ScaleByAdam()
    group = {"betas": (0.9, 0.999), "eps": 1e-8, "state_dtype": "float32"}
    ctx = Context(param=torch.zeros(shape), index=0, layout=layout)
    sq, sf = {}, {}
    q.init(torch.Size(shape), ctx.param, group, sq, ctx)
    f.init(torch.Size(shape), ctx.param, group, sf, ctx)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        u = torch.randn(shape, generator=g) * torch.logspace(-3, 0, shape[1])
        q.update(u, sq, group, ctx)
        f.update(u, sf, group, ctx)
    return q, f, sq, sf, group


# GaLore's left r×n moments ("cols": blocks down each column of r) rotate from the left,
# right m×r moments ("rows": blocks along each row of r) from the right.
@pytest.mark.parametrize(
    ("layout", "shape", "scales"), [("cols", (8, 600), (1, 600)), ("rows", (600, 8), (600, 1))]
)
def test_rotate_reset_second_moment_sum(layout, shape, scales):
    q, f, sq, sf, group = _transform_state(layout, shape)
    dim = 0 if layout == "cols" else 1
    assert int(sq["adam.block_dim"]) == dim
    assert sq["adam.exp_avg.absmax"].shape == scales

    def moments(s):
        return (
            dequantize(s["adam.exp_avg"], s["adam.exp_avg.absmax"], dim, True),
            dequantize(s["adam.exp_avg_sq"], s["adam.exp_avg_sq.absmax"], dim, False),
        )

    m, v = moments(sq)
    exact = v.sum(dtype=torch.float64) / (1 - 0.999**3)
    assert torch.equal(q.second_moment_sum(sq, group), exact)
    torch.testing.assert_close(
        q.second_moment_sum(sq, group), f.second_moment_sum(sf, group), rtol=0.02, atol=0
    )

    C = torch.linalg.qr(torch.randn(8, 8, generator=torch.Generator().manual_seed(1)))[0]

    def rotate(t, squared):
        R = C * C if squared else C
        return R @ t.float() if layout == "cols" else t.float() @ R

    q.rotate(sq, rotate)
    # exactly: dequantize → rotate → (clamp ≥ 0 for the second moment) → quantize
    for key, signed, value in (
        ("adam.exp_avg", True, rotate(m, False)),
        ("adam.exp_avg_sq", False, rotate(v, True).clamp_(min=0)),
    ):
        codes = torch.zeros(shape, dtype=torch.uint8)
        absmax = torch.zeros(scales)
        quantize_(value, codes, absmax, dim, signed)
        assert torch.equal(sq[key], codes) and torch.equal(sq[key + ".absmax"], absmax), key
    m2, v2 = moments(sq)
    assert (v2 >= 0).all() and not torch.equal(m2, m)
    torch.testing.assert_close(m2, rotate(m, False), atol=STATE_ATOL, rtol=STATE_RTOL * 50)

    q.reset(sq, group)
    assert int(sq["adam.step"]) == 0
    m3, v3 = moments(sq)
    assert not m3.any() and not v3.any()
    assert float(q.second_moment_sum(sq, group)) == 0.0


def test_update_many_equals_update_loop():
    group = {"betas": (0.9, 0.999), "eps": 1e-8, "state_dtype": "float32"}
    t = ScaleByAdam8bit()
    shapes = [(8, 600), (16, 16), (64, 100)]  # 8-bit, fp32, 8-bit
    ctxs = [Context(param=torch.zeros(s), index=i) for i, s in enumerate(shapes)]
    a = [{} for _ in shapes]
    for s, st, c in zip(shapes, a, ctxs, strict=True):
        t.init(torch.Size(s), c.param, group, st, c)
    b = [{k: v.clone() for k, v in st.items()} for st in a]
    for _ in range(3):
        us = [torch.randn(s) for s in shapes]
        batched = t.update_many(us, a, group, ctxs)
        looped = [t.update(u, st, group, c) for u, st, c in zip(us, b, ctxs, strict=True)]
        for x, y in zip(batched, looped, strict=True):
            assert torch.equal(x, y)
    for sa, sb in zip(a, b, strict=True):
        for k in sa:
            assert torch.equal(sa[k], sb[k])
    assert ["adam.exp_avg.absmax" in s for s in a] == [True, False, True]


@pytest.mark.parametrize("mode", ["torch", "triton"])
def test_stacked_update_many_bitwise_equals_update_loop(monkeypatch, mode):
    """Off the CPU's packs (CUDA, meta; here forced) the 8-bit directions of one shape,
    blocked axis and step go through one adam8bit_stack_ per stack — its torch path matrix
    by matrix, or (GALORE2_KERNELS=triton, the interpreter here) one fused launch: the same
    directions and state bits as per tensor, the states' codes and absmax packed once."""
    from galore2.kernels import dispatch

    if mode == "triton" and not dispatch.interpreter_enabled():
        pytest.skip("needs Triton's interpreter (no GPU here) to run the kernel on CPU tensors")
    monkeypatch.setenv(dispatch.ENV_VAR, mode)
    monkeypatch.setattr(adam8bit, "_on_stacks", lambda codes: True)
    calls = []
    real = adam8bit.adam8bit_stack_
    monkeypatch.setattr(adam8bit, "adam8bit_stack_",
                        lambda g, *a: calls.append(tuple(g.shape)) or real(g, *a))  # fmt: skip
    group = {"betas": (0.9, 0.999), "eps": 1e-8, "state_dtype": "float32", "foreach": True}
    t = ScaleByAdam8bit()
    shapes = [(16, 300), (300, 16), (16, 300), (16, 16), (300, 16), (8, 600), (16, 300)]
    layouts = ["cols", "rows", "cols", "param", "rows", "param", "cols"]
    ctxs = [Context(param=torch.zeros(s), index=i, layout=lay)
            for i, (s, lay) in enumerate(zip(shapes, layouts, strict=True))]  # fmt: skip
    a = [{} for _ in shapes]
    for s, st, c in zip(shapes, a, ctxs, strict=True):
        t.init(torch.Size(s), c.param, group, st, c)
    b = [{k: v.clone() for k, v in st.items()} for st in a]
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        us = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes]
        batched = t.update_many(us, a, group, ctxs)
        looped = [t.update(u, st, group, c) for u, st, c in zip(us, b, ctxs, strict=True)]
        for x, y, sa, sb in zip(batched, looped, a, b, strict=True):
            if "adam.exp_avg.absmax" not in sa:  # fp32 moments: torch's fused Adam batched
                assert_f32_close(x, y, steps=step + 1, what="fp32-moment direction")
                continue
            assert torch.equal(x, y)
            for k in sa:
                assert torch.equal(sa[k], sb[k]), k
        assert sorted(calls) == [(1, 8, 600), (2, 300, 16), (3, 16, 300)]
        calls.clear()
    # the three (16, 300) first moments are one stack now (packed at the first step)
    m = [a[i]["adam.exp_avg"] for i in (0, 2, 6)]
    assert m[0].untyped_storage().data_ptr() == m[2].untyped_storage().data_ptr()


@pytest.mark.parametrize("pack", [None, 5000], ids=["one_pack", "split_packs"])
def test_packed_update_many_bitwise_equals_update_loop(monkeypatch, pack):
    """foreach=True on the CPU packs every 8-bit direction of a step, whatever its blocked
    axis (rows of 600, 100 and 16; columns of 16 and 257: short and straddling blocks), into
    one dequantize / step / quantize: the same directions and state bits as per tensor,
    including an all-zero block and the fallback of a pack whose absmax is not finite or
    has no finite reciprocal (bitsandbytes per tensor)."""
    if pack is not None:  # packs of at most 5000 elements: each 8-bit tensor alone here
        monkeypatch.setattr(adam8bit, "_PACK", pack)
    group = {"betas": (0.9, 0.999), "eps": 1e-8, "state_dtype": "float32", "foreach": True}
    t = ScaleByAdam8bit()
    shapes = [(8, 600), (16, 16), (64, 100), (300, 16), (16, 300), (16, 300), (257, 20)]
    layouts = ["param", "param", "param", "rows", "cols", "cols", "cols"]
    ctxs = [Context(param=torch.zeros(s), index=i, layout=lay)
            for i, (s, lay) in enumerate(zip(shapes, layouts, strict=True))]  # fmt: skip
    a = [{} for _ in shapes]
    for s, st, c in zip(shapes, a, ctxs, strict=True):
        t.init(torch.Size(s), c.param, group, st, c)
    assert [int(s["adam.block_dim"]) if "adam.block_dim" in s else None for s in a] == [
        1, None, 1, 1, 0, 0, 0]  # fmt: skip
    b = [{k: v.clone() for k, v in st.items()} for st in a]
    packed = []  # what each packed quantization returned (None: the fallback)
    real = dynamic8.quantize_packed
    monkeypatch.setattr(
        dynamic8, "quantize_packed", lambda *a: packed.append(real(*a)) or packed[-1]
    )
    gen = torch.Generator().manual_seed(0)
    for step in range(5):
        us = [torch.randn(s, generator=gen) * 10.0**step for s in shapes]
        us[2][0] = 0.0  # an all-zero block (absmax 0) up to the last step
        if step == 4:  # a block of absmax 1e-40 (its reciprocal overflows); an inf
            us[2][0], us[3][5, 3] = 1e-39, float("inf")
        batched = t.update_many(us, a, group, ctxs)
        looped = [t.update(u, st, group, c) for u, st, c in zip(us, b, ctxs, strict=True)]
        for x, y, sa, sb in zip(batched, looped, a, b, strict=True):
            if "adam.block_dim" in sa or "adam.exp_avg.absmax" in sa:  # 8-bit: same kernels
                torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
                for k in sa:
                    torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, equal_nan=True)
                continue
            # a direction small enough to keep fp32 moments: batched, it is torch's fused Adam
            # kernel on the stacked moments (another rounding order), so a derived bound
            assert_f32_close(x, y, steps=step + 1, what="fp32-moment direction")
            for k in sa:
                if sa[k].is_floating_point():
                    assert_f32_close(sa[k], sb[k], steps=step + 1, what=k)
                else:
                    assert torch.equal(sa[k], sb[k]), k
        if step == 3:
            assert float(a[2]["adam.exp_avg.absmax"][0, 0]) == 0.0
    # the last step falls back where the tiny block (tensor 2) and the inf (tensor 3) are
    last = [True] if pack is None else [False, True, True, False, False, False]
    assert [p is None for p in packed] == [False] * 4 * len(last) + last


def test_missing_bitsandbytes_raises_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", None)
    p = nn.Parameter(torch.randn(64, 64))
    with pytest.raises(ImportError, match="pip install bitsandbytes"):
        galore2.GaLoreAdamW8bit([p])
    with pytest.raises(ImportError, match="pip install bitsandbytes"):
        ScaleByAdam8bit()
    galore2.GaLoreAdamW([p])  # the fp32 preset does not need it


def test_import_galore2_without_bitsandbytes():
    """GaLoreAdamW8bit without bitsandbytes: an ImportError saying ``pip install
    bitsandbytes`` (in tests/missing_backends.py's interpreter)."""
    assert_ok("adam8bit")


def test_fsdp2_matches_single_process():
    """2 gloo ranks: shard-independent quantizer (bitwise), then GaLoreAdamW8bit on
    fully_shard'ed LEFT / RIGHT / full-rank matrices against one process (bitwise for
    RIGHT and full rank; LEFT within the tolerance explained in adam8bit_fsdp_cases)."""
    spawn(adam8bit_fsdp_cases.run_all, 2)


@pytest.mark.slow
def test_dcp_checkpoint_reshards(tmp_path):
    """Saved at 2 ranks, loaded at 1 (no FSDP) and 3: the 8-bit state reshards exactly."""
    spawn(adam8bit_fsdp_cases.dcp_save, 2, str(tmp_path))
    spawn(adam8bit_fsdp_cases.dcp_load, 1, str(tmp_path))
    spawn(adam8bit_fsdp_cases.dcp_load, 3, str(tmp_path))
