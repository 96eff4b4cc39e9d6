"""``collective_bytes`` against the collectives an FSDP2 run really issues (gloo, p = 2, 3).

Inside each spawned rank, ``ShardedPlacement``'s collective methods are wrapped to record
(op, logical numel, itemsize) as galore2 issues them (``dist.gather`` for the padded
chunk ``gather_rows`` sends); a ``TorchDispatchMode`` records every c10d / functional
collective op of forward + backward + step besides, so nothing can bypass the placement
unseen, and FSDP2's own all-gathers / reduce-scatters are compared with ``Traffic.fsdp``.
Steps 0, 1, 2 with ``update_proj_gap=2`` are a first refresh, a plain step and a later
refresh; per-layer updates (``galore2.per_layer``) are covered too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import galore2
from galore2.traffic import Collective, collective_bytes

from ..dist import spawn

RANK, GAP, BATCH = 3, 2, 16  # batch per rank: full-rank, well-conditioned gradients
UNITS = ["0", "2"]  # fully_shard'ed layers; layer 4 stays in the root (no backward re-gather)

CONFIGS: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"projector": "randomized"}, {}),
    (
        {
            "projector": "randomized",
            "moments_on_refresh": "project",
            "power_iters": 2,
            "oversample": 0,
        },
        {},
    ),
    ({"projector": "power"}, {}),
    ({"projector": "power", "moments_on_refresh": "project", "power_iters": 2}, {}),
    ({"projector": "svd"}, {}),
    ({"projector": "svd", "moments_on_refresh": "project", "proj_type": "full"}, {}),
    ({"projector": "random", "moments_on_refresh": "project"}, {}),
    ({"projector": "randomized", "proj_type": "full", "moments_on_refresh": "project"}, {}),
    ({"projector": "power", "proj_type": "full"}, {}),
    ({"projector": "randomized", "proj_type": "right", "oversample": 12}, {}),  # k clipped
    ({"nonfinite": "ignore", "state_dtype": "bfloat16"}, {}),
    ({"moments_on_refresh": "project"}, {"dtype": torch.bfloat16}),
    ({"projector": "svd"}, {"mp": (torch.bfloat16, torch.float32)}),
    ({"projector": "randomized"}, {"per_layer": True}),
    ({"projector": "svd", "moments_on_refresh": "project"}, {"per_layer": True}),
]


def make_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    # 13×20 (left, rows uneven at p = 2, 3), 17×13 (right), 12×17 (left, in the root unit).
    # Left weights have m > r + oversample: a square sketch G·Ω (k = m) can be too
    # ill-conditioned for fp32 CholeskyQR2, whose fp64 retry adds Gram all-reduces.
    return nn.Sequential(
        nn.Linear(20, 13), nn.Tanh(), nn.Linear(13, 17), nn.Tanh(), nn.Linear(17, 12)
    ).to(dtype)


# ---- recording (inside a rank) -------------------------------------------------------
Key = tuple[str, int, int]
_SINK: list[list[Key]] = [[]]  # where the placement wrappers write


def _record(op: str, t: torch.Tensor, numel: int | None = None) -> None:
    _SINK[0].append((op, t.numel() if numel is None else numel, t.element_size()))


def _wrap_placement() -> Callable[[], None]:
    """Wrap ShardedPlacement's collectives (and dist.gather); returns the undo function."""
    from galore2.fsdp.placement import ShardedPlacement as SP

    saved = {n: getattr(SP, n) for n in ("reduce", "reduce_scatter_cols", "all_gather_cols")}
    saved |= {n: getattr(SP, n) for n in ("any", "any_global", "broadcast")}
    real_gather = dist.gather

    def reduce(self, t):
        _record("all_reduce", t)
        return saved["reduce"](self, t)

    def reduce_scatter_cols(self, t):
        _record("reduce_scatter", t)
        return saved["reduce_scatter_cols"](self, t)

    def all_gather_cols(self, t, n):
        out = saved["all_gather_cols"](self, t, n)
        _record("all_gather", out)
        return out

    def flags(name):
        def any_(self, fl):
            n = fl.numel() if isinstance(fl, torch.Tensor) else len(fl)
            if n:
                _record("all_reduce", torch.zeros(n, dtype=torch.int32))
            return saved[name](self, fl)

        return any_

    def broadcast(self, t, owner, shape, device=None):
        out = saved["broadcast"](self, t, owner, shape, device)
        _record("broadcast", out)
        return out

    def gather(tensor, gather_list=None, dst=None, group=None, **kw):  # gather_rows' chunk
        _record("gather", tensor, tensor.numel() * dist.get_world_size(group))
        return real_gather(tensor, gather_list, dst=dst, group=group, **kw)

    SP.reduce, SP.reduce_scatter_cols, SP.all_gather_cols = (
        reduce,
        reduce_scatter_cols,
        all_gather_cols,
    )
    SP.any, SP.any_global, SP.broadcast = flags("any"), flags("any_global"), broadcast
    dist.gather = gather

    def undo() -> None:
        for name, fn in saved.items():
            setattr(SP, name, fn)
        dist.gather = real_gather

    return undo


_OPS = {  # dispatcher op → collective kind; argument index of the tensor sized by convention
    "c10d::allreduce_": ("all_reduce", 0),
    "c10d::broadcast_": ("broadcast", 0),
    "c10d::gather_": ("gather", 1),
    "c10d::_allgather_base_": ("all_gather", 0),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
    "_c10d_functional::all_reduce": ("all_reduce", 0),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", 0),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", 0),
}
_IGNORED = ("wait_tensor", "_wrap_tensor_autograd")


class IssuedCollectives(TorchDispatchMode):
    """Every collective op that reaches the dispatcher: (op, numel, itemsize).

    Functional ops are recorded at their input (DTensor's padded layout, not logical)."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world = world
        self.ops: list[Key] = []
        self.raw: list[str] = []  # the dispatcher op of each entry

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith(("c10d::", "_c10d_functional::")) and not name.endswith(_IGNORED):
            kind, i = _OPS.get(name, (name, 0))
            t = args[i]
            while isinstance(t, (list, tuple)):
                t = t[0]
            numel = t.numel() * (self.world if kind == "gather" else 1)
            if name == "_c10d_functional::all_gather_into_tensor":
                numel *= self.world  # its input is this rank's part
            self.ops.append((kind, numel, t.element_size()))
            self.raw.append(name)
        return func(*args, **(kwargs or {}))


# ---- the worker ------------------------------------------------------------------------
def _keys(cs: tuple[Collective, ...]) -> Counter:
    return Counter(c.key() for c in cs)


def _diff(got: Counter, want: Counter) -> str:
    return f"missing {dict(want - got)}, unexpected {dict(got - want)}"


_FSDP_OPS = ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_")  # FSDP2's own


def _run_config(rank: int, world: int, settings: dict, opts: dict, errors: list[str]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = opts.get("dtype", torch.float32)
    mp = opts.get("mp")
    per_layer = opts.get("per_layer", False)
    with torch.device("meta"):
        expected = collective_bytes(
            make_model(dtype),
            world,
            rank=RANK,
            update_proj_gap=GAP,
            fsdp_units=UNITS,
            param_dtype=mp[0] if mp else None,
            reduce_dtype=mp[1] if mp else None,
            per_layer=per_layer,
            **settings,
        )
    torch.manual_seed(0)
    model = make_model(dtype)
    mesh = init_device_mesh("cpu", (world,))
    kw: dict[str, Any] = {"mesh": mesh}
    if mp:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp[0], reduce_dtype=mp[1])
    for unit in UNITS:
        fully_shard(model.get_submodule(unit), **kw)
    fully_shard(model, **kw)
    opt = galore2.GaLoreAdamW(
        galore2.param_groups(model, rank=RANK, update_proj_gap=GAP, **settings), lr=1e-2
    )
    updates = galore2.per_layer(model, opt) if per_layer else None
    tag = f"p={world} rank {rank} {settings} {opts}"
    want_steps = [
        _keys(expected.step) + _keys(expected.first_refresh),
        _keys(expected.step),
        _keys(expected.step) + _keys(expected.refresh),
    ]
    gen = torch.Generator().manual_seed(1000 + rank)
    for step, want in enumerate(want_steps):
        x = torch.randn(BATCH, 20, generator=gen, dtype=dtype)
        _SINK[0] = []
        issued = IssuedCollectives(world)
        with issued:  # forward + backward + step: per-layer updates run inside backward
            loss = model(x).float().square().mean()
            if updates is not None:
                updates.backward(loss)
            else:
                loss.backward()
                opt.step()
                opt.zero_grad()
        fsdp = Counter(k for k, raw in zip(issued.ops, issued.raw, strict=True) if raw in _FSDP_OPS)
        if fsdp != _keys(expected.fsdp):
            errors.append(f"{tag} step {step} FSDP: {_diff(fsdp, _keys(expected.fsdp))}")
        got = Counter(_SINK[0])
        if got != want:
            errors.append(f"{tag} step {step} galore2: {_diff(got, want)}")
        # Nothing bypasses the placement: same calls per kind; all-reduces etc. exactly.
        ours = [k for k, raw in zip(issued.ops, issued.raw, strict=True) if raw not in _FSDP_OPS]
        low = Counter(op for op, _, _ in ours)
        if low != Counter(op for op, _, _ in _SINK[0]):
            errors.append(f"{tag} step {step}: dispatcher saw {dict(low)}, placement {dict(got)}")
        exact = ("all_reduce", "gather", "broadcast")
        low_exact = Counter(k for k in ours if k[0] in exact)
        mine = Counter(k for k in _SINK[0] if k[0] in exact)
        if low_exact != mine:
            errors.append(f"{tag} step {step}: dispatcher {_diff(low_exact, mine)}")
    refreshes = [int(s["galore.refreshes"]) for s in opt.state.values() if "galore.refreshes" in s]
    if refreshes != [2] * len(expected.galore_params):
        errors.append(f"{tag}: refreshes {refreshes} (expected 2 each: ordinary path only)")
    if updates is not None:
        updates.remove()


def traffic_matches(rank: int, world: int) -> None:
    undo = _wrap_placement()
    errors: list[str] = []
    try:
        for settings, opts in CONFIGS:
            _run_config(rank, world, settings, opts, errors)
    finally:
        undo()
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("world", [2, 3])
def test_collective_bytes_matches_issued_collectives(world):
    spawn(traffic_matches, world)


# ---- on paper only ---------------------------------------------------------------------
def test_formula_by_hand():
    """The 13×20 / 17×13 / 12×17 model, every entry written out."""
    with torch.device("meta"):
        model = make_model()
    t = collective_bytes(model, 2, rank=RANK, projector="randomized", fsdp_units=UNITS)
    assert t.galore_params == ("0.weight", "2.weight", "4.weight")
    # step: 2 flag all-reduces (3 weights, 3 biases) + left 13×20 and 12×17: RS + AG of r×n.
    assert sorted(c.key() for c in t.step) == sorted(
        [("all_reduce", 3, 4)] * 2
        + [("reduce_scatter", 3 * 20, 4), ("all_gather", 3 * 20, 4)]
        + [("reduce_scatter", 3 * 17, 4), ("all_gather", 3 * 17, 4)]
    )
    assert t.bytes("step") == 24 + 2 * 4 * (60 + 51)
    # wire at p = 2: ring all-reduce 2(p−1)/p·N = N; reduce-scatter / all-gather N/2.
    assert t.wire_bytes("step") == 24 + 4 * (60 + 51)
    # 13×20 left, randomized, k = 11, q = 1: any, norm, 2 Grams (the first fp64), GᵀY,
    # 2 Grams, B, align, any.
    left = [c.key() for c in t.refresh if c.param == "0.weight"]
    ar = [
        (1, 4),
        (1, 8),
        (121, 8),
        (121, 4),
        (220, 4),
        (121, 8),
        (121, 4),
        (220, 4),
        (3, 4),
        (1, 4),
    ]
    assert left == [("all_reduce", n, b) for n, b in ar]
    assert left == [c.key() for c in t.first_refresh if c.param == "0.weight"]
    # 17×13 right (k = 11): any, norm, GᵀΩ, Gᵀ(GY), CᵀC, any — orthonormalization is local.
    right = [c.key() for c in t.refresh if c.param == "2.weight"]
    ar = [(1, 4), (1, 8), (143, 4), (143, 4), (121, 4), (1, 4)]
    assert right == [("all_reduce", n, b) for n, b in ar]
    # power, later refresh, q = 1: left GᵀY (n×r) + 2 r×r Grams + align; right Gᵀ(GY) (n×r).
    power = collective_bytes(model, 2, rank=RANK, projector="power", moments_on_refresh="project")
    warm = [c.key()[1] for c in power.refresh if c.param == "0.weight"]
    assert warm == [1, 1, 60, 9, 9, 3, 1, 9]  # … + any, + the _rotation r×r
    assert [c.key()[1] for c in power.refresh if c.param == "2.weight"] == [1, 1, 39, 1]
    assert power.first_refresh[: len(t.first_refresh)] == t.first_refresh[: len(t.first_refresh)]
    # FSDP: units 0 (14×20 + 14 padded) and 2 (18×13 + 18) gathered twice, root (12×17 + 12) once.
    assert sorted(c.key() for c in t.fsdp) == sorted(
        [("all_gather", 294, 4)] * 2
        + [("all_gather", 252, 4)] * 2
        + [("all_gather", 216, 4)]
        + [("reduce_scatter", 294, 4), ("reduce_scatter", 252, 4), ("reduce_scatter", 216, 4)]
    )
    svd = collective_bytes(model, 3, rank=RANK, projector="svd")
    assert [c.key() for c in svd.refresh if c.op != "all_reduce"] == [
        ("gather", 15 * 20, 4),  # 13 rows padded to 3·⌈13/3⌉ = 15
        ("broadcast", 13 * 3, 4),
        ("gather", 18 * 13, 4),
        ("broadcast", 13 * 3, 4),  # Q: n×r
        ("gather", 12 * 17, 4),
        ("broadcast", 12 * 3, 4),
    ]
    random = collective_bytes(model, 2, rank=RANK, projector="random")
    assert [c.key()[1] for c in random.refresh] == [1, 1] * 3
    # (a sum of per-collective shares: equal up to float rounding)
    assert t.amortized_bytes() == pytest.approx(t.bytes("step") + t.bytes("refresh") / 200)
    per_layer = collective_bytes(model, 2, rank=RANK, per_layer=True)
    flags = [c.key() for c in per_layer.step if c.op == "all_reduce"]
    assert flags == [("all_reduce", 1, 4)] * 6 and per_layer.bytes("step") == t.bytes("step")
    assert collective_bytes(model, 1, rank=RANK).calls("step") == 0
    with pytest.raises(ValueError, match="fsdp_units"):
        collective_bytes(model, 2, rank=RANK, fsdp_units=["nope"])
