"""``load_state_dict`` checks a checkpoint against this optimizer before changing anything.

Issue 16 items 3 and 13: torch's ``load_state_dict`` replaced every group value by the
checkpoint's (a run resumed with ``rank=2`` silently ran at rank 4, a changed weight decay
was silently ignored), and copied any state it found (another optimizer's state failed at
the first step with a bare ``KeyError``; fp32 moments stayed fp32 in GaLoreAdamW8bit).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import galore2

from ..helpers import TinyNet, galore_groups, train


def _trained(cls=galore2.GaLoreAdamW, model=None, **settings):
    model = model if model is not None else TinyNet()
    opt = cls(galore_groups(model, **settings), lr=1e-2, weight_decay=0.1)
    train(model, opt, range(3))
    return model, opt


def _settings(opt):
    return [({k: v for k, v in g.items() if k != "params"}, list(map(id, g["params"])))
            for g in opt.param_groups]  # fmt: skip


def _load_refused(opt, state_dict, match):
    before = _settings(opt)
    with pytest.raises(ValueError, match=match) as err:
        opt.load_state_dict(state_dict)
    assert not opt.state and _settings(opt) == before  # nothing changed
    return str(err.value)


# ---- options ------------------------------------------------------------------------------


@pytest.mark.parametrize(("saved", "now"), [(4, 2), (4, None), (None, 4)])
def test_a_changed_rank_is_refused(saved, now):
    model, opt = _trained(rank=saved, update_proj_gap=2)
    resumed = galore2.GaLoreAdamW(galore_groups(model, rank=now), lr=1e-2)
    _load_refused(
        resumed, opt.state_dict(), f"group 0: rank: checkpoint {saved}, this optimizer {now}"
    )


def test_every_changed_state_shaping_option_is_named():
    model, opt = _trained(rank=4, proj_type="std", state_dtype="float32")
    resumed = galore2.GaLoreAdamW(
        galore_groups(model, rank=4, proj_type="left", state_dtype="bfloat16"), lr=1e-2
    )
    message = _load_refused(resumed, opt.state_dict(), "proj_type")
    assert "group 0: proj_type: checkpoint 'std', this optimizer 'left'" in message
    assert "group 0: state_dtype: checkpoint 'float32', this optimizer 'bfloat16'" in message


def test_other_options_take_this_optimizers_values_with_one_warning():
    model, opt = _trained(rank=4, update_proj_gap=2)
    opt.param_groups[0]["lr"] = 0.005  # as an LR scheduler leaves it
    saved = opt.state_dict()
    new = {"weight_decay": 0.3, "scale": 0.5, "update_proj_gap": 7, "nonfinite": "raise"}
    groups = galore_groups(model, rank=4, **{k: v for k, v in new.items() if k != "weight_decay"})
    resumed = galore2.GaLoreAdamW(groups, lr=1e-3, betas=(0.8, 0.99), weight_decay=0.3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.load_state_dict(saved)
    messages = [str(w.message) for w in caught if "load_state_dict" in str(w.message)]
    assert len(messages) == 1
    for change in (
        "group 0: weight_decay 0.1 → 0.3",
        "group 0: scale 0.25 → 0.5",
        "group 0: update_proj_gap 2 → 7",
        "group 0: nonfinite 'skip' → 'raise'",
        "group 0: betas (0.9, 0.999) → (0.8, 0.99)",
        "group 1: weight_decay 0.1 → 0.3",
    ):
        assert change in messages[0]
    assert "lr" not in messages[0].replace("load_state_dict", "")
    group = resumed.param_groups[0]
    assert {k: group[k] for k in new} == new and group["betas"] == (0.8, 0.99)
    assert group["lr"] == 0.005  # the checkpoint's (LR schedulers own it, as in torch)
    assert resumed.param_groups[1]["lr"] == 1e-2
    # the state itself is the checkpoint's
    for p in resumed.param_groups[0]["params"]:
        assert torch.equal(resumed.state[p]["adam.exp_avg"], opt.state[p]["adam.exp_avg"])


def test_the_same_settings_load_silently_and_resume_bitwise():
    model, opt = _trained(rank=4, update_proj_gap=2)
    model2 = copy.deepcopy(model)
    resumed = galore2.GaLoreAdamW(
        galore_groups(model2, rank=4, update_proj_gap=2), lr=1e-2, weight_decay=0.1
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_state_dict(opt.state_dict())
    train(model, opt, range(3, 6))
    train(model2, resumed, range(3, 6))
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_checkpoint_without_newer_options_and_counters_still_loads():
    model, opt = _trained(rank=4)
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        del group["moments_on_refresh"], group["tensor_projection"]
    for state in saved["state"].values():
        del state["nonfinite.skips"]
    resumed = galore2.GaLoreAdamW(
        galore_groups(model, rank=4, moments_on_refresh="reset"), lr=1e-2, weight_decay=0.1
    )
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["moments_on_refresh"] == "reset"
    assert resumed.param_groups[0]["tensor_projection"] == "tucker"
    train(model, resumed, range(3, 4))
    assert resumed.nonfinite_skips == 0


# ---- state --------------------------------------------------------------------------------


def test_another_optimizers_state_is_refused_at_load():
    """GaLoreAdamW state into GaLoreAdafactor failed at the first step: KeyError
    'adafactor.variance'."""
    model, opt = _trained(rank=4)
    adafactor = galore2.GaLoreAdafactor(galore_groups(model, rank=4))
    message = _load_refused(adafactor, opt.state_dict(), r"adam\.\* keys")
    assert "GaLoreAdafactor keeps adafactor.*" in message
    assert "parameter 0 of shape (40, 24)" in message

    model, opt = _trained(galore2.GaLoreAdafactor)
    adamw = galore2.GaLoreAdamW(galore_groups(model))
    _load_refused(adamw, opt.state_dict(), r"adafactor\.\* keys.*GaLoreAdamW keeps adam\.\*")


def test_torch_adamw_state_is_refused_at_load():
    model = TinyNet()
    ref = torch.optim.AdamW(model.parameters())
    train(model, ref, range(2))
    ours = galore2.GaLoreAdamW(model.parameters())
    _load_refused(ours, ref.state_dict(), "exp_avg, exp_avg_sq, step keys")


def test_a_missing_schedule_counter_is_refused_at_load():
    """Ranger21 state without its schedule (use_warmup/warmdown off) into one with it."""
    model = TinyNet()
    off = galore2.Ranger21(model.parameters(), use_warmup=False, use_warmdown=False)
    train(model, off, range(2))
    on = galore2.Ranger21(model.parameters(), num_iterations=10)
    _load_refused(on, off.state_dict(), "missing schedule.step")


def test_a_changed_parameter_shape_is_refused_naming_it():
    small, big = nn.Linear(24, 40), nn.Linear(24, 41)
    opt = galore2.GaLoreAdamW(small.named_parameters(), rank=4)
    small(torch.randn(3, 24)).sum().backward()
    opt.step()
    other = galore2.GaLoreAdamW(big.named_parameters(), rank=4)
    message = _load_refused(other, opt.state_dict(), "parameter 0 'weight' of shape")
    assert "proj.right has shape (24, 4) in the checkpoint" not in message  # 24 cols: same
    assert "adam.exp_avg has shape (40, 4) in the checkpoint, (41, 4) here" in message
    assert "parameter 1 'bias' of shape (41,)" in message


def test_fp32_moments_are_refused_by_the_8bit_optimizer_and_back():
    model = nn.Linear(64, 128)  # 8192 elements: 8-bit moments
    fp32, eight = (
        galore2.GaLoreAdamW(model.parameters()),
        galore2.GaLoreAdamW8bit(model.parameters()),
    )
    for opt in (fp32, eight):
        model(torch.randn(3, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
    for source, target in ((fp32, galore2.GaLoreAdamW8bit), (eight, galore2.GaLoreAdamW)):
        message = _load_refused(
            target(model.parameters()), source.state_dict(), "parameter 0 of shape"
        )
        assert "8-bit moments resume only into" in message


def test_switching_on_adafactor_momentum_is_refused_at_load_not_at_the_step():
    model, opt = _trained(galore2.GaLoreAdafactor)
    with_momentum = galore2.GaLoreAdafactor(galore_groups(model), beta1=0.9)
    _load_refused(with_momentum, opt.state_dict(), "missing adafactor.exp_avg")


def test_loading_into_an_optimizer_that_already_has_state_replaces_it():
    """DCP's set_optimizer_state_dict runs a zero-gradient step first: state exists."""
    model, opt = _trained(rank=4)
    resumed = galore2.GaLoreAdamW(galore_groups(model, rank=4), lr=1e-2, weight_decay=0.1)
    resumed.init_state()
    resumed.load_state_dict(opt.state_dict())
    for p in model.parameters():
        for key, value in opt.state[p].items():
            assert torch.equal(resumed.state[p][key], value)


@pytest.mark.parametrize("alias", ["bf16", torch.bfloat16])
def test_alias_option_values_of_an_older_release_load_silently(alias):
    """An older release stored ``state_dtype`` as given (``"bf16"``, a torch dtype); today's
    optimizer holds ``"bfloat16"``: the same setting, so no refusal and no warning."""
    model, opt = _trained(rank=4, update_proj_gap=2, state_dtype="bfloat16")
    saved = opt.state_dict()
    assert saved["param_groups"][0]["state_dtype"] == "bfloat16"
    saved["param_groups"][0]["state_dtype"] = alias
    groups = galore_groups(model, rank=4, update_proj_gap=2, state_dtype="bfloat16")
    resumed = galore2.GaLoreAdamW(groups, lr=1e-2, weight_decay=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_state_dict(saved)
    assert resumed.state and resumed.param_groups[0]["state_dtype"] == "bfloat16"
