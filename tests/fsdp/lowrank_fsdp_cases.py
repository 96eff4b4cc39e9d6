"""Workers for test_fsdp_lowrank.py: Fira's residual compensation, APOLLO / APOLLO-Mini's
gradient scaling (norm-growth limiter) and GaLoreMuon's orthogonalized momentum on FSDP2
(gloo) against one process, and their DCP resharding.

``dist.make_model`` holds both sides (every Linear is projected at rank 3, ``GAP`` 8, 20 steps:
refreshes at 0, 8 and 16):

* 7×10 LEFT: P 7×3 row-sharded 4/3 (world 2), 3/3/1 (world 3); R, N 3×10 by columns 5/5, 4/4/2;
* 13×7 RIGHT: Q replicated, R, N 13×3 by rows 7/6, 5/5/3;
* 5×13 LEFT: P 5×3 rows 3/2, 2/2/1; R, N 3×13 by columns 7/6, 5/5/3.

What sharding changes, per module: Fira and APOLLO all-gather [N; R] of a LEFT matrix (its
per-column ratios ‖N‖/‖R‖ need every row of both) and keep a RIGHT matrix's per-row ratios
local; APOLLO-Mini's Frobenius ratio and the limiter's ‖S‖ are all-reduced; Muon all-reduces
each r×r Gram matrix (and ‖X‖_F) of the column- (LEFT) or row-sharded (RIGHT) momentum, and
nothing for proj_type="full"'s replicated r×r one; with proj_type="reverse_std" the low-rank
direction's longer side is the parameter's shorter one. Only
the order of fp32 sums differs from one process, so parameters agree to 1e-5 (as
test_fsdp.py's) and the limiter's norm — a plain replicated scalar — is bitwise the same on
every rank and within 1e-5 (relative) of the single process's.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

import galore2
from galore2.checkpoint import load_checkpoint, save_checkpoint
from galore2.optim.residual import LIMIT_KEY
from galore2.projectors import FULL, LEFT, RIGHT

from .. import dist as shared
from ..dist import (
    GAP,
    RANK,
    assert_params_match,
    assert_same_across,
    cpu_mesh,
    full,
    full_state,
    make_model,
    max_change,
    refresh_counts,
    shard,
    sharded_vs_single,
    train,
)
from . import adam8bit_fsdp_cases as a8

# name → (preset, group settings); every config projects both sides of dist.make_model.
CONFIGS: dict[str, tuple[type, dict]] = {
    "fira-svd": (galore2.Fira, {"projector": "svd"}),
    "fira-randomized-project": (
        galore2.Fira,
        {"projector": "randomized", "moments_on_refresh": "project"},
    ),
    "apollo": (galore2.APOLLO, {}),  # projector="random", scale_type="channel"
    "apollo-mini": (galore2.APOLLOMini, {}),  # scale_type="tensor", α = √128
    "muon-newton_schulz": (galore2.GaLoreMuon, {"orthogonalize": "newton_schulz"}),  # randomized
    "muon-polar": (galore2.GaLoreMuon, {"orthogonalize": "polar", "projector": "svd"}),
    # the other side of each matrix (7×10 RIGHT, 13×7 LEFT, 5×13 RIGHT): the low-rank
    # direction's longer side is the parameter's shorter one
    "muon-reverse_std": (galore2.GaLoreMuon, {"proj_type": "reverse_std"}),
    # both sides projected: the r×r direction is whole (replicated) on every rank
    "muon-full": (galore2.GaLoreMuon, {"proj_type": "full", "orthogonalize": "polar"}),
}
ATOL = 1e-5  # parameters (test_fsdp.py's tolerance)
LIMIT_RTOL = 1e-5  # the limiter's norm against one process


def build(model: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    cls, settings = CONFIGS[name]
    groups = galore2.param_groups(model, rank=RANK, update_proj_gap=GAP, **settings)
    return cls(groups, lr=1e-2, weight_decay=0.05)


def _report(rank: int, what: str, value: float) -> None:
    if rank == 0:
        print(f"[lowrank-fsdp] {what}: {value:.3e}", flush=True)


def _max_param_diff(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    return max(
        (full(p) - full(q)).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )


def _check_limiter(opt, ref_opt, model, reference, where: str, rtol: float = LIMIT_RTOL) -> float:
    """The limiter's norm: a plain (replicated) fp32 scalar, bitwise equal on every rank, and
    the single process's up to summation order. Returns its largest relative difference."""
    worst = 0.0
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        state, ref_state = opt.state[p], ref_opt.state[q]
        if int(ref_state["galore.side"]) not in (LEFT, RIGHT):
            assert LIMIT_KEY not in state, where
            continue
        value, expected = state[LIMIT_KEY], ref_state[LIMIT_KEY]
        assert not hasattr(value, "full_tensor") and value.dtype == torch.float64, where
        assert_same_across(value, f"{where}: {LIMIT_KEY}")
        assert float(expected) > 0, where  # the limiter ran
        rel = abs(float(value) - float(expected)) / float(expected)
        assert rel <= rtol, f"{where}: {LIMIT_KEY} differs by {rel:.2e} (relative)"
        worst = max(worst, rel)
    return worst


def _sides(opt) -> list[int]:
    return sorted(int(s["galore.side"]) for s in opt.state.values() if "galore.refreshes" in s)


def matches_single_process(rank: int, world: int, names: tuple[str, ...]) -> None:
    mesh = cpu_mesh(world)
    for name in names:
        sharded, opt, reference, ref_opt = sharded_vs_single(
            rank, world, lambda m: shard(m, mesh), partial(build, name=name)
        )
        where = f"{name} rank {rank}/{world}"
        diff = _max_param_diff(sharded, reference)
        assert_params_match(sharded, reference, ATOL, where)
        _report(rank, f"{name} world {world}: max |param diff|", diff)
        proj_type = CONFIGS[name][1].get("proj_type", "std")
        sides = {"std": [LEFT, LEFT, RIGHT], "reverse_std": [LEFT, RIGHT, RIGHT]}
        assert _sides(opt) == sorted(sides.get(proj_type, [FULL] * 3)), (where, _sides(opt))
        assert refresh_counts(opt) == [3, 3, 3], (where, refresh_counts(opt))
        assert max_change(sharded, make_model()) > 1e-3, where  # it trained
        if CONFIGS[name][0] is galore2.GaLoreMuon:
            for p, q in zip(sharded.parameters(), reference.parameters(), strict=True):
                if "muon.momentum" in ref_opt.state[q]:
                    got = full(opt.state[p]["muon.momentum"])
                    torch.testing.assert_close(
                        got, ref_opt.state[q]["muon.momentum"], rtol=1e-5, atol=1e-6
                    )
            assert sum("muon.momentum" in s for s in ref_opt.state.values()) == 3  # biases: Adam
        else:
            rel = _check_limiter(opt, ref_opt, sharded, reference, where)
            _report(rank, f"{name} world {world}: max rel |limit_norm diff|", rel)


# ---- Fira with 8-bit moments and an int8 basis (adam8bit_fsdp_cases' three matrices) ------

FIRA_8BIT = {"residual": "fira", "basis_dtype": "int8"}
# The limiter's norm sums φ-scaled residual columns; a flipped 8-bit moment code or int8
# basis code changes its column's φ = ‖N‖/‖R‖ by up to ~1%. Measured: 1.7e-4 (world 2: 2
# of 800 basis codes and 151 of 8336 moment codes of LEFT differ after the step-3 refresh's
# SVD met a last-bit difference and moved one basis code).
LIMIT_RTOL_8BIT = 1e-3


def _data16(step: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two of adam8bit_fsdp_cases' batches (16 rows), row i weighted by 0.85^i.

    16 rows: the gradients' rank exceeds the basis rank (8), so the residual G − P·PᵀG is
    more than rounding noise even at a refresh (with 8 rows an exact rank-8 basis spans G
    and the limiter then holds the residual near zero for good). The weights (the gradient's
    terms by 0.72^i) separate its singular values: with 16 equal-weight random rows some
    are within 0.3% of each other, and an exact-SVD refresh with kept moments turns a 1-ulp
    gradient difference into ~5e-3 of the parameters even in one process (plain GaLore
    too); here a 1-ulp perturbation moves them by < 1e-5."""
    (xa, ya), (xb, yb) = a8.data(step), a8.data(step + 1000)
    w = (0.85 ** torch.arange(16.0))[:, None]
    xs = [torch.cat(t) * w for t in zip(xa, xb, strict=True)]
    return xs, [torch.cat(t) * w for t in zip(ya, yb, strict=True)]


def _train_8bit(model, opt, rank: int = 0, world: int = 1) -> None:
    """Every rank is fed the full batch (adam8bit_fsdp_cases' convention)."""
    shared.train(model, opt, a8.STEPS, data=_data16, loss=a8._loss)


def fira_8bit_matches_single_process(rank: int, world: int) -> None:
    """GaLoreAdamW8bit(residual="fira") + int8 bases against one process, on
    adam8bit_fsdp_cases' LEFT 100×521, RIGHT 515×101 (rank 8: 8-bit low-rank moments) and
    unprojected 101×100 matrices, exact SVD refreshes at steps 0, 3, 6. Tolerance: its
    LEFT_ATOL for every matrix — a last-bit difference of a cross-rank sum (PᵀG, the
    limiter's ‖S‖, and at world 3 FSDP's average of three equal gradients) can move an 8-bit
    code (measured: ≤ 4.1e-5). The limiter's norm within LIMIT_RTOL_8BIT (relative)."""
    mesh = cpu_mesh(world)
    sharded, opt, reference, ref_opt = sharded_vs_single(
        rank, world, lambda m: a8._shard(m, mesh), partial(a8.optimizer, settings=FIRA_8BIT),
        model=a8.ThreeMatrices, run=_train_8bit,
    )  # fmt: skip
    where = f"fira 8-bit rank {rank}/{world}"
    assert ref_opt.nonfinite_skips == 0 and opt.nonfinite_skips == 0
    worst = 0.0
    for (name, p), q in zip(sharded.named_parameters(), reference.parameters(), strict=True):
        state, ref_state = opt.state[p], ref_opt.state[q]
        assert sorted(state) == sorted(ref_state), (where, name)
        diff = (full(p) - q).abs().max().item()
        assert diff <= a8.LEFT_ATOL, f"{where}: {name} differs by {diff:.2e}"
        worst = max(worst, diff)
        if name in ("left.weight", "right.weight"):
            assert ref_state["adam.exp_avg"].dtype == torch.uint8, (where, name)
            key = "proj.left.q" if name == "left.weight" else "proj.right.q"
            assert ref_state[key].dtype == torch.int8, (where, name, key)  # int8 basis codes
    _report(rank, f"fira 8-bit world {world}: max |param diff|", worst)
    rel = _check_limiter(opt, ref_opt, sharded, reference, where, LIMIT_RTOL_8BIT)
    _report(rank, f"fira 8-bit world {world}: max rel |limit_norm diff|", rel)
    assert sorted(refresh_counts(opt)) == [3, 3], refresh_counts(opt)
    moved = (full(sharded.left.weight) - a8.ThreeMatrices().left.weight).abs().max().item()
    assert moved > 1e-3, moved


def run_all(rank: int, world: int) -> None:
    """Every config of CONFIGS, then Fira with 8-bit moments (one spawn: start-up is most of
    the cost)."""
    matches_single_process(rank, world, tuple(CONFIGS))
    fira_8bit_matches_single_process(rank, world)


# ---- DCP: save at world 2, load at world 3, continue ---------------------------------------

STOP, END = 10, 20  # refreshes at 0 and 8 before the save, 16 after it


def _built(world: int, name: str):
    model = make_model()
    if world > 1:
        shard(model, world)
    return model, build(model, name)


def dcp_save(rank: int, world: int, root: str, names: tuple[str, ...]) -> None:
    """Train each config to STOP, save, train on to END; keep (rank 0) the full state at the
    save and the uninterrupted run's parameters."""
    for name in names:
        model, opt = _built(world, name)
        train(model, opt, range(STOP), rank, world)
        save_checkpoint(Path(root) / name, STOP, model, opt)
        saved = full_state(model, opt)  # collectives: every rank takes part
        train(model, opt, range(STOP, END), rank, world)
        params = shared.full_params(model)
        if rank == 0:
            torch.save({"saved": saved, "uninterrupted": params}, Path(root) / f"{name}.pt")


def dcp_load(rank: int, world: int, root: str, names: tuple[str, ...]) -> None:
    """The checkpoint at another world size: every state tensor (bases, moments, Muon's
    momentum, the limiter's norm) comes back as saved, and the run continues as if never
    interrupted."""
    for name in names:
        expected = torch.load(Path(root) / f"{name}.pt", weights_only=True)
        model, opt = _built(world, name)
        load_checkpoint(Path(root) / name, model, opt)
        loaded = full_state(model, opt)
        assert sorted(loaded) == sorted(expected["saved"])
        keys = set()
        for pname, tensors in expected["saved"].items():
            assert sorted(loaded[pname]) == sorted(tensors), (name, world, pname)
            for key, value in tensors.items():
                assert torch.equal(loaded[pname][key], value), (name, world, pname, key)
                keys.add(key)
        for p in model.parameters():
            if LIMIT_KEY in opt.state[p]:
                assert_same_across(opt.state[p][LIMIT_KEY], f"{name}: loaded {LIMIT_KEY}")
        is_muon = CONFIGS[name][0] is galore2.GaLoreMuon
        assert ("muon.momentum" if is_muon else LIMIT_KEY) in keys, (name, sorted(keys))
        train(model, opt, range(STOP, END), rank, world)
        worst = 0.0
        for pname, value in shared.full_params(model).items():
            diff = (value - expected["uninterrupted"][pname]).abs().max().item()
            assert diff <= ATOL, f"{name} world {world}: {pname} differs by {diff:.2e}"
            worst = max(worst, diff)
        _report(rank, f"dcp {name} → world {world}: max |param diff| vs uninterrupted", worst)


# ---- HSDP (2 replicas × 2 shards) -----------------------------------------------------------


def hsdp_matches_single_process(rank: int, world: int, names: tuple[str, ...]) -> None:
    """data_parallel_cases' HSDP run for these configs: equal to one process, and every state
    tensor (bases, moments, Muon's momentum, the limiter's norm) bitwise equal across the
    replicas — the norms are reduced over the shard group only."""
    from .data_parallel_cases import _check_replicas, _hsdp

    assert world == 4
    mesh = cpu_mesh(2, 2, names=("replicate", "shard"))
    for name in names:
        model, opt, reference, _ = sharded_vs_single(
            rank, world, partial(_hsdp, mesh=mesh), partial(build, name=name)
        )
        assert_params_match(model, reference, ATOL, f"{name} rank {rank}")
        _report(rank, f"hsdp {name}: max |param diff|", _max_param_diff(model, reference))
        _check_replicas(model, opt, f"{name} rank {rank}", mesh.get_group("replicate"))
