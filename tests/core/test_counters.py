"""Packed host counters (:mod:`galore2.core.counters`): one ``add_`` and one read advance a
batch's step counters, and nothing outside the optimizer can tell they are packed."""

from __future__ import annotations

import copy
import io
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import galore2
from galore2.core.counters import Counters
from galore2.core.state import counter

from ..helpers import TinyNet, galore_groups, train

KEY = "adam.step"


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _states(*values: int) -> list[dict[str, torch.Tensor]]:
    return [{KEY: counter(v)} for v in values]


def test_advance_counts_every_counter_with_one_op_and_no_scalar_read():
    states = _states(0, 5, 7)
    objects = [s[KEY] for s in states]
    counters = Counters()
    assert counters.advance(states, KEY) == [1, 6, 8]
    with Ops() as watch:
        assert counters.advance(states, KEY) == [2, 7, 9]
    assert watch.ops == Counter({"add_": 1}), watch.ops  # no per-counter add, no int() read
    assert [s[KEY] for s in states] == objects  # the same tensors, advanced in place
    assert [int(s[KEY]) for s in states] == [2, 7, 9]
    assert all(t.dim() == 0 and t.dtype == torch.int64 for t in objects)


def test_a_counter_in_two_batches_counts_once_per_advance():
    a, b, _ = states = _states(0, 0, 0)
    counters = Counters()
    counters.advance(states, KEY)  # packs a, b, c
    counters.advance([a, b], KEY)  # a, b move to a pack of their own
    assert counters.advance(states, KEY) == [3, 3, 2]  # the first pack is not reused stale
    assert [int(s[KEY]) for s in states] == [3, 3, 2]


def test_a_replaced_counter_is_packed_again():
    states = _states(1, 2)
    counters = Counters()
    counters.advance(states, KEY)
    states[1][KEY] = counter(40)  # what load_state_dict does
    assert counters.advance(states, KEY) == [3, 41]
    assert int(states[1][KEY]) == 41


def test_shared_or_device_counters_are_not_packed():
    shared = counter(0)
    assert Counters().packed([{KEY: shared}, {KEY: shared}], KEY) is None
    meta = [{KEY: torch.zeros((), dtype=torch.int64, device="meta")}]
    assert Counters().packed(meta, KEY) is None
    assert Counters().packed([{KEY: torch.zeros(())}], KEY) is None  # a float: not a counter


def _opt(model: TinyNet) -> torch.optim.Optimizer:
    return galore2.GaLoreAdamW(galore_groups(model, rank=4), lr=1e-2, foreach=True)


def test_a_packed_optimizer_checkpoints_and_copies_like_an_unpacked_one():
    """Saved with packed counters, loaded with ``weights_only=True`` into a fresh optimizer,
    deep-copied: every copy counts on its own and all end bitwise equal to a per-tensor run
    (whose counters are never packed)."""
    torch.manual_seed(0)
    model = TinyNet()
    twin, plain_model = copy.deepcopy(model), copy.deepcopy(model)
    opt = _opt(model)
    plain = galore2.GaLoreAdamW(galore_groups(plain_model, rank=4), lr=1e-2, foreach=False)
    train(model, opt, range(3))
    train(plain_model, plain, range(3))
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    twin.load_state_dict(model.state_dict())
    restored = _opt(twin)
    restored.load_state_dict(torch.load(buf, weights_only=True))
    copied_model, copied = copy.deepcopy((model, opt))  # one memo: params map together
    for m, o in ((model, opt), (twin, restored), (copied_model, copied), (plain_model, plain)):
        train(m, o, range(3, 6))
    for m, o in ((twin, restored), (copied_model, copied)):
        for p, q in zip(model.parameters(), m.parameters(), strict=True):
            assert torch.equal(p, q)
        assert _steps(o) == _steps(opt)
    assert _steps(opt) == _steps(plain) == [6] * 8


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def _steps(opt: torch.optim.Optimizer) -> list[int]:
    return [int(opt.state[p][KEY]) for p in _params(opt)]


def test_two_modules_packing_the_same_counters_never_count_stale():
    """Two :class:`Counters` (two modules reading one key) re-pointing the same counters in
    turn: each advance still counts every counter once (a pack re-pointed by another is
    rebuilt, not reused)."""
    a, b, _ = states = _states(0, 0, 0)
    first, second = Counters(), Counters()
    first.advance(states, KEY)
    second.advance([a, b], KEY)  # re-points a and b at another module's pack
    assert first.advance(states, KEY) == [3, 3, 2]
    assert second.advance([a, b], KEY) == [4, 4]
    assert [int(s[KEY]) for s in states] == [4, 4, 2]
