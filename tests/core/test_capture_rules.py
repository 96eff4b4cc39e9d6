"""Capturable Muon, Adafactor and PNM (``capturable=True``).

Adafactor's and PNM's step counters live on the parameters' device and every value that
depends on them (ρ_t, β̂₂, PNM's bias corrections and which buffer is active) is computed
there; Muon keeps no counter. Pinned here on the CPU: the results equal the default
path's within 1e-6 over steps with refreshes, per tensor and batched (``foreach``), also
after ``capturable`` is switched off; ``capture_problems`` accepts the presets built from
them and names what it still refuses. (No host read in a capturable step:
``test_capture_ready.py``.)
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import galore2
from galore2.core.capture import capture_problems

from ..helpers import TinyNet, assert_f32_close

#: the most steps a test here takes (the float32 bound's step count, tests.helpers.f32_bound)
STEPS = 7

NO_SCHEDULE = {"use_warmup": False, "use_warmdown": False, "use_lookahead": False}

CONFIGS = {
    "muon": ("GaLoreMuon", {}),
    "adafactor": ("GaLoreAdafactor", {}),
    "adafactor_relative_step": ("GaLoreAdafactor", {"lr": 1.0}),  # ρ_t = 1/√t < lr from t = 2
    "adafactor_momentum": (
        "GaLoreAdafactor",
        {"relative_step": False, "scale_parameter": False, "beta1": 0.9, "lr": 1e-2},
    ),
    "ranger21": ("Ranger21", NO_SCHEDULE),
    "ranger21_amsgrad_adamd": (
        "Ranger21",
        {**NO_SCHEDULE, "amsgrad": True, "adamd": True, "softplus": False},
    ),
    "ranger21_beta0_0": ("Ranger21", {**NO_SCHEDULE, "pnm_beta0": 0.0}),
    "galore_ranger21": ("GaLoreRanger21", NO_SCHEDULE),
}


def _make(name: str, model: torch.nn.Module, **options) -> torch.optim.Optimizer:
    preset = getattr(galore2, name)
    if name.startswith("GaLore"):
        return preset(galore2.param_groups(model, rank=4, update_proj_gap=3), **options)
    return preset(model.parameters(), **options)


def _twins(name: str, options: dict, foreach: bool):
    torch.manual_seed(0)
    model = TinyNet()
    twin = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        capt = _make(name, model, capturable=True, foreach=foreach, **options)
        host = _make(name, twin, foreach=foreach, **options)
    return model, twin, capt, host


def _steps(models, opts, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=gen) for p in models[0].parameters()]
        for model in models:
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g.clone()
        for opt in opts:
            opt.step()


def _assert_same(model, twin, capt, host) -> None:
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert_f32_close(p, q, steps=STEPS)
        assert capt.state[p].keys() == host.state[q].keys()
        for key, value in host.state[q].items():
            mine = capt.state[p][key]
            assert mine.dtype == value.dtype, key
            if value.is_floating_point():
                assert_f32_close(mine.float(), value.float(), steps=STEPS, what=key)
            else:  # counters: the same counts, wherever they live
                assert torch.equal(mine.cpu(), value), key


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_capturable_equals_the_default_path(config, foreach):
    """Seven steps (refreshes at steps 1, 4 and 7 under GaLore): weights and every state
    tensor within 1e-6 of the default path's; the counters are on the device (here: the
    CPU) and count the same."""
    name, options = CONFIGS[config]
    model, twin, capt, host = _twins(name, options, foreach)
    _steps((model, twin), (capt, host), 7)
    assert any(p.abs().sum() > 0 for p in model.parameters())
    _assert_same(model, twin, capt, host)


@pytest.mark.parametrize("config", ["adafactor", "ranger21"])
def test_capturable_switched_off_continues_on_host_counters(config):
    """A group's ``capturable`` turned off: the device counters come back to the CPU (and
    are packed) and the run goes on as the default path's."""
    name, options = CONFIGS[config]
    model, twin, capt, host = _twins(name, options, foreach=True)
    _steps((model, twin), (capt, host), 2)
    for group in capt.param_groups:
        group["capturable"] = False
    _steps((model, twin), (capt, host), 3, seed=2)
    _assert_same(model, twin, capt, host)
    counters = [t for s in capt.state.values() for k, t in s.items()
                if k in ("pnm.step", "adafactor.step", "adafactor.moment_step")]  # fmt: skip
    assert counters and all(t.device.type == "cpu" for t in counters)


@pytest.mark.parametrize(
    "name,options",
    [
        ("GaLoreMuon", {}),
        ("GaLoreAdafactor", {}),
        ("Ranger21", NO_SCHEDULE),
        ("GaLoreRanger21", NO_SCHEDULE),
    ],
)
def test_capture_problems_accept_muon_adafactor_and_pnm_presets(name, options):
    opt = _make(name, TinyNet(), capturable=True, **options)
    assert capture_problems(opt) == []
    assert galore2.CapturedStep(opt).replays == 0


@pytest.mark.parametrize(
    "name,options,why",
    [
        ("GaLoreMuon", {"orthogonalize": "polar"}, "orthogonalize='polar'.*eigh"),
        ("GaLoreAdafactor", {"moments_8bit": True}, "Adafactor's 8-bit moments"),
        ("Ranger21", {**NO_SCHEDULE, "moments_8bit": True}, "PNM's 8-bit moments"),
        ("Ranger21", {**NO_SCHEDULE, "use_lookahead": True}, "Lookahead decides on the host"),
    ],
)
def test_capture_problems_name_what_is_still_refused(name, options, why):
    try:
        opt = _make(name, TinyNet(), capturable=True, **options)
    except ImportError:  # an 8-bit backend absent
        pytest.skip("optional backend not installed")
    problems = capture_problems(opt)
    assert len(problems) == 1, problems
    with pytest.raises(ValueError, match=why):
        galore2.CapturedStep(opt)
