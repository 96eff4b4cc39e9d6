"""``update_many`` (foreach kernels) gives exactly what the per-tensor ``update`` loop gives."""

from __future__ import annotations

import copy

import pytest
import torch

from galore2.core.transform import Context, LowRankUpdate
from galore2.optim import ChainOptimizer, GaLore, ScaleByAdam

_OPTIONS = ChainOptimizer.declared_options([GaLore(ScaleByAdam())])

GROUP = {
    **{name: o.default for name, o in _OPTIONS.items()},
    "betas": (0.9, 0.99),
    "eps": 1e-8,
    "lr": 1e-2,
    "weight_decay": 0.1,
    "state_dtype": "float32",
    "rank": 3,
    "update_proj_gap": 2,
    "scale": 0.5,
    "proj_type": "std",
    "projector": "randomized",
    "oversample": 4,
    "power_iters": 1,
    "moments_on_refresh": "project",
    "nonfinite": "skip",
    "seed": 0,
}


def _setup(transform, shapes):
    params = [torch.randn(s) for s in shapes]
    ctxs = [Context(param=p, index=i) for i, p in enumerate(params)]
    states = [{} for _ in params]
    for p, s, c in zip(params, states, ctxs, strict=True):
        transform.init(p.shape, p, GROUP, s, c)
    return params, states, ctxs


def _as_tensor(u):
    return u.dense() if isinstance(u, LowRankUpdate) else u


@pytest.mark.parametrize(
    "transform", [ScaleByAdam(), GaLore(ScaleByAdam())], ids=["adam", "galore"]
)
def test_update_many_equals_update_loop(transform):
    shapes = [(6, 9), (9, 6), (7,), (5, 5), (4, 2, 3)]
    _, states, ctxs = _setup(transform, shapes)
    states_loop = copy.deepcopy(states)
    # the step's decoupled decay factor, for GaLore (which folds it into projected updates)
    decay = {"decay": 1 - GROUP["lr"] * GROUP["weight_decay"]} if transform.takes_decay else {}
    for step in range(5):
        grads = [torch.randn(s) for s in shapes]
        if step == 3:
            grads[1][0, 0] = float("nan")
        batched = transform.update_many(grads, states, GROUP, ctxs, **decay)
        looped = []
        for g, s, c in zip(grads, states_loop, ctxs, strict=True):
            try:
                looped.append(transform.update(g, s, GROUP, c, **decay))
            except Exception:
                looped.append(None)
        for b, l_ in zip(batched, looped, strict=True):
            assert (b is None) == (l_ is None)
            if b is not None:
                torch.testing.assert_close(
                    _as_tensor(b), _as_tensor(l_), rtol=0, atol=0, equal_nan=True
                )
    for s_b, s_l in zip(states, states_loop, strict=True):
        assert s_b.keys() == s_l.keys()
        for key in s_b:
            torch.testing.assert_close(s_b[key], s_l[key], rtol=0, atol=0, equal_nan=True)
