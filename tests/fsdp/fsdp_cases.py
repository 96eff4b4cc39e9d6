"""FSDP2 runs compared with a single-process run of the same data: workers for test_fsdp.py
(every projector; the exact refresh's split), test_basis_quant.py (int4 + Hadamard bases) and
test_adaptive_refresh.py (adaptive refresh gaps)."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import galore2

from ..dist import (
    assert_params_match,
    cpu_mesh,
    data,
    make_model,
    max_change,
    optimizer,
    refresh_counts,
    shard,
    sharded_vs_single,
    train,
)

CONFIGS = [
    {"projector": "svd"},
    {"projector": "randomized"},
    {"projector": "randomized", "moments_on_refresh": "project"},
    {"projector": "power"},
    {"projector": "random"},
]


def fsdp_matches_single_process(rank: int, world: int) -> None:
    mesh = cpu_mesh(world)
    for settings in CONFIGS:
        sharded, opt, reference, _ = sharded_vs_single(
            rank, world, lambda m: shard(m, mesh), partial(optimizer, settings=settings)
        )
        assert_params_match(sharded, reference, 1e-5, f"{settings} rank {rank}/{world}")
        refreshes = refresh_counts(opt)
        assert refreshes and all(r == 3 for r in refreshes), refreshes
        assert max_change(sharded, make_model()) > 1e-3


def exact_refresh_is_split_and_batched(rank: int, world: int) -> None:
    """Each due matrix is factored once, by its owner; gathers all precede the SVDs."""
    import torch.distributed as dist

    from galore2.fsdp.placement import ShardedPlacement
    from galore2.projectors.svd import SVDProjector

    events: list[str] = []
    # the class attributes as stored (a staticmethod stays one when put back: the ranks
    # are kept for later calls, see tests/dist.py)
    real_svd, real_gather, real_bcast = (
        vars(SVDProjector)["_svd"],
        ShardedPlacement.gather_rows,
        ShardedPlacement.broadcast,
    )
    SVDProjector._svd = staticmethod(
        lambda *a: (events.append("svd"), real_svd.__func__(*a))[1]
    )
    ShardedPlacement.gather_rows = lambda self, *a: (
        events.append("gather"),
        real_gather(self, *a),
    )[1]
    ShardedPlacement.broadcast = lambda self, *a: (events.append("bcast"), real_bcast(self, *a))[1]
    try:
        model = shard(make_model(), world)
        opt = optimizer(model, {"projector": "svd"})
        x, y = data(0)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()  # step 0: every matrix refreshes
    finally:
        SVDProjector._svd, ShardedPlacement.gather_rows, ShardedPlacement.broadcast = (
            real_svd,
            real_gather,
            real_bcast,
        )
    matrices = 3
    assert events.count("gather") == matrices and events.count("bcast") == matrices
    last_gather = max(i for i, e in enumerate(events) if e == "gather")
    assert all(i > last_gather for i, e in enumerate(events) if e == "svd")
    counts = torch.tensor([events.count("svd")])
    dist.all_reduce(counts)
    assert int(counts) == matrices  # factored once each, not once per rank


# ---- int4 + Hadamard bases (test_basis_quant.py) -------------------------------------------

# dist.make_model: 7×10 (left: P 7×r row-sharded 4/3), 13×7 (right: Q 7×r replicated),
# 5×13 (left: P 5×r sharded 3/2). Rank 3 with Hadamard blocks of 2: one full block and a
# tail of 1 (odd length: a padding nibble); blocks of 4: the tail of 3 padded to 4.
INT4_CONFIGS = [
    {"projector": "randomized", "basis_group_size": 2},
    {"projector": "svd", "basis_group_size": 4, "moments_on_refresh": "project"},
    {"projector": "power", "basis_group_size": 2},
]
INT4_HADAMARD = {"basis_dtype": "int4", "basis_hadamard": True}


def int4_hadamard_matches_single_process(rank: int, world: int) -> None:
    mesh = cpu_mesh(world)
    for settings in INT4_CONFIGS:
        sharded, opt, reference, ref_opt = sharded_vs_single(
            rank,
            world,
            lambda m: shard(m, mesh),
            partial(optimizer, settings={**INT4_HADAMARD, **settings}),
        )
        assert_params_match(sharded, reference, 1e-5, f"{settings} rank {rank}/{world}")
        moved = max_change(sharded, make_model())
        assert moved > 1e-3, moved  # it did train
        # The stored codes and scales are DTensors laid out like the basis and hold, shard
        # for shard, what the single process stores.
        for p, q in zip(sharded.parameters(), reference.parameters(), strict=True):
            state, ref_state = opt.state[p], ref_opt.state[q]
            keys = sorted(k for k in state if k.startswith("proj."))
            if not keys:
                continue
            assert keys == sorted(k for k in ref_state if k.startswith("proj.")), keys
            assert int(state["galore.refreshes"]) == 3
            for key in keys:
                t = state[key]
                assert isinstance(t, DTensor), key
                assert "proj.left" not in key or t.placements[0].is_shard(0), (key, t.placements)
                assert "proj.right" not in key or t.placements[0].is_replicate(), key
                full = t.full_tensor()
                assert full.dtype == ref_state[key].dtype and full.shape == ref_state[key].shape
                if key.endswith(".q"):  # the same codes (the bases agree to ~1e-7)
                    assert torch.equal(full, ref_state[key]), key
                else:
                    torch.testing.assert_close(full, ref_state[key], rtol=1e-5, atol=1e-6)
    torch.distributed.barrier()


# ---- adaptive refresh (test_adaptive_refresh.py) ---------------------------------------------

ADAPTIVE_STEPS = 40
ADAPTIVE = {"rank": 3, "update_proj_gap": 2, "adaptive_refresh": True, "refresh_threshold": 0.3,
            "refresh_patience": 2, "max_update_proj_gap": 8}  # fmt: skip


def _adaptive_optimizer(model, projector: str) -> galore2.GaLoreAdamW:
    return galore2.GaLoreAdamW(
        galore2.param_groups(model, projector=projector, **ADAPTIVE), lr=1e-2
    )


def _same_batch(step: int):
    return data(0, seed=7)  # the same batch every step: a steady subspace


def adaptive_matches_single_process(rank: int, world: int) -> None:
    mesh = cpu_mesh(world)
    for projector in ("randomized", "svd"):
        sharded, opt, reference, ref_opt = sharded_vs_single(
            rank, world, lambda m: shard(m, mesh), partial(_adaptive_optimizer, projector=projector),
            run=partial(train, steps=ADAPTIVE_STEPS, data=_same_batch),
        )  # fmt: skip
        stats, ref_stats = opt.refresh_stats(), ref_opt.refresh_stats()
        assert {i: (s["refreshes"], s["gap"]) for i, s in stats.items()} == {
            i: (s["refreshes"], s["gap"]) for i, s in ref_stats.items()
        }
        assert max(s["gap"] for s in stats.values()) > ADAPTIVE["update_proj_gap"]  # it adapted
        assert_params_match(sharded, reference, 1e-5, f"{projector} rank {rank}/{world}")
