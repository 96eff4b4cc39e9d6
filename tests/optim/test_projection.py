"""The projections' declared collectives equal what their code issues, in one process.

A recording placement (world 2, identity collectives: every rank's part is the whole,
so the sharded code paths run on one process) logs (op, logical numel, itemsize) of every
collective method called, with the conventions of :mod:`galore2.traffic`. For each kind
(left, right, full, Tucker with and without mode 0 reduced) and projector, a first
refresh, a later one, the moment rotation and one step's project + back must issue
exactly what ``refresh_collectives`` / ``rotation_collectives`` / ``step_collectives``
list, in order. The spawned FSDP2 runs of ``tests/fsdp/test_fsdp_traffic.py`` check the
same lists against real collectives; this test covers every kind in the default suite
in well under a second.
"""

from __future__ import annotations

import pytest
import torch

from galore2.core.transform import LowRankUpdate
from galore2.optim.projection import (
    FullProjection,
    LeftProjection,
    RightProjection,
    TuckerProjection,
    projection_for,
)
from galore2.placement import Collective, Placement
from galore2.projectors import FULL, LEFT, RIGHT, TUCKER, Plan

Key = tuple[str, int, int]
WORLD = 2


class Recording(Placement):
    """World 2, identity collectives, every call logged as a :meth:`Collective.key`."""

    world, rank = WORLD, 0

    def __init__(self) -> None:
        self.calls: list[Key] = []

    def _log(self, op: str, numel: int, t: torch.Tensor) -> None:
        self.calls.append((op, numel, t.element_size()))

    def reduce(self, t):
        self._log("all_reduce", t.numel(), t)
        return t

    def reduce_scatter_cols(self, t):
        self._log("reduce_scatter", t.numel(), t)
        return t

    def all_gather_cols(self, t, n):
        self._log("all_gather", t.shape[0] * n, t)
        return t

    def any(self, flags):
        if flags:
            self.calls.append(("all_reduce", len(flags), 4))
        return flags

    def gather_rows(self, t, owner):  # p·⌈m/p⌉ padded rows, as dist.gather sends them
        chunk = -(-t.shape[0] // WORLD)
        self._log("gather", WORLD * chunk * (t.numel() // t.shape[0]), t)
        return t

    def broadcast(self, t, owner, shape, device=None):
        assert t is not None
        self._log("broadcast", t.numel(), t)
        return t


CASES = [  # (side, global shape)
    (LEFT, (13, 20)),
    (RIGHT, (17, 13)),
    (FULL, (13, 20)),
    (TUCKER, (6, 5, 4)),  # every mode reduced: the core is a partial sum
    (TUCKER, (3, 8, 5)),  # d_0 = rank: mode 0 kept, the core is row-sharded
]
RANK = 3


def _keys(cs: list[Collective]) -> list[Key]:
    return [c.key() for c in cs]


def _setup(side: int, shape: tuple[int, ...], projector: str):
    group = {
        "projector": projector,
        "oversample": 2,
        "power_iters": 1,
        "moments_on_refresh": "project",
    }
    pl = Recording()
    m, n = shape[0], 1
    for d in shape[1:]:
        n *= d
    plan = Plan(side, m, n, RANK, torch.device("cpu"), pl)
    projection = projection_for(group, plan, shape)
    state: dict[str, torch.Tensor] = {
        "galore.refreshes": torch.tensor(0),
        "galore.seed": torch.tensor(7),
    }
    projection.projector.init_state(state, plan, group)
    return group, pl, plan, projection, state


@pytest.mark.parametrize("projector", ["svd", "randomized", "power", "random"])
@pytest.mark.parametrize(("side", "shape"), CASES)
def test_declared_collectives_are_the_issued_ones(side, shape, projector):
    group, pl, plan, projection, state = _setup(side, shape, projector)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=gen) for _ in range(2)]
    kind = {LEFT: LeftProjection, RIGHT: RightProjection, FULL: FullProjection}
    assert type(projection) is kind.get(side, TuckerProjection)
    projector_ = projection.projector
    for i, first in enumerate((True, False)):
        G = projection.matrix(grads[i])
        pl.calls = []
        new = projector_.refresh(G, state, plan, group, seed=i)
        assert new is not None
        declared = projection.refresh_collectives(group, WORLD, first)
        rotation = projection.rotation_collectives() if not first else []
        assert pl.calls == _keys(declared[: len(declared) - len(rotation)]), first
        old = tuple(None if b is None else b.clone() for b in projector_.bases(state, plan))
        projector_.store(state, new, plan)
        state["galore.refreshes"] += 1
        if not first:
            pl.calls = []
            rotate = projection.rotation(old, projector_.bases(state, plan))
            assert pl.calls == _keys(rotation)
            assert rotate(torch.ones(projection.low_shape), False).shape == projection.low_shape
    pl.calls = []
    G = projection.matrix(grads[0])
    R = projection.project(G, state)
    assert R.shape == projection.low_shape
    out = projection.back(torch.ones_like(R), state, torch.float32, grads[0].shape, 0.5)
    dense = out.dense() if isinstance(out, LowRankUpdate) else out
    assert dense.shape == grads[0].shape
    assert pl.calls == _keys(projection.step_collectives(torch.float32, torch.float32))


def test_step_collectives_by_kind():
    """What each kind issues per step, written out (r = 3; 13×20 left / full, 17×13 right)."""
    expect = {
        LEFT: [("reduce_scatter", 60, 4), ("all_gather", 60, 2)],
        RIGHT: [],
        FULL: [("all_reduce", 9, 4)],
    }
    for side, shape in CASES[:3]:
        *_, projection, _ = _setup(side, shape, "svd")
        got = _keys(projection.step_collectives(torch.float32, torch.bfloat16))
        assert got == expect[side]
    *_, partial, _ = _setup(TUCKER, (6, 5, 4), "svd")
    *_, rows, _ = _setup(TUCKER, (3, 8, 5), "svd")
    assert _keys(partial.step_collectives(torch.bfloat16, torch.float32)) == [("all_reduce", 27, 2)]
    assert rows.step_collectives(torch.float32, torch.float32) == []
    assert (partial.layout, rows.layout) == ("replicate", "rows")
