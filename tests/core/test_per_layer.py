"""Per-layer updates (inside backward) equal the ordinary step; one gradient alive at a time."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import galore2

from ..dist import spawn
from ..helpers import TinyNet, batch, galore_groups

ACCUM, STEPS = 3, 6


# GaLoreAdamW and the presets whose update is not a low-rank product: Fira and APOLLO return
# a dense update scaled by ratios of norms and the norm-growth limiter's state, GaLoreMuon
# orthogonalizes its low-rank momentum. TinyNet: 40×24 (right), 40×40, 12×40 (left).
PRESETS = {
    "galore": (galore2.GaLoreAdamW, {}),
    "fira": (galore2.Fira, {}),
    "apollo": (galore2.APOLLO, {}),
    "apollo-mini": (galore2.APOLLOMini, {}),
    "muon": (galore2.GaLoreMuon, {}),
    "muon-polar": (galore2.GaLoreMuon, {"orthogonalize": "polar"}),
}


def _opt(model, preset="galore"):
    cls, settings = PRESETS[preset]
    return cls(
        galore_groups(model, rank=4, update_proj_gap=4, **settings), lr=1e-2, weight_decay=0.1
    )


def _sched(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _loss(model, step, micro):
    x, y = batch(step * ACCUM + micro)
    return (model(x) - y).pow(2).mean() / ACCUM


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("accumulation", [1, ACCUM])
def test_per_layer_equals_ordinary_step(accumulation, preset):
    torch.manual_seed(0)
    ref = TinyNet()
    model = copy.deepcopy(ref)
    ref_opt, opt = _opt(ref, preset), _opt(model, preset)
    ref_sched, sched = _sched(ref_opt), _sched(opt)
    updates = galore2.per_layer(model, opt, accumulation_steps=accumulation, scheduler=sched)
    for step in range(STEPS):
        for micro in range(accumulation):
            _loss(ref, step, micro).backward()
            done = updates.backward(_loss(model, step, micro))
            assert done == (micro == accumulation - 1)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        assert all(p.grad is None for p in model.parameters())  # freed inside backward
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    assert (
        opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] != 1e-2
    )  # schedule stepped per step


def test_one_gradient_alive_at_a_time():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    opt = galore2.GaLoreAdamW(galore2.param_groups(model, rank=4), lr=1e-3)
    peak = []

    def live(_p):
        peak.append(
            sum(
                q.grad.numel() * q.grad.element_size()
                for q in model.parameters()
                if q.grad is not None
            )
        )

    for p in model.parameters():  # registered before per_layer's hooks: sees the grad just made
        p.register_post_accumulate_grad_hook(live)
    updates = galore2.per_layer(model, opt)
    updates.backward(model(torch.randn(8, 32)).pow(2).mean())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert len(peak) == len(list(model.parameters()))
    assert max(peak) <= largest < total / 5
    # Ordinary training keeps them all.
    updates.remove()
    peak.clear()
    model(torch.randn(8, 32)).pow(2).mean().backward()
    assert max(peak) == total


def test_refusals():
    model = TinyNet()
    opt = _opt(model)
    with pytest.raises(ValueError, match="max_grad_norm"):
        galore2.per_layer(model, opt, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="accumulation_steps"):
        galore2.per_layer(model, opt, accumulation_steps=0)
    with pytest.raises(TypeError, match="galore2 optimizer"):
        galore2.per_layer(model, torch.optim.AdamW(model.parameters()))


def _fsdp_per_layer(rank: int, world: int, config: str | None = None) -> None:
    """``config``: a name of lowrank_fsdp_cases.CONFIGS (default: GaLoreAdamW, randomized)."""
    from ..dist import BATCH, cpu_mesh, data, make_model, optimizer, shard
    from ..dist import STEPS as N
    from ..fsdp import lowrank_fsdp_cases

    mesh = cpu_mesh(world)
    models = []
    for per_layer_mode in (False, True):
        model = make_model()
        shard(model, mesh)
        if config is None:
            opt = optimizer(model, {"projector": "randomized"})
        else:
            opt = lowrank_fsdp_cases.build(model, config)
        updates = galore2.per_layer(model, opt, accumulation_steps=2) if per_layer_mode else None
        per = BATCH // world // 2
        for step in range(N):
            x, y = data(step)
            x, y = (
                x[rank * 2 * per : (rank + 1) * 2 * per],
                y[rank * 2 * per : (rank + 1) * 2 * per],
            )
            for micro in range(2):
                loss = (
                    nn.functional.mse_loss(
                        model(x[micro * per : (micro + 1) * per]),
                        y[micro * per : (micro + 1) * per],
                    )
                    / 2
                )
                if updates is None:
                    loss.backward()
                else:
                    updates.backward(loss)
            if updates is None:
                opt.step()
                opt.zero_grad()
        models.append(model)
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert (p.full_tensor() - q.full_tensor()).abs().max().item() <= 1e-6


def test_per_layer_under_fsdp2_equals_ordinary_step():
    spawn(_fsdp_per_layer, 2)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["fira-svd", "apollo-mini", "muon-polar"])
def test_per_layer_under_fsdp2_lowrank_presets(config):
    """Fira (exact refreshes: gathered per parameter here, batched in step()), APOLLO-Mini
    and GaLoreMuon: their collectives run inside backward, one parameter at a time."""
    spawn(_fsdp_per_layer, 3, config)


def _ddp_refused(rank: int, world: int) -> None:
    model = nn.parallel.DistributedDataParallel(TinyNet())
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        galore2.per_layer(model, _opt(model.module))


def test_per_layer_refuses_ddp_with_a_clear_error():
    spawn(_ddp_refused, 1)


def test_an_exception_inside_backward_abandons_the_step_and_training_goes_on():
    """Issue 16 item 2: after a caught FloatingPointError (nonfinite="raise") every later
    backward() returned False and the weights never moved again. Per-layer ``raise``
    guarantees (module docstring): the parameter with the bad gradient and every one after
    it in backward order are unchanged; those stepped before it keep their update."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)])
    opt = galore2.GaLoreAdamW(model.parameters(), lr=1e-2, nonfinite="raise")
    names = {id(p): n for n, p in model.named_parameters()}
    bad = model[2].weight
    poison = {"on": False}
    bad.register_hook(lambda g: g * float("nan") if poison["on"] else g)
    order: list[str] = []  # registered before per_layer's hooks: the order params are stepped
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: order.append(names[id(p)]))
    updates = galore2.per_layer(model, opt, accumulation_steps=2)

    def loss():
        return model(torch.randn(5, 6)).pow(2).mean()

    assert updates.backward(loss()) is False
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    poison["on"] = True
    with pytest.raises(FloatingPointError, match=r"\(6, 6\)"):
        updates.backward(loss())
    poison["on"] = False
    stepped = order[: order.index("2.weight")]
    assert stepped  # parameters after the bad one in the model come first in backward
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != (n in stepped), n
        assert (n in stepped) == bool(opt.state[p]), n  # no state for the untouched ones
    assert all(p.grad is None for p in model.parameters())  # the step was abandoned
    assert updates.micro_step == 0

    # The next optimizer step works: two micro-batches, every parameter updated.
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert updates.backward(loss()) is False
    assert updates.backward(loss()) is True
    for n, p in model.named_parameters():
        assert not torch.equal(p, before[n]), n
        assert p.grad is None
