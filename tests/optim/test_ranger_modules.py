"""Ranger21's gradient and weight modules, each against its closed form (and under FSDP2)."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from galore2.core.transform import Context
from galore2.optim.gradient import AdaptiveGradientClipping, CentralizeGradient, NormalizeGradient
from galore2.optim.weights import Lookahead, NormLoss, StableWeightDecay, stochastic_round_bf16

from ..dist import spawn
from ..fsdp import ranger_fsdp_cases
from ..fsdp.ranger_fsdp_cases import all_modules, chain_optimizer
from ..helpers import TinyNet, max_diff, train


def _grad(module, g, w, **group):
    module.validate(group)
    module.apply_(g, group, {}, Context(param=w, index=0))
    return g


def test_centralized_rows_have_zero_mean_and_vectors_are_untouched():
    torch.manual_seed(0)
    for shape in [(6, 7), (5, 3, 4)]:
        g = torch.randn(shape, dtype=torch.float64) + 3.0
        before = g.clone()
        _grad(CentralizeGradient(), g, torch.zeros(shape, dtype=torch.float64))
        assert g.flatten(1).mean(1).abs().max() < 1e-15
        shift = (before - g).flatten(1)
        assert torch.allclose(shift, before.flatten(1).mean(1, keepdim=True).expand_as(shift))
    v = torch.randn(9)
    assert torch.equal(_grad(CentralizeGradient(), v.clone(), torch.zeros(9)), v)


def test_agc_clips_each_row_to_the_exact_ratio_and_is_a_no_op_below_it():
    torch.manual_seed(0)
    w = torch.randn(6, 5, dtype=torch.float64)
    w[3] = 0.0  # ‖w‖ < ε: the threshold uses ε
    g = torch.randn(6, 5, dtype=torch.float64)
    g[0] *= 1e-4  # below λ‖w‖
    g[4] = 0.0  # zero gradient: unchanged, no NaN
    lam, eps = 0.1, 1e-3
    limit = lam * w.norm(dim=1).clamp_min(eps)
    below = g.norm(dim=1) <= limit
    assert below[0] and below[4] and not below[1:4].any() and not below[5]
    out = _grad(AdaptiveGradientClipping(), g.clone(), w, agc_clip=lam, agc_eps=eps)
    assert torch.equal(out[below], g[below])  # bit-identical
    ratio = out.norm(dim=1) / w.norm(dim=1).clamp_min(eps)
    assert torch.allclose(ratio[~below], torch.full_like(ratio[~below], lam), rtol=1e-12)
    cos = torch.nn.functional.cosine_similarity(out[~below], g[~below], dim=1)
    assert torch.allclose(cos, torch.ones_like(cos))  # direction kept
    # agc_clip = 0 disables; a vector is one unit (whole-tensor norms)
    assert torch.equal(_grad(AdaptiveGradientClipping(), g.clone(), w, agc_clip=0.0), g)
    v, b = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    out = _grad(AdaptiveGradientClipping(), v.clone(), b, agc_clip=lam)
    assert torch.allclose(out.norm() / b.norm(), torch.tensor(lam, dtype=torch.float64))


def test_normalized_gradient_has_unit_population_std_and_never_nan():
    torch.manual_seed(0)
    g = torch.randn(7, 5, dtype=torch.float64) * 3 + 2
    out = _grad(NormalizeGradient(), g.clone(), g)
    assert abs(out.std(correction=0).item() - 1.0) < 1e-8
    assert torch.allclose(out, g / g.std(correction=0))
    zero = _grad(NormalizeGradient(), torch.zeros(4, 3), torch.zeros(4, 3))
    assert torch.equal(zero, torch.zeros(4, 3))  # exactly 0, not NaN
    for dtype in (torch.float32, torch.float16):  # unbiased std: NaN; g/eps: fp16 overflow
        one = _grad(NormalizeGradient(), torch.tensor([0.5], dtype=dtype), torch.zeros(1))
        assert torch.equal(one, torch.tensor([0.5], dtype=dtype))  # left unchanged
    # through the optimizer: a one-element parameter and all-zero gradients stay finite
    p, q = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(3, 2))
    opt = chain_optimizer([p, q], grad_transforms=[NormalizeGradient()])
    for grads in ((torch.tensor([0.3]), torch.zeros(3, 2)), (torch.zeros(1), torch.ones(3, 2))):
        p.grad, q.grad = grads
        opt.step()
    assert torch.isfinite(p).all() and torch.isfinite(q).all() and opt.nonfinite_skips == 0


def _weights(module, w, lr=0.1, stats=None, **group):
    group = {"lr": lr, **group}
    module.validate(group)
    module.apply_(group, {}, Context(param=w, index=0), stats)
    return w


def test_norm_loss_has_its_fixed_point_at_unit_norm():
    unit = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, -0.5, 0.5]])
    assert torch.equal(_weights(NormLoss(), unit.clone(), norm_loss_factor=0.5), unit)
    w = torch.tensor([[3.0, 0.0, 4.0], [0.1, 0.1, 0.0], [0.6, 0.0, 0.8]], dtype=torch.float64)
    lr, lam, eps = 0.1, 0.5, 1e-8
    out = _weights(NormLoss(), w.clone(), lr, norm_loss_factor=lam, norm_loss_eps=eps)
    norms = w.norm(dim=1, keepdim=True)
    expected = w * (1 - lr * 2 * lam * (1 - 1 / (norms + eps)))
    assert torch.allclose(out, expected, rtol=1e-15, atol=0)
    new = out.norm(dim=1)
    assert new[0] < 5.0 and new[0] > 1.0  # shrinks toward 1
    assert new[1] > norms[1, 0] and new[1] < 1.0  # grows toward 1
    v = torch.tensor([2.0, 0.0], dtype=torch.float64)  # a vector: its whole norm
    out = _weights(NormLoss(), v.clone(), lr, norm_loss_factor=lam, norm_loss_eps=eps)
    assert torch.allclose(out, v * (1 - lr * 2 * lam * (1 - 1 / (2 + eps))), rtol=1e-15)


def _swd_groups(model, decay=True):
    mats = [model.up.weight, model.mid.weight, model.down.weight]
    rest = [p for p in model.parameters() if all(p is not m for m in mats)]
    return [{"params": mats, "weight_decay": 0.3 if decay else 0.0}, {"params": rest, "lr": 2e-2}]


def test_stable_weight_decay_reaches_every_parameter_with_sigma_from_adam_states():
    """Regression for Ranger21 issue #53 (only one parameter per group was decayed)."""
    model = TinyNet().double()
    plain = copy.deepcopy(model)
    kw = {"state_dtype": "float64", "weight_decay": 0.1}
    opt = chain_optimizer(_swd_groups(model), param_transforms=[StableWeightDecay()], **kw)
    ref = chain_optimizer(_swd_groups(plain, decay=False), state_dtype="float64")  # no decay at all
    for step in range(3):
        train(model, opt, range(step, step + 1))
        before = [p.detach().clone() for p in plain.parameters()]
        train(plain, ref, range(step, step + 1))  # the same step without decay
        v_hat = sum(
            s["adam.exp_avg_sq"].sum() / (1 - 0.999 ** int(s["adam.step"]))
            for s in ref.state.values()
        )
        sigma = (v_hat / sum(p.numel() for p in plain.parameters())).sqrt().item()
        for group, ref_group in zip(opt.param_groups, ref.param_groups, strict=True):
            factor = 1 - group["lr"] * group["weight_decay"] / sigma
            assert factor < 1 - 1e-4  # a visible decay
            for p, q in zip(group["params"], ref_group["params"], strict=True):
                assert torch.allclose(p, q * factor, rtol=1e-14, atol=0)
                q.data.copy_(p)  # both runs go on from the decayed weights
        assert all(not torch.equal(a, b) for a, b in zip(before, plain.parameters(), strict=True))
    # σ = 0 (all gradients zero so far): no decay, no NaN
    p = torch.nn.Parameter(torch.ones(3, 2))
    opt = chain_optimizer([p], param_transforms=[StableWeightDecay()], weight_decay=0.5)
    p.grad = torch.zeros(3, 2)
    opt.step()
    assert torch.equal(p.detach(), torch.ones(3, 2))


def test_lookahead_interpolates_every_k_steps():
    k, alpha = 3, 0.5
    model = TinyNet().double()
    fast = copy.deepcopy(model)
    w0 = [p.detach().clone() for p in model.parameters()]
    opt = chain_optimizer(
        model.parameters(), param_transforms=[Lookahead()], lookahead_k=k, lookahead_alpha=alpha
    )
    train(model, opt, range(k))
    train(fast, chain_optimizer(fast.parameters()), range(k))
    for p, q, s in zip(model.parameters(), fast.parameters(), w0, strict=True):
        assert torch.allclose(p, s + alpha * (q - s), rtol=1e-14, atol=1e-16)
        assert torch.equal(opt.state[p]["lookahead.slow"], p.detach())
        assert int(opt.state[p]["lookahead.step"]) == k


@pytest.mark.parametrize("alpha", [0.8, 0.3])
def test_lookahead_matches_a_float64_hand_computation(alpha):
    """α ≠ 0.5, so α and 1 − α differ: every k steps slow ← slow + α·(fast − slow) and
    fast ← slow, computed by hand (float64) around the same inner Adam; two full cycles
    and a partial one."""
    k, steps = 3, 8
    torch.manual_seed(0)
    model = TinyNet().double()
    ref = copy.deepcopy(model)
    slow = [p.detach().clone() for p in ref.parameters()]
    opt = chain_optimizer(
        model.parameters(), param_transforms=[Lookahead()], lookahead_k=k, lookahead_alpha=alpha
    )
    inner = chain_optimizer(ref.parameters())
    for step in range(steps):
        train(model, opt, range(step, step + 1))
        train(ref, inner, range(step, step + 1))
        if (step + 1) % k == 0:
            with torch.no_grad():
                for s, fast in zip(slow, ref.parameters(), strict=True):
                    s.add_(alpha * (fast - s))
                    fast.copy_(s)
        for p, q, s in zip(model.parameters(), ref.parameters(), slow, strict=True):
            assert torch.allclose(p, q, rtol=1e-12, atol=1e-14), step
            assert torch.allclose(opt.state[p]["lookahead.slow"], s, rtol=1e-12, atol=1e-14)
    assert max_diff(model, TinyNet().double()) > 1e-3  # it really trained


def _save_load(opt_state):
    buf = io.BytesIO()
    torch.save(opt_state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("slow_dtype", [None, "bfloat16"])
def test_resume_mid_lookahead_cycle_is_bit_identical(slow_dtype):
    """Regression for Ranger21 issue #18 (lookahead counter not checkpointed)."""

    def make(model):
        return chain_optimizer(model.parameters(), **all_modules(slow_dtype), weight_decay=0.1)

    model = TinyNet()
    twin, resumed = copy.deepcopy(model), TinyNet()
    train(model, make(model), range(15))
    first = make(twin)
    train(twin, first, range(7))  # k=5: two steps into the second cycle
    saved = _save_load({"model": twin.state_dict(), "opt": first.state_dict()})
    resumed.load_state_dict(saved["model"])
    opt = make(resumed)
    opt.load_state_dict(saved["opt"])
    train(resumed, opt, range(7, 15))
    assert max_diff(model, resumed) == 0.0


def test_bf16_slow_weights_cost_two_bytes_and_track_fp32_lookahead():
    torch.manual_seed(0)
    base = TinyNet()
    numel = sum(p.numel() for p in base.parameters())
    runs = []
    for slow_dtype, size in ((None, 4), ("bfloat16", 2)):
        model = copy.deepcopy(base)
        opt = chain_optimizer(model.parameters(), param_transforms=[Lookahead(slow_dtype)])
        opt.init_state()
        assert opt.state_bytes()["lookahead"] == numel * size
        runs.append((model, train(model, opt, range(20))))
    (a, loss_a), (b, loss_b) = runs
    assert max_diff(a, b) < 1e-2  # bf16 spacing is 2⁻⁷ ≈ 0.008 for LayerNorm gains near 1
    assert abs(loss_a[-1] - loss_b[-1]) < 5e-3 * loss_a[-1]
    slow = next(iter(opt.state.values()))["lookahead.slow"]
    assert slow.dtype == torch.bfloat16


def test_stochastic_rounding_is_unbiased():
    gen = torch.Generator().manual_seed(0)
    ulp = 2.0**-7  # bf16 spacing in [1, 2)
    for x in (1.0 + 0.3 * ulp, -(1.0 + 0.7 * ulp)):
        out = stochastic_round_bf16(torch.full((200_000,), x), gen).double()
        assert set(out.abs().unique().tolist()) == {1.0, 1.0 + ulp}  # the two neighbours
        assert abs(out.mean().item() - x) < 0.01 * ulp  # E[round(x)] = x (nearest: 0.3 ulp off)
    exact = torch.tensor([1.0, -2.5, 0.0, 3.0e38])  # representable values are unchanged
    assert torch.equal(stochastic_round_bf16(exact.clone(), gen).float(), exact.bfloat16().float())


@pytest.mark.parametrize(
    ("module", "key", "value"),
    [
        (AdaptiveGradientClipping(), "agc_clip", -0.1),
        (AdaptiveGradientClipping(), "agc_eps", 0.0),
        (NormalizeGradient(), "gn_eps", -1e-8),
        (NormLoss(), "norm_loss_factor", -1e-4),
        (NormLoss(), "norm_loss_eps", float("nan")),
        (Lookahead(), "lookahead_k", 0),
        (Lookahead(), "lookahead_k", 2.5),
        (Lookahead(), "lookahead_alpha", 0.0),
        (Lookahead(), "lookahead_alpha", 1.5),
    ],
)
def test_validate_names_the_bad_key(module, key, value):
    (option,) = [o for o in module.options if o.name == key]  # the module declares it
    with pytest.raises(ValueError, match=key):
        option.validate(value)
    where = "param_transforms" if isinstance(module, (NormLoss, Lookahead)) else "grad_transforms"
    with pytest.raises(ValueError, match=key):  # at construction, per group
        chain_optimizer(TinyNet().parameters(), **{where: [module], key: value})
    model = TinyNet()
    opt = chain_optimizer([model.up.weight], **{where: [module]})
    with pytest.raises(ValueError, match=key):  # and in add_param_group
        opt.add_param_group({"params": [model.up.bias], key: value})
    assert len(opt.param_groups) == 1


def test_lookahead_rejects_unknown_slow_dtype():
    with pytest.raises(ValueError, match="slow_dtype"):
        Lookahead("int8")


@pytest.mark.parametrize(  # 4 ranks: a 5-element bias leaves one rank an empty shard
    "world", [2, pytest.param(4, marks=pytest.mark.slow)]
)
def test_fsdp_matches_single_process(world):
    spawn(ranger_fsdp_cases.fsdp_matches_single_process, world)


def test_galore_ranger21_under_fsdp2_matches_single_process():
    """The whole preset (PNM in the subspace, σ all-reduced, lookahead shards) on 2 ranks."""
    spawn(ranger_fsdp_cases.fsdp_matches_single_process, 2, "galore_ranger21")
