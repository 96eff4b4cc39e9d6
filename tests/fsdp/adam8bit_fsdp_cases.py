"""Workers for test_adam8bit.py: GaLoreAdamW8bit on FSDP2 (gloo) against one process.

Three independent matrices, each with its own loss term (so that a difference in one
cannot leak into another's gradient), every rank fed the full batch (FSDP's gradient
average of identical gradients is then exact), exact SVD refreshes (computed once on
the full matrix by its owner rank, then broadcast):

* ``full``  101×100, rank None: 8-bit moments in the parameter's own layout (rows 51/50);
* ``right`` 515×101, GaLore RIGHT: 515×8 moments, layout "rows" (rows 258/257);
* ``left``  100×521, GaLore LEFT: 8×521 moments, layout "cols" (columns 261/260).

Because the block layout never crosses a shard boundary, ``full`` and ``right`` match
the single-process run bit for bit. ``left`` cannot: its projection PᵀG sums over the
sharded rows (partial sums + reduce-scatter), a different fp32 summation order, and a
last-bit difference occasionally moves a moment across an 8-bit rounding boundary. Its
tolerance is set from that (see ``LEFT_ATOL``). The quantizer itself is checked bit for
bit on "cols" and "rows" shards in :func:`quantizer_is_shard_independent`.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

import galore2

from .. import dist as shared
from ..dist import full, full_state

STEPS, GAP, RANK, BATCH, LR = 8, 3, 8, 8, 1e-2  # refreshes at steps 0, 3, 6
# A flipped code changes one moment coordinate by one gap of the 8-bit map (≤ 1.5% of
# its block's absmax), i.e. the normalized update m/√v by ~1e-2 on that coordinate: the
# parameter moves by ≲ LR × 1e-2 = 1e-4 per affected step (then decaying with β1). 1e-3
# leaves room for a few such steps on one coordinate; a wrong layout or update shows as
# differences of order LR = 1e-2. Measured: ≤ 2.1e-5, with 7 ("keep") and 27 ("project":
# the r×r rotation is one more cross-rank sum) of 8336 codes differing.
LEFT_ATOL = 1e-3
LEFT_MAX_CODE_FLIPS = 0.01  # fraction of the LEFT codes allowed to differ


class ThreeMatrices(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.left = nn.Linear(521, 100, bias=False)
        self.full = nn.Linear(100, 101)
        self.right = nn.Linear(101, 515, bias=False)

    def forward(self, xs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return self.left(xs[0]), self.full(xs[1]), self.right(xs[2])


def data(step: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(300 + step)
    xs = [torch.randn(BATCH, d, generator=g) for d in (521, 100, 101)]
    ys = [torch.randn(BATCH, d, generator=g) for d in (100, 101, 515)]
    return xs, ys


def optimizer(model: ThreeMatrices, settings: dict) -> galore2.GaLoreAdamW8bit:
    groups = [
        {
            "params": [model.left.weight, model.right.weight],
            "rank": RANK,
            "update_proj_gap": GAP,
            "projector": "svd",
            **settings,
        },
        {"params": [model.full.weight, model.full.bias]},
    ]
    return galore2.GaLoreAdamW8bit(groups, lr=LR, weight_decay=0.05)


def _loss(outputs: tuple[torch.Tensor, ...], ys: list[torch.Tensor]) -> torch.Tensor:
    return sum(nn.functional.mse_loss(o, y) for o, y in zip(outputs, ys, strict=True))


def train(model: ThreeMatrices, opt: torch.optim.Optimizer, rank: int = 0, world: int = 1) -> None:
    """Every rank is fed the full batch (``rank`` and ``world`` are not used)."""
    shared.train(model, opt, STEPS, data=data, loss=_loss)


def _shard(model: ThreeMatrices, mesh) -> ThreeMatrices:
    return shared.shard(model, mesh, units=(model.left, model.full, model.right))


def matches_single_process(rank: int, world: int) -> None:
    from galore2.projectors.base import LEFT, NONE, RIGHT

    mesh = shared.cpu_mesh(world)
    for settings in ({}, {"moments_on_refresh": "project"}):
        sharded, opt, reference, ref_opt = shared.sharded_vs_single(
            rank, world, lambda m: _shard(m, mesh), partial(optimizer, settings=settings),
            model=ThreeMatrices, run=train,
        )  # fmt: skip
        assert ref_opt.nonfinite_skips == 0 and opt.nonfinite_skips == 0

        named = zip(sharded.named_parameters(), reference.parameters(), strict=True)
        for (name, p), q in named:
            s, r = opt.state[p], ref_opt.state[q]
            where = f"{settings} rank {rank}/{world} {name}"
            # the state layout does not depend on sharding: same keys, global shapes, dtypes
            assert sorted(s) == sorted(r), (where, sorted(s), sorted(r))
            whole = {k: full(v) for k, v in s.items()}
            for k, v in whole.items():
                assert (v.shape, v.dtype) == (r[k].shape, r[k].dtype), (where, k)
            side = int(r["galore.side"])
            if name != "full.bias":
                assert "adam.exp_avg.absmax" in r, where  # 8-bit moments on all three matrices
                expected = {"left.weight": LEFT, "right.weight": RIGHT, "full.weight": NONE}
                assert side == expected[name], (where, side)
            if name == "left.weight":
                flips = sum(
                    int((whole[k] != r[k]).sum()) for k in ("adam.exp_avg", "adam.exp_avg_sq")
                )
                assert flips <= LEFT_MAX_CODE_FLIPS * 2 * r["adam.exp_avg"].numel(), (where, flips)
                diff = (full(p) - q).abs().max().item()
                assert diff <= LEFT_ATOL, f"{where}: differs by {diff:.2e}"
            else:  # bit for bit: parameter and every state tensor
                assert torch.equal(full(p), q), f"{where}: parameter differs"
                for k, v in whole.items():
                    assert torch.equal(v, r[k]), (where, k)
        moved = (full(sharded.full.weight) - ThreeMatrices().full.weight).abs().max().item()
        assert moved > 1e-2  # the run did train
        refreshes = shared.refresh_counts(opt)
        assert sorted(refreshes) == [3, 3], refreshes


def quantizer_is_shard_independent(rank: int, world: int) -> None:
    """Quantizing each rank's shard of X gives, gathered, exactly the codes and absmax of
    quantizing X in one process (and dequantizing a shard gives that shard of X's values)."""
    from galore2.optim.adam8bit import absmax_shape, block_dim, dequantize, quantize_

    model = _shard(ThreeMatrices(), world)
    opt = optimizer(model, {})
    placement = opt._engine.placement(model.full.weight)
    g = torch.Generator().manual_seed(7)
    for shape, layout in (((8, 521), "cols"), ((515, 8), "rows"), ((101, 100), "param")):
        x = torch.randn(shape, generator=g) * torch.logspace(-4, 0, shape[1])
        dim = block_dim(shape, layout)
        assert dim == (0 if layout == "cols" else 1)
        for signed in (True, False):
            value = x if signed else x.square()
            codes = placement.zeros(shape, torch.uint8, torch.device("cpu"), layout)
            absmax = placement.zeros(
                absmax_shape(shape, dim), torch.float32, torch.device("cpu"), layout
            )
            if layout == "cols":
                start, stop = _bounds(shape[1], world, rank)
                local = value[:, start:stop]
            else:
                start, stop = _bounds(shape[0], world, rank)
                local = value[start:stop]
            quantize_(local, codes, absmax, dim, signed)
            ref_codes = torch.zeros(shape, dtype=torch.uint8)
            ref_absmax = torch.zeros(absmax_shape(shape, dim))
            quantize_(value, ref_codes, ref_absmax, dim, signed)
            assert torch.equal(codes.full_tensor(), ref_codes), (layout, signed)
            assert torch.equal(absmax.full_tensor(), ref_absmax), (layout, signed)
            full_values = dequantize(ref_codes, ref_absmax, dim, signed)
            local_values = dequantize(codes, absmax, dim, signed)
            expect = full_values[:, start:stop] if layout == "cols" else full_values[start:stop]
            assert torch.equal(local_values, expect), (layout, signed)


def _bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    chunk = -(-size // parts)
    start = min(index * chunk, size)
    return start, min(start + chunk, size)


def run_all(rank: int, world: int) -> None:
    quantizer_is_shard_independent(rank, world)
    matches_single_process(rank, world)


def _build(world: int) -> tuple[ThreeMatrices, torch.optim.Optimizer]:
    model = ThreeMatrices()
    if world > 1:
        _shard(model, world)
    return model, optimizer(model, {"moments_on_refresh": "project"})


def dcp_save(rank: int, world: int, root: str) -> None:
    from pathlib import Path

    from galore2.checkpoint import save_checkpoint

    model, opt = _build(world)
    train(model, opt)
    save_checkpoint(root, STEPS, model, opt)
    saved = full_state(model, opt)
    if rank == 0:
        torch.save(saved, Path(root) / "saved.pt")


def dcp_load(rank: int, world: int, root: str) -> None:
    """Load the world-2 checkpoint at another world size: every state tensor (8-bit codes,
    absmax in both block layouts, counters) comes back bit for bit."""
    from pathlib import Path

    from galore2.checkpoint import load_checkpoint

    saved = torch.load(Path(root) / "saved.pt", weights_only=True)
    model, opt = _build(world)
    load_checkpoint(root, model, opt)
    loaded = full_state(model, opt)
    assert sorted(loaded) == sorted(saved)
    for name, tensors in saved.items():
        assert sorted(loaded[name]) == sorted(tensors), name
        for key, value in tensors.items():
            got = loaded[name][key]
            assert got.dtype == value.dtype and torch.equal(got, value), (world, name, key)
    assert loaded["left.weight"]["adam.exp_avg"].dtype == torch.uint8
    train(model, opt)  # and it trains on
