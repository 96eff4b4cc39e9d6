"""INT8 weights (galore2.quantize_weights): the format, stochastic rounding, the apply stage
that re-quantizes for every preset, checkpoints, per-layer updates and refusals."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

import galore2
from galore2.storage.weights import INT8, Layout, QuantizedLinear, dequantize
from tests.helpers import TinyNet, batch, galore_groups, train

MATS = ("up", "mid", "down")


def _quantized(seed: int = 0, group_size: int | None = 8) -> TinyNet:
    torch.manual_seed(seed)
    model = TinyNet()
    galore2.quantize_weights(model, group_size=group_size, target_modules=list(MATS))
    return model


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ---- the format --------------------------------------------------------------------------
def test_quantize_weights_selects_linear_layers_and_keeps_the_rest():
    torch.manual_seed(0)
    model = TinyNet()
    dense = {n: getattr(model, n).weight.detach().clone() for n in MATS}
    names = galore2.quantize_weights(model, group_size=8)
    assert names == list(MATS)
    assert isinstance(model.norm, nn.LayerNorm) and model.norm.weight.dtype == torch.float32
    for n in MATS:
        m = getattr(model, n)
        assert isinstance(m, QuantizedLinear) and isinstance(m, nn.Linear)
        assert m.weight_codes.dtype == torch.int8 and m.weight_codes.shape == dense[n].shape
        # round to nearest: within half a step of each group's scale
        s = m.weight_scales.repeat_interleave(8, dim=1)[:, : dense[n].shape[1]]
        assert (dequantize(m.weight_codes, m.weight_scales, m.layout) - dense[n]).abs().le(
            s / 2 * (1 + 2**-20)
        ).all()
        # the shell holds one element; the state dict holds codes and scales, not it
        assert m.weight.untyped_storage().nbytes() == 4
    keys = set(model.state_dict())
    assert "up.weight" not in keys and {"up.weight_codes", "up.weight_scales"} <= keys


def test_per_output_channel_scales():
    model = _quantized(group_size=None)
    assert model.up.weight_scales.shape == (40, 1) and model.down.weight_scales.shape == (12, 1)


def test_forward_and_backward_match_a_linear_with_the_dequantized_weight():
    model = _quantized()
    q = model.mid
    ref = nn.Linear(40, 40)
    with torch.no_grad():
        ref.weight.copy_(dequantize(q.weight_codes, q.weight_scales, q.layout))
        ref.bias.copy_(q.bias)
    x = torch.randn(6, 40)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = q(x1), ref(x2)
    assert torch.equal(y1, y2)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    assert torch.equal(x1.grad, x2.grad)
    assert torch.equal(q.weight.grad, ref.weight.grad)
    assert torch.equal(q.bias.grad, ref.bias.grad)
    assert q.weight.grad.is_contiguous()


def test_deepcopy_is_an_independent_quantized_model():
    model = _quantized()
    twin = copy.deepcopy(model)
    assert twin.up.weight.untyped_storage().nbytes() == 4
    assert getattr(twin.up.weight, "_galore2_weight").module is twin.up
    before = _snapshot(model)
    train(twin, galore2.GaLoreAdamW(galore_groups(twin, rank=4), lr=1e-2), range(3))
    _assert_same(model.state_dict(), before)  # the original is untouched
    train(model, galore2.GaLoreAdamW(galore_groups(model, rank=4), lr=1e-2), range(3))
    _assert_same(model.state_dict(), twin.state_dict())  # and trains to the same bits


def test_to_dtype_keeps_fp32_scales_and_a_one_element_shell():
    model = _quantized().to(torch.float64)
    assert model.up.weight_scales.dtype == torch.float32
    assert model.up.weight.dtype == torch.float64
    assert model.up.weight.untyped_storage().nbytes() == 8
    assert model.up.weight_writes.device.type == "cpu"
    assert model(torch.randn(2, 24, dtype=torch.float64)).dtype == torch.float64


# ---- stochastic rounding -----------------------------------------------------------------
def _hoeffding(n: int, width: float, entries: int, p_fail: float = 1e-9) -> float:
    """|mean − expectation| bound for n independent draws in an interval of ``width``,
    holding for all ``entries`` at once except with probability ``p_fail`` (Hoeffding)."""
    return width * math.sqrt(math.log(2 * entries / p_fail) / (2 * n))


def test_stochastic_rounding_is_unbiased():
    """The mean of many writes of the same values equals the values: each write rounds
    x / s to floor or ceil, an error within one step s, so the mean of n writes is within
    Hoeffding's bound of x. Round-to-nearest is off by 0.3·s here (fractions of 0.3/0.7)."""
    model = _quantized(group_size=None)
    m = model.down  # 12 × 40, one scale per row
    codes = torch.arange(-20, 20, dtype=torch.float32).repeat(12, 1)
    codes[:, 0] = 127.0  # the absmax of every row: its scale is fixed
    s = torch.linspace(0.01, 0.02, 12)[:, None]
    x = (codes + torch.where(codes.abs() < 127, 0.3, 0.0)) * s
    x[:, 1::2] -= 0.6 * s.expand(12, 40)[:, 1::2] * (codes[:, 1::2].abs() < 127)
    store = getattr(m.weight, "_galore2_weight")
    n = 4000
    total = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(n):
        store.write(x)
        total += dequantize(m.weight_codes, m.weight_scales, m.layout).double()
    assert torch.equal(m.weight_scales, (x.abs().amax(1, keepdim=True) / 127))
    err = (total / n - x.double()).abs()
    bound = _hoeffding(n, 1.0, x.numel()) * s.double()
    assert (err <= bound).all(), float((err / s).max())
    assert int(m.weight_writes) == n


def test_update_below_the_step_moves_the_weight_in_expectation():
    """Adam with a constant gradient moves every weight by lr per step (m̂/√v̂ = 1); with
    lr = s/10 round-to-nearest would never move a code. With stochastic rounding each
    write is unbiased, so after T steps the weights moved by T·lr on average: the mean
    over k entries of a sum of T roundings (each within one step s) is within
    Hoeffding's bound s·√(T·ln(2/p) / (2k))."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 32, bias=False)
    galore2.quantize_weights(layer, group_size=None)
    before = dequantize(layer.weight_codes, layer.weight_scales, layer.layout).double()
    s = float(layer.weight_scales.max())
    lr, steps = s / 10, 100
    opt = galore2.GaLoreAdamW([layer.weight], lr=lr, weight_decay=0.0, eps=1e-12)
    for _ in range(steps):
        layer.weight.grad = torch.ones(32, 64)
        opt.step()
    after = dequantize(layer.weight_codes, layer.weight_scales, layer.layout).double()
    moved = float((before - after).mean())
    k = before.numel()
    bound = s * math.sqrt(steps * math.log(2 / 1e-9) / (2 * k))
    assert abs(moved - steps * lr) <= bound + steps * lr * 1e-6, (moved, steps * lr, bound)


def test_a_non_finite_write_leaves_codes_and_scales():
    m = _quantized().mid
    before = _snapshot(m)
    x = dequantize(m.weight_codes, m.weight_scales, m.layout)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[3, 5] = bad
        getattr(m.weight, "_galore2_weight").write(y)
        assert torch.equal(m.weight_codes, before["weight_codes"])
        assert torch.equal(m.weight_scales, before["weight_scales"])


def test_a_non_finite_gradient_is_skipped_and_leaves_the_codes_exactly():
    model = _quantized()
    opt = galore2.GaLoreAdamW(galore_groups(model, rank=4), lr=1e-2)
    train(model, opt, range(2))
    before = _snapshot(model)
    x, y = batch(5)
    (model(x) - y).pow(2).mean().backward()
    model.mid.weight.grad[0, 0] = float("nan")
    opt.step()
    assert opt.nonfinite_skips == 1
    for k in ("mid.weight_codes", "mid.weight_scales", "mid.weight_writes"):
        assert torch.equal(model.state_dict()[k], before[k])
    assert not torch.equal(model.state_dict()["up.weight_codes"], before["up.weight_codes"])


# ---- every preset ------------------------------------------------------------------------
PRESETS = {
    "adamw": (galore2.GaLoreAdamW, {}, {}),  # rank=None: plain AdamW
    "galore_adamw": (galore2.GaLoreAdamW, {"rank": 4}, {}),
    "galore_adamw8bit": (galore2.GaLoreAdamW8bit, {"rank": 4}, {}),
    "galore_adafactor": (galore2.GaLoreAdafactor, {"rank": 4}, {}),
    "fira": (galore2.Fira, {"rank": 4}, {}),
    "apollo": (galore2.APOLLO, {"rank": 4}, {}),
    "apollo_mini": (galore2.APOLLOMini, {"rank": 1}, {}),
    "galore_muon": (galore2.GaLoreMuon, {"rank": 4}, {}),
    "ranger21": (galore2.Ranger21, {}, {"num_iterations": 30}),
    "galore_ranger21": (galore2.GaLoreRanger21, {"rank": 4}, {"num_iterations": 30}),
}


def _preset_opt(model: nn.Module, name: str, lr: float = 1e-2) -> torch.optim.Optimizer:
    cls, group, kwargs = PRESETS[name]
    gap = {"update_proj_gap": 5} if "rank" in group else {}
    groups = galore_groups(model, **gap, **group)
    return cls(groups, lr=lr, **kwargs)


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_trains_int8_weights(name):
    model = _quantized()
    dense = copy.deepcopy(model.norm)
    opt = _preset_opt(model, name)
    losses = train(model, opt, range(30))
    assert all(map(math.isfinite, losses))
    assert sum(losses[-5:]) / 5 < losses[0], losses
    for n in MATS:
        assert int(getattr(model, n).weight_writes) == 30
    assert not torch.equal(model.norm.weight, dense.weight)  # the plain group trains too


def test_state_bytes_counts_the_int8_weights_apart():
    model = _quantized()
    opt = galore2.GaLoreAdamW(galore_groups(model, rank=4), lr=1e-2)
    opt.init_state()
    got = opt.state_bytes()
    # codes (1 byte) + one fp32 scale per 8 inputs (24, 40, 40 inputs: 3, 5, 5 groups)
    assert got["weights"] == 40 * 24 + 40 * 40 + 12 * 40 + 4 * (40 * 3 + 40 * 5 + 12 * 5)
    assert got["total"] == sum(v for k, v in got.items() if k not in ("total", "weights"))


def test_quantized_training_follows_the_dense_run():
    """GaLoreAdamW on int8 weights ends near the same loss as on fp32 weights (loose: the
    rounding noise is of the order of a quantization step per write)."""
    torch.manual_seed(0)
    ref = TinyNet()
    model = copy.deepcopy(ref)
    galore2.quantize_weights(model, group_size=8, target_modules=list(MATS))
    a = train(ref, galore2.GaLoreAdamW(galore_groups(ref, rank=4), lr=1e-2), range(60))
    b = train(model, galore2.GaLoreAdamW(galore_groups(model, rank=4), lr=1e-2), range(60))
    assert sum(b[-10:]) / 10 < sum(a[:10]) / 10
    assert abs(sum(b[-10:]) - sum(a[-10:])) / sum(a[-10:]) < 0.1


# ---- checkpoints -------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["galore_adamw", "galore_adamw8bit", "fira", "ranger21"])
def test_resume_is_bit_identical(name):
    whole = _quantized()
    opt = _preset_opt(whole, name)
    train(whole, opt, range(6))

    first = _quantized()
    opt1 = _preset_opt(first, name)
    train(first, opt1, range(3))
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt1.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh = _quantized(seed=1)  # other weights, other codes: all replaced by the load
    fresh.load_state_dict(saved["model"])
    opt2 = _preset_opt(fresh, name)
    opt2.load_state_dict(saved["opt"])
    train(fresh, opt2, range(3, 6))
    _assert_same(fresh.state_dict(), whole.state_dict())


def test_loading_a_dense_checkpoint_into_a_quantized_model_is_refused():
    torch.manual_seed(0)
    dense = TinyNet().state_dict()
    model = _quantized()
    with pytest.raises(RuntimeError, match="load the checkpoint before galore2.quantize_weights"):
        model.load_state_dict(dense)


def test_state_dict_keeps_parameter_order():
    model = _quantized()
    names = [n for n, _ in model.named_parameters()]
    model.load_state_dict(model.state_dict())
    assert [n for n, _ in model.named_parameters()] == names
    assert names[:2] == ["up.weight", "up.bias"]


# ---- per-layer updates -------------------------------------------------------------------
def test_per_layer_updates_equal_the_ordinary_step():
    ref = _quantized()
    model = _quantized()
    ref_opt = galore2.GaLoreAdamW(galore_groups(ref, rank=4, update_proj_gap=3), lr=1e-2)
    opt = galore2.GaLoreAdamW(galore_groups(model, rank=4, update_proj_gap=3), lr=1e-2)
    train(ref, ref_opt, range(5))
    updates = galore2.per_layer(model, opt)
    for step in range(5):
        x, y = batch(step)
        updates.backward((model(x) - y).pow(2).mean())
    _assert_same(model.state_dict(), ref.state_dict())


# ---- refusals ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bits": 4}, "bits must be one of"),
        ({"bits": True}, "bits must be one of"),
        ({"group_size": 1}, "group_size must be an int >= 2 or None"),
        ({"group_size": 8.0}, "group_size must be an int >= 2 or None"),
        ({"seed": 0.5}, "seed must be an int"),
        ({"target_modules": ["up", "norm"]}, "'norm' \\(LayerNorm\\) is not an nn.Linear"),
        ({"target_modules": ["nothing"]}, "selected no nn.Linear"),
        ({"target_modules": 3}, "target_modules must be"),
    ],
)
def test_bad_arguments_raise_before_anything_changes(kwargs, match):
    torch.manual_seed(0)
    model = TinyNet()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=match):
        galore2.quantize_weights(model, **kwargs)
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    _assert_same(model.state_dict(), before)


def test_capturable_is_refused_before_anything_changes():
    model = _quantized()
    opt = galore2.GaLoreAdamW(galore_groups(model, rank=4), lr=1e-2, capturable=True)
    before = _snapshot(model)
    x, y = batch(0)
    (model(x) - y).pow(2).mean().backward()
    with pytest.raises(ValueError, match="capturable=True does not support"):
        opt.step()
    _assert_same(model.state_dict(), before)
    assert not opt.state


def test_stochastic_encode_refuses_hadamard():
    class Plan:
        rank, group_size, hadamard, basis_seed = 8, 8, True, 0

    with pytest.raises(ValueError, match="not defined with basis_hadamard"):
        INT8.encode(torch.randn(2, 8), Plan(), noise=torch.rand(2, 8))


def test_layout_is_the_basis_format():
    """The weight codes are the int8 basis format's (one quantizer): encode/decode agree."""
    x = torch.randn(5, 20)
    layout = Layout(20, 8)
    codes, scales = INT8.encode(x, layout)
    assert scales.shape == (5, 3)
    assert (INT8.decode(codes, scales, layout) - x).abs().max() <= scales.max() / 2 * 1.0001


def _fsdp_refused(rank: int, world: int) -> None:
    from tests.dist import make_model, shard

    model = shard(make_model(), world)
    with pytest.raises(ValueError, match="not supported under FSDP2.*galore2.per_layer"):
        galore2.quantize_weights(model)


def test_fsdp2_is_refused_with_the_alternative():
    from tests.dist import spawn

    spawn(_fsdp_refused, 2)


def test_bf16_model_keeps_bf16_compute_and_gradients():
    torch.manual_seed(0)
    model = TinyNet().to(torch.bfloat16)
    galore2.quantize_weights(model, group_size=8, target_modules=list(MATS))
    opt = galore2.GaLoreAdamW(galore_groups(model, rank=4), lr=1e-2)
    x, y = batch(0)
    out = model(x.bfloat16())
    assert out.dtype == torch.bfloat16
    (out - y.bfloat16()).pow(2).mean().backward()
    assert model.mid.weight.grad.dtype == torch.bfloat16
    opt.step()
    assert int(model.mid.weight_writes) == 1
    losses = train(model, opt, range(1, 10))
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0]
