"""Workers for test_fsdp_errors.py: unsupported DTensor layouts and collective NaN skips."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import galore2

from ..dist import (
    STEPS,
    assert_params_match,
    cpu_mesh,
    data,
    make_model,
    optimizer,
    shard,
    split,
)

SHAPE = (8, 6)


def _unsupported(world: int) -> list[tuple[tuple[int, ...], list]]:
    """(mesh shape, placements) of DTensor parameters galore2 must refuse."""
    return [
        ((world,), [Shard(1)]),  # tensor parallel (column-wise)
        ((world,), [Replicate()]),  # replicated DTensor on a 1-D mesh
        ((1, world), [Replicate(), Shard(1)]),  # "HSDP" sharded on the wrong dim
        ((1, world), [Shard(0), Replicate()]),  # rows sharded over the replicate dim
        ((1, world), [Shard(0), Shard(1)]),  # FSDP + TP on a 2-D mesh
    ]


def _dtensor(mesh_shape: tuple[int, ...], placements: list, seed: int) -> DTensor:
    mesh = cpu_mesh(*mesh_shape)
    g = torch.Generator().manual_seed(seed)
    return distribute_tensor(torch.randn(SHAPE, generator=g), mesh, placements)


def _check_message(err: pytest.ExceptionInfo, placements: list) -> None:
    message = str(err.value)
    assert str(SHAPE) in message, message  # the parameter's shape…
    for placement in placements:  # …and its placement, e.g. "Shard(dim=1)" (the repr)
        assert repr(placement) in message, (placement, message)


def unsupported_placements_raise(rank: int, world: int) -> None:
    """step() and init_state() raise ValueError naming shape and placement; p is untouched."""
    for mesh_shape, placements in _unsupported(world):
        for entry in ("step", "init_state"):
            p = nn.Parameter(_dtensor(mesh_shape, placements, seed=1))
            p.grad = _dtensor(mesh_shape, placements, seed=2)
            before = p.to_local().clone()
            opt = galore2.GaLoreAdamW([{"params": [p], "rank": 2}], lr=0.1, update_proj_gap=2)
            with pytest.raises(ValueError, match="shape") as err:
                opt.step() if entry == "step" else opt.init_state()
            _check_message(err, placements)
            assert torch.equal(p.to_local(), before), (mesh_shape, placements, entry)
            # it keeps raising: the failure is not remembered as "already initialized"
            with pytest.raises(ValueError, match="shape"):
                opt.step()
            assert torch.equal(p.to_local(), before), (mesh_shape, placements, entry)


def failed_init_leaves_no_state(rank: int, world: int) -> None:
    """A refused parameter gets no optimizer state (no half-initialized entry)."""
    for mesh_shape, placements in _unsupported(world):
        p = nn.Parameter(_dtensor(mesh_shape, placements, seed=1))
        p.grad = _dtensor(mesh_shape, placements, seed=2)
        opt = galore2.GaLoreAdamW([{"params": [p], "rank": 2}], lr=0.1)
        with pytest.raises(ValueError, match="shape"):
            opt.step()
        assert not opt.state.get(p), (placements, dict(opt.state.get(p, {})))
        # init_state() after the failed step must still refuse the parameter
        with pytest.raises(ValueError, match="shape"):
            opt.init_state()


def unsupported_in_later_group_changes_nothing(rank: int, world: int) -> None:
    """A good parameter in group 0 and a refused one in group 1: nothing is updated.

    The good one is an FSDP2 DTensor, or a plain tensor (a module left out of
    ``fully_shard``): either way the refused layout must be found before any update.
    """
    for kind in ("fsdp", "plain"):
        if kind == "fsdp":
            good = nn.Parameter(_dtensor((world,), [Shard(0)], seed=3))
            good.grad = _dtensor((world,), [Shard(0)], seed=4)
        else:
            good = nn.Parameter(_dtensor((world,), [Shard(0)], seed=3).full_tensor())
            good.grad = _dtensor((world,), [Shard(0)], seed=4).full_tensor()
        bad = nn.Parameter(_dtensor((world,), [Shard(1)], seed=1))
        bad.grad = _dtensor((world,), [Shard(1)], seed=2)
        local = good.to_local if kind == "fsdp" else good.detach
        before = local().clone()
        opt = galore2.GaLoreAdamW(
            [{"params": [good], "rank": 2}, {"params": [bad], "rank": None}], lr=0.1
        )
        with pytest.raises(ValueError, match="shape") as err:
            opt.step()
        _check_message(err, [Shard(1)])
        assert torch.equal(local(), before), f"group 0 ({kind}) was updated before the error"
        assert not opt.state.get(good), f"group 0 ({kind}) got state before the error"


# ---- NaN on one rank only --------------------------------------------------------------
# step → (parameter index in model.parameters(), what it is)
NAN_AT = {
    3: (0, "0.weight: 7×10, left projection"),
    5: (5, "4.bias: plain AdamW"),
    8: (2, "2.weight: 13×7, right projection, at a refresh step"),
}
NAN_RANK, NAN_WORLD = 1, 2  # the NaN lands in rank 1's shard of a 2-rank run


def _first_row(m: int, world: int, rank: int) -> int:
    return min(rank * -(-m // world), m)  # torch.chunk's split, as FSDP2's Shard(0)


def _train_with_nans(model: nn.Module, opt, rank: int, world: int, check=None) -> None:
    params = list(model.parameters())
    for step in range(STEPS):
        x, y = (split(t, rank, world) for t in data(step))
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        target = NAN_AT.get(step)
        if target is not None:
            p = params[target[0]]
            with torch.no_grad():
                if isinstance(p.grad, DTensor):  # only rank NAN_RANK's shard gets the NaN
                    if rank == NAN_RANK:
                        p.grad.to_local().view(p.grad.to_local().shape[0], -1)[0, 0] = float("nan")
                else:  # the single-process reference: the same element of the full gradient
                    row = _first_row(p.shape[0], NAN_WORLD, NAN_RANK)
                    p.grad.view(p.shape[0], -1)[row, 0] = float("nan")
        before = [(q.to_local() if isinstance(q, DTensor) else q).clone() for q in params]
        opt.step()
        if check is not None:
            check(step, before)


def nan_on_one_rank_is_skipped_everywhere(rank: int, world: int) -> None:
    assert world == NAN_WORLD
    settings = {"projector": "randomized"}
    reference = make_model()
    sharded = make_model()
    reference_opt = optimizer(reference, settings)
    _train_with_nans(reference, reference_opt, 0, 1)
    assert reference_opt.nonfinite_skips == len(NAN_AT)  # the reference skips them too

    shard(sharded, world)
    opt = optimizer(sharded, settings)
    params = list(sharded.parameters())
    skips = 0

    def check(step: int, before: list[torch.Tensor]) -> None:
        nonlocal skips
        target = NAN_AT.get(step)
        if target is not None:
            skips += 1
            grad = params[target[0]].grad.to_local()
            if rank == NAN_RANK:
                assert torch.isnan(grad).any(), "the NaN did not reach the gradient shard"
            else:  # this rank's gradient was finite: it skipped by agreement
                assert torch.isfinite(grad).all()
        for i, (p, old) in enumerate(zip(params, before, strict=True)):
            local = p.to_local()
            assert torch.isfinite(local).all(), (step, i)
            if target is not None and i == target[0]:
                assert torch.equal(local, old), f"rank {rank} step {step}: {target[1]} updated"
            else:
                assert not torch.equal(local, old), f"rank {rank} step {step}: param {i} frozen"
        assert opt.nonfinite_skips == skips, (rank, step, opt.nonfinite_skips, skips)
        per_param = [int(opt.state[p]["nonfinite.skips"]) for p in params]
        expected = [
            sum(1 for s, (j, _) in NAN_AT.items() if j == i and s <= step)
            for i in range(len(params))
        ]
        assert per_param == expected, (rank, step, per_param, expected)

    _train_with_nans(sharded, opt, rank, world, check)
    assert opt.nonfinite_skips == len(NAN_AT)
    counts = torch.tensor([opt.nonfinite_skips])
    parts = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(parts, counts)
    assert [int(c) for c in parts] == [len(NAN_AT)] * world
    # Skipping together keeps the run equal to the single-process run with the same NaNs.
    assert_params_match(sharded, reference, 1e-5, f"rank {rank}")
