"""``galore2.CapturedStep``: capturable non-refresh steps replayed from a CUDA graph.

On the CPU: which optimizers it refuses, and why (the constructor's ``ValueError``). On a
CUDA device (marked ``gpu``): replayed steps are bitwise the eager ones, across refreshes
(run eagerly), with a NaN gradient masked inside a replay, and the host counters a replay
does not run (``galore.step``) advanced as the eager step advances them.
"""

from __future__ import annotations

import copy

import pytest
import torch

import galore2

from ..helpers import TinyNet


def test_refuses_an_optimizer_that_is_not_capturable():
    with pytest.raises(ValueError, match=r"param_groups\[0\] has capturable=False"):
        galore2.CapturedStep(galore2.GaLoreAdamW(TinyNet().parameters()))


def _groups(model):
    return galore2.param_groups(model, rank=4)


@pytest.mark.parametrize(
    "make,why",
    [
        (lambda m: galore2.GaLoreAdamW8bit(_groups(m), capturable=True), "8-bit moments"),
        (lambda m: galore2.GaLoreAdamW(_groups(m), capturable=True, compile=True),
         "compile=True"),
        (lambda m: galore2.APOLLO(_groups(m), capturable=True), "random projector"),
        (lambda m: galore2.GaLoreAdafactor(_groups(m), capturable=True, moments_8bit=True),
         "8-bit moments"),
        (lambda m: galore2.Ranger21(m.parameters(), capturable=True, num_iterations=10),
         "LR schedule"),
    ],
)  # fmt: skip
def test_refuses_modules_that_would_replay_host_values(make, why):
    try:
        opt = make(TinyNet())
    except ImportError:  # bitsandbytes absent
        pytest.skip("optional backend not installed")
    with pytest.raises(ValueError, match=why):
        galore2.CapturedStep(opt)


def test_accepts_galore_adamw_and_fira():
    for preset in (galore2.GaLoreAdamW, galore2.Fira):
        opt = preset(galore2.param_groups(TinyNet(), rank=4), capturable=True)
        assert galore2.CapturedStep(opt).replays == 0
    with pytest.raises(ValueError, match="warmup"):
        galore2.CapturedStep(opt, warmup=0)


def test_needs_cuda_tensors():
    opt = galore2.GaLoreAdamW(TinyNet().parameters(), capturable=True)
    with pytest.raises(RuntimeError, match="CUDA"):
        galore2.CapturedStep(opt)()


def _scheduled(model, tensor: bool, every: int = 3):
    """A capturable GaLoreAdamW whose lr 1e-2 (a float, or a CPU tensor) a StepLR halves
    every ``every`` steps."""
    lr = torch.tensor(1e-2) if tensor else 1e-2
    opt = galore2.GaLoreAdamW(
        galore2.param_groups(model, rank=4, update_proj_gap=50), capturable=True, lr=lr,
        foreach=True, weight_decay=0.1,
    )  # fmt: skip
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=every, gamma=0.5)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")  # no step here
@pytest.mark.parametrize("tensor", [False, True], ids=["float", "tensor"])
def test_a_scheduled_lr_is_a_changed_setting(tensor):
    """Issue 39 item 23, on the CPU: what a replay compares with the captured step's
    settings changes exactly when the LR scheduler changes the lr — also for a tensor
    ``lr``, which torch's schedulers rewrite in place (the same object: compared as it is,
    it never changed, and the graph would replay the lr it was captured with)."""
    opt, sched = _scheduled(TinyNet(), tensor)
    captured = galore2.CapturedStep(opt)
    changes = 0
    for step in range(7):
        before = captured._group_settings()
        sched.step()
        changed = captured._group_settings() != before
        assert changed is ((step + 1) % 3 == 0), step
        changes += changed
        assert captured._group_settings() == captured._group_settings()
    lr = opt.param_groups[0]["lr"]
    assert changes == 2 and isinstance(lr, torch.Tensor) is tensor
    assert float(lr) == float(torch.tensor(1e-2) / 4 if tensor else 1e-2 / 4)  # exact halvings


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tensor", [False, True], ids=["float", "tensor"])
def test_replays_follow_an_lr_scheduler(tensor):
    """Issue 39 item 23: under a StepLR (the lr halved every 3 steps) the replayed steps
    are bitwise the eager ones — a graph replaying its captured lr differs from the first
    step after a change — capturing again at each change and replaying in between."""
    torch.manual_seed(0)
    model = TinyNet().cuda()
    twin = copy.deepcopy(model)
    eager, eager_sched = _scheduled(model, tensor)
    graphed, graphed_sched = _scheduled(twin, tensor)
    step = galore2.CapturedStep(graphed, warmup=2)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        p.grad, q.grad = torch.zeros_like(p), torch.zeros_like(q)
    for i in range(14):
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            g = torch.randn(p.shape, generator=gen, device="cuda") * 1e-2
            p.grad.copy_(g)
            q.grad.copy_(g)
        eager.step()
        step()
        eager_sched.step()
        graphed_sched.step()
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(p, q), i
    # eager: the refresh at 0 and the warmup; a capture at each lr change after it
    assert step.captures >= 3 and step.replays >= 6, (step.captures, step.replays)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("preset", ["GaLoreAdamW", "Fira", "GaLoreMuon", "GaLoreAdafactor"])
def test_replayed_steps_are_bitwise_the_eager_ones(preset):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.Linear(128, 64), torch.nn.LayerNorm(64)
    ).cuda()
    twin = copy.deepcopy(model)
    make = getattr(galore2, preset)
    settings = {"capturable": True, "foreach": True, "lr": 1e-2, "weight_decay": 0.1}
    eager = make(galore2.param_groups(model, rank=8, update_proj_gap=5), **settings)
    graphed = make(galore2.param_groups(twin, rank=8, update_proj_gap=5), **settings)
    step = galore2.CapturedStep(graphed, warmup=2)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        p.grad, q.grad = torch.zeros_like(p), torch.zeros_like(q)
    for i in range(17):
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            g = torch.randn(p.shape, generator=gen, device="cuda") * 1e-2
            if i == 9 and p.dim() == 2:
                g[0, 0] = float("nan")  # masked inside a replay
            p.grad.copy_(g)
            q.grad.copy_(g)
        eager.step()
        step()
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(p, q), i
    assert step.captures == 1 and step.replays >= 8, (step.captures, step.replays)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        for key, value in eager.state[p].items():
            assert torch.equal(value.cpu(), graphed.state[q][key].cpu()), key
    assert eager.nonfinite_skips == graphed.nonfinite_skips > 0
