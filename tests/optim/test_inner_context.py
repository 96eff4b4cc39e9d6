"""GaLore's inner rules see, at every ``update``, the direction's context they saw at init:
laid out as the low-rank direction (a left projection's r×n: ``"cols"``; a right one's m×r:
``"rows"``), not as the parameter — per tensor, batched, stacked and on refresh steps."""

from __future__ import annotations

import pytest
import torch

from galore2.optim import ChainOptimizer, GaLore, ScaleByAdam


class _Seen(ScaleByAdam):
    """Adam recording each direction's (shape, layout) at init and at update."""

    def __init__(self) -> None:
        super().__init__()
        self.inits: list[tuple[tuple[int, ...], str]] = []
        self.updates: list[tuple[tuple[int, ...], str]] = []

    def init(self, shape, ref, group, state, ctx) -> None:
        self.inits.append((tuple(shape), ctx.layout))
        super().init(shape, ref, group, state, ctx)

    def update(self, u, state, group, ctx):
        self.updates.append((tuple(u.shape[-2:]), ctx.layout))
        return super().update(u, state, group, ctx)

    def update_many(self, us, states, group, ctxs):
        if us and (us[0].device.type != "cpu" or group.get("foreach")):
            self.updates += [(tuple(u.shape[-2:]), c.layout) for u, c in zip(us, ctxs, strict=True)]
        return super().update_many(us, states, group, ctxs)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    wide = [torch.nn.Linear(20, 8, bias=False) for _ in range(3)]  # 8×20, left: R is 4×20
    tall = [torch.nn.Linear(8, 20, bias=False) for _ in range(3)]  # 20×8, right: R is 20×4
    return torch.nn.Sequential(*wide, *tall)


@pytest.mark.parametrize("foreach", [False, True])
def test_inner_rules_see_the_directions_layout_at_update_as_at_init(foreach):
    model = _model()
    seen = _Seen()
    opt = ChainOptimizer(
        [{"params": list(model.parameters()), "rank": 4, "update_proj_gap": 2}],
        [GaLore(seen)],
        {"lr": 1e-2, "foreach": foreach},
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):  # refreshes at steps 1, 3, 5: those matrices step on their own
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    want = {(4, 20): "cols", (20, 4): "rows"}
    assert set(seen.inits) == set(want.items())
    assert seen.updates and set(seen.updates) == set(want.items())
