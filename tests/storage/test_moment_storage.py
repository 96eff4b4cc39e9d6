"""8-bit moments of PNM and Adafactor (``moments_8bit``): the storage layer's ``dynamic8``
format (galore2.storage) under modules other than Adam."""

from __future__ import annotations

import io

import bitsandbytes  # noqa: F401  (the `test` extra: missing, it fails the run)
import pytest
import torch
from torch import nn

import galore2
from galore2.optim.adafactor import ScaleByAdafactor
from galore2.optim.pnm import ScaleByPNM
from galore2.storage.moments import stored_format

# today's 8-bit Adam tolerances against fp32 Adam (tests/test_adam8bit.py, bitsandbytes'
# own): dequantized states within atol=3e-3, rtol=1e-3, fewer than 20 elements out;
# parameters: mean |difference| below bnb's per-step err.mean() bound. (Its elementwise
# parameter bound, atol=1e-5, is too tight for PNM: the softplus denominator floor and the
# (2·m_a − m_p)/√5 numerator amplify a moment's rounding ~3×; measured max 3.7e-5.)
STATE_ATOL, STATE_RTOL, STATE_MAX_BAD = 3e-3, 1e-3, 20
ERR_MEAN = 6e-5

SIGNED = {
    "pnm.exp_avg": True,
    "pnm.neg_exp_avg": True,
    "adafactor.exp_avg": True,
    "adam.exp_avg": True,
}


def _dense(state: dict, key: str) -> torch.Tensor:
    axis = {"adam": "adam.block_dim", "pnm": "pnm.block_dim"}.get(key.split(".")[0])
    return stored_format(state, key, SIGNED.get(key, False)).view(state, key, axis).float()


def _not_close(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((~torch.isclose(a, b, atol=STATE_ATOL, rtol=STATE_RTOL)).sum())


def _pair(cls, shape, **kw):
    """The same run with fp32 and with 8-bit moments: (optimizers, parameters)."""
    torch.manual_seed(0)
    w = torch.randn(shape) * 0.1
    params = [nn.Parameter(w.clone()) for _ in range(2)]
    opts = [
        cls([p], moments_8bit=flag, **kw) for p, flag in zip(params, (False, True), strict=True)
    ]
    g = torch.Generator().manual_seed(1)
    for _ in range(30):
        grad = torch.randn(shape, generator=g) * 0.01  # bitsandbytes' test gradients
        for p, o in zip(params, opts, strict=True):
            p.grad = grad.clone()
            o.step()
    return opts, params


PLAIN = {"use_agc": False, "use_gc": False, "use_gn": False}  # the gradient as it comes


def _ranger(params, **kw):
    return galore2.Ranger21(
        params, lr=1e-3, num_iterations=100, use_warmup=False, use_warmdown=False, **kw
    )


@pytest.mark.parametrize("amsgrad", [False, True])
def test_pnm_8bit_close_to_fp32(amsgrad):
    (o32, o8), (p32, p8) = _pair(_ranger, (256, 300), amsgrad=amsgrad, **PLAIN)
    s32, s8 = o32.state[p32], o8.state[p8]
    keys = ["pnm.exp_avg", "pnm.neg_exp_avg", "pnm.exp_avg_sq"]
    keys += ["pnm.max_exp_avg_sq"] if amsgrad else []
    for key in keys:
        assert s8[key].dtype == torch.uint8 and s8[key].shape == p8.shape, key
        assert s32[key].dtype == torch.float32, key
        assert _not_close(_dense(s8, key), s32[key]) < STATE_MAX_BAD, key
    assert 0 < (p8 - p32).abs().mean() < ERR_MEAN


def test_adam_inside_ranger21_8bit_without_pnm():
    (o32, o8), (p32, p8) = _pair(_ranger, (256, 300), use_pnm=False, softplus=False, **PLAIN)
    s8 = o8.state[p8]
    assert s8["adam.exp_avg"].dtype == torch.uint8
    for key in ("adam.exp_avg", "adam.exp_avg_sq"):
        assert _not_close(_dense(s8, key), o32.state[p32][key]) < STATE_MAX_BAD
    assert 0 < (p8 - p32).abs().mean() < ERR_MEAN


def _adafactor(params, **kw):
    return galore2.GaLoreAdafactor(
        params, lr=1e-3, beta1=0.9, relative_step=False, scale_parameter=False, **kw
    )


def test_adafactor_8bit_close_to_fp32():
    # (4, 64, 300): batched, so the column factor (4, 1, 300) has 1200 elements (fp32) and
    # the momentum 76800 (8-bit); (256, 300): 8-bit momentum, fp32 factors.
    for shape in ((256, 300), (4, 64, 300)):
        (o32, o8), (p32, p8) = _pair(_adafactor, shape)
        s32, s8 = o32.state[p32], o8.state[p8]
        assert s8["adafactor.exp_avg"].dtype == torch.uint8
        assert s8["adafactor.row_var"].dtype == torch.float32  # (…, m, 1): nothing to block
        for key in ("adafactor.row_var", "adafactor.col_var"):
            assert _not_close(_dense(s8, key), s32[key]) < STATE_MAX_BAD, (shape, key)
        # the momentum is one of U = G/√V̂ (RMS ~1, not the gradient's 0.01): compared in
        # gradient units, i.e. times √V̂ ≈ 0.01, the scale the Adam tolerances are for
        a, b = _dense(s8, "adafactor.exp_avg") * 0.01, s32["adafactor.exp_avg"] * 0.01
        assert _not_close(a, b) < STATE_MAX_BAD, shape
        # Adafactor's steps are RMS-clipped to ~1 per element, larger than Adam's on noisy
        # gradients (|m̂|/√v̂ well below 1): twice the bound (measured 6.2e-5 for (256, 300))
        assert 0 < (p8 - p32).abs().mean() < 2 * ERR_MEAN


def test_adafactor_long_factor_is_8bit():
    # a (2, 8, 4096) direction: the column factor (2, 1, 4096) has 8192 elements, blocked
    # along its 4096 columns; the row factor (2, 8, 1) stays fp32
    opt = _adafactor([nn.Parameter(torch.zeros(2, 8, 4096))], moments_8bit=True)
    opt.init_state()
    (s,) = opt.state.values()
    assert s["adafactor.col_var"].dtype == torch.uint8
    assert s["adafactor.col_var.absmax"].shape == (2, 16)
    assert s["adafactor.row_var"].dtype == torch.float32


def test_state_bytes_about_one_byte_per_element():
    w = nn.Parameter(torch.zeros(1024, 1024))
    n, absmax = 1024 * 1024, 1024 * 4 * 4  # codes + one fp32 absmax per row block of 256
    cases = [
        (_ranger([w], moments_8bit=True), 3 * (n + absmax)),  # PNM: 3 moments
        (_ranger([w], moments_8bit=True, use_pnm=False, softplus=False), 2 * (n + absmax)),  # Adam
        # momentum 8-bit; factors (1024, 1) and (1, 1024) fp32
        (_adafactor([w], moments_8bit=True), n + absmax + 2 * 1024 * 4),
    ]
    for opt, expected in cases:
        opt.init_state()
        got = opt.state_bytes()["moments"]
        assert got == expected, (type(opt).__name__, got, expected)
        assert got / (expected // (n + absmax) * n) < 1.03  # ~1 byte per moment element


def _run(opt, params, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 0.01
        opt.step()


@pytest.mark.parametrize("preset", ["ranger21", "adafactor"])
def test_state_dict_round_trip_weights_only(preset):
    def make(params):
        kw = {"rank": 8, "update_proj_gap": 3, "moments_8bit": True}
        if preset == "ranger21":
            return galore2.GaLoreRanger21(
                params, lr=1e-3, num_iterations=20, use_warmup=False, use_warmdown=False, **kw
            )
        return _adafactor(params, **kw)

    torch.manual_seed(0)
    # LEFT-projected 64×1024 (8×1024 moments: 8-bit) and a full-rank 64×64 (8-bit)
    init = [torch.randn(64, 1024) * 0.1, torch.randn(64, 64) * 0.1]
    straight = [nn.Parameter(t.clone()) for t in init]
    opt = make(straight)
    _run(opt, straight, 4, seed=1)
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in straight], "opt": opt.state_dict()}, buf)
    assert any(t.dtype == torch.uint8 for s in opt.state.values() for t in s.values())
    _run(opt, straight, 4, seed=2)  # crosses a subspace refresh (every 3 steps)

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = [nn.Parameter(t.clone()) for t in saved["params"]]
    opt2 = make(resumed)
    opt2.load_state_dict(saved["opt"])
    _run(opt2, resumed, 4, seed=2)
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b)


def test_moments_argument_is_checked():
    with pytest.raises(ValueError, match="moments must be one of"):
        ScaleByPNM(moments="int8")
    with pytest.raises(ValueError, match="moments must be one of"):
        ScaleByAdafactor(moments="float8")


def test_adafactor_8bit_next_to_bf16_factors():
    # state_dtype bf16: the (2, 1, 4096) column factor and the momentum are 8-bit, the row
    # factor bf16 — computed together in fp32, each stored in its own format
    p = nn.Parameter(torch.randn(2, 8, 4096) * 0.1)
    opt = _adafactor([p], moments_8bit=True, state_dtype="bfloat16")
    for _ in range(3):
        p.grad = torch.randn_like(p) * 0.01
        opt.step()
    s = opt.state[p]
    assert s["adafactor.row_var"].dtype == torch.bfloat16
    assert s["adafactor.col_var"].dtype == torch.uint8
    assert torch.isfinite(p).all()


def test_checkpoint_with_pre_storage_layer_8bit_keys_resumes_bit_identically():
    """GaLoreAdamW8bit wrote its quantized moments as ``adam8.*`` before the storage layer
    was shared; such a checkpoint loads (keys renamed) and continues exactly."""
    torch.manual_seed(0)
    model = nn.Linear(512, 64)
    groups = galore2.param_groups(model, rank=16, update_proj_gap=2)
    opt = galore2.GaLoreAdamW8bit(groups, lr=1e-2)

    def step():
        model.weight.grad = torch.randn_like(model.weight)
        model.bias.grad = torch.randn_like(model.bias)
        opt.step()

    for _ in range(3):
        step()
    sd = opt.state_dict()
    old = {
        "state": {
            pid: {
                (
                    k.replace("adam.", "adam8.", 1)
                    if "absmax" in k
                    or (
                        k in ("adam.exp_avg", "adam.exp_avg_sq", "adam.block_dim")
                        and any("absmax" in j for j in s)
                    )
                    else k
                ): v
                for k, v in s.items()
            }
            for pid, s in sd["state"].items()
        },
        "param_groups": sd["param_groups"],
    }
    assert any(k.startswith("adam8.") for s in old["state"].values() for k in s)
    buf = io.BytesIO()
    torch.save(old, buf)
    buf.seek(0)
    clone = nn.Linear(512, 64)
    clone.load_state_dict(model.state_dict())
    fresh = galore2.GaLoreAdamW8bit(
        galore2.param_groups(clone, rank=16, update_proj_gap=2), lr=1e-2
    )
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert not any(k.startswith("adam8.") for s in fresh.state.values() for k in s)
    g = [torch.randn_like(model.weight), torch.randn_like(model.bias)]
    for m, o in ((model, opt), (clone, fresh)):
        m.weight.grad, m.bias.grad = g[0].clone(), g[1].clone()
        o.step()
    assert torch.equal(model.weight, clone.weight) and torch.equal(model.bias, clone.bias)
